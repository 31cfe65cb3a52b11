"""The segment file format (``man/kvj-segment.5``): one tensor's bytes in CRC'd chunks, a header, a digest.

Pure bytes, no torch (``tensors``) and no storage policy (``store``); ``chunks`` codes the chunks.
The checks, cheapest first: :func:`match_key` (the header's digest is the key asked for),
:func:`check_stored` (header and every stored CRC) and :func:`verify` (every chunk decoded, the digest).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import blake3
import crc32c
import msgspec

from kvj.errors import FormatError, InvalidArgument, SegmentCorrupt
from kvj.fileio import Buffer
from kvj.segments.chunks import ChunkDecoder, ChunkEncoder, crc_mismatch, leaf, pmap, spans
from kvj.segments.codecs.base import MAX_EXPANSION, Element, Filter, Pipeline, field_int
from kvj.segments.codecs.registry import FILTERS, filter_class, filter_names, get_codec
from kvj.segments.source import Source, as_source

MAGIC = b"\x89KVJSEG\n"
END_MAGIC = b"KVJSEGOK"
VERSION = 1
PREAMBLE = struct.Struct("<8sHHI")
TRAILER = struct.Struct("<II8s")
_SIZES = struct.Struct("<QQ")
#: Raw bytes per chunk the writer uses; also the digest's leaf size.
CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 1 << 12
MAX_CHUNK_SIZE = 1 << 26
MAX_HEADER = 16 << 20
MAX_RAW_SIZE = 1 << 36
MAX_NDIM = 64
DIGEST_ALG = "blake3-tree-v1"
_DIGEST_DOMAIN = b"kvj-segment-digest-v1\n"

#: Every dtype with a fixed byte layout, by its header name (little-endian; complex: two floats).
ELEMENTS: Dict[str, Element] = {e.name: e for e in (
    Element("bool", 1, 1, False), Element("uint8", 1, 1, False), Element("int8", 1, 1, False),
    Element("int16", 2, 2, False), Element("int32", 4, 4, False), Element("int64", 8, 8, False),
    Element("uint16", 2, 2, False), Element("uint32", 4, 4, False), Element("uint64", 8, 8, False),
    Element("float16", 2, 2, True), Element("bfloat16", 2, 2, True), Element("float32", 4, 4, True),
    Element("float64", 8, 8, True), Element("complex32", 4, 2, True), Element("complex64", 8, 4, True),
    Element("complex128", 16, 8, True), Element("float8_e4m3fn", 1, 1, True), Element("float8_e5m2", 1, 1, True),
    Element("float8_e4m3fnuz", 1, 1, True), Element("float8_e5m2fnuz", 1, 1, True),
    Element("float8_e8m0fnu", 1, 1, True),
)}

Layout = Optional[Dict[str, Any]]


def element(dtype: str) -> Element:
    """The element a header's dtype name stands for; FormatError for names the format lacks."""
    try:
        return ELEMENTS[dtype]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {dtype!r}") from None


def _layout_json(layout: Layout) -> str:
    """``layout`` as canonical JSON; FormatError unless it is JSON-shaped with 64-bit integers."""
    if layout is not None and not isinstance(layout, (dict, Mapping)):  # dict first: typing's check is slow
        raise FormatError("layout must be a map")
    try:
        text = json.dumps(layout, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"layout is not plain JSON data: {exc}") from None
    _check_ints(layout)
    return text


def _check_ints(value: Any) -> None:
    """Refuse an integer MessagePack cannot hold before anything is written."""
    if type(value) is int and not -(1 << 63) <= value < (1 << 64):
        raise FormatError(f"layout holds the integer {value}, outside the 64-bit range a segment header holds")
    if isinstance(value, (dict, list)):
        for item in value.values() if isinstance(value, dict) else value:
            _check_ints(item)


def canonical_layout(layout: Layout) -> Dict[str, Any]:
    """``layout`` as every writer keys it: checked JSON-shaped, and None as the empty map (one key per tensor)."""
    return {} if layout is None else json.loads(_layout_json(layout))


def _descriptor(dtype: str, shape: Sequence[int], layout_json: str) -> bytes:
    # canonical JSON of {"dtype", "layout", "shape"}, built from the layout's JSON (parsed once)
    return f'{{"dtype":{json.dumps(dtype)},"layout":{layout_json},"shape":[{",".join(map(str, shape))}]}}'.encode()


def descriptor(dtype: str, shape: Sequence[int], layout: Layout) -> bytes:
    """Canonical JSON of what the raw bytes mean; part of the digest."""
    return _descriptor(dtype, [int(d) for d in shape], _layout_json(layout))


def _digest(desc: bytes, chunk_size: int, raw_size: int, leaves: Iterable[bytes]) -> bytes:
    h = blake3.blake3(_DIGEST_DOMAIN)
    h.update(desc)
    h.update(_SIZES.pack(chunk_size, raw_size))
    for one in leaves:
        h.update(one)
    return h.digest()


def compute_digest(raw: memoryview, dtype: str, shape: Sequence[int], layout: Layout,
                   pool: Optional[Executor] = None, chunk_size: int = CHUNK_SIZE) -> bytes:
    """The segment digest: BLAKE3 over the descriptor, the sizes and each chunk's BLAKE3 leaf (in parallel)."""
    leaves = pmap(pool, lambda c: leaf(raw[c[0]:c[0] + c[1]]), spans(len(raw), chunk_size))
    return _digest(descriptor(dtype, shape, layout), chunk_size, len(raw), leaves)


@dataclass(frozen=True)
class Header:
    """A parsed, validated segment header."""

    dtype: str
    shape: Tuple[int, ...]
    layout: Layout
    codec: str
    params: Dict[str, Any]
    raw_size: int
    chunk_size: int
    payload_size: int
    chunks: Tuple[Tuple[int, int], ...]
    stored_size: int
    digest: bytes
    #: The filter the payload went through (its name, which is also its header field), or None.
    filter: Optional[str] = None
    filter_field: Optional[Dict[str, Any]] = None
    #: :func:`descriptor` as parsing made it (empty: not made yet).
    descriptor_json: bytes = dataclasses.field(default=b"", compare=False, repr=False)

    def descriptor(self) -> bytes:
        return self.descriptor_json or descriptor(self.dtype, self.shape, self.layout)

    def to_map(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "dtype": self.dtype, "shape": list(self.shape), "layout": self.layout,
            "codec": self.codec, "params": self.params, "raw_size": self.raw_size,
            "chunk_size": self.chunk_size, "payload_size": self.payload_size,
            "chunks": [list(c) for c in self.chunks], "stored_size": self.stored_size,
            "digest_alg": DIGEST_ALG, "digest": self.digest,
        }
        out.update(dict.fromkeys(FILTERS))  # kvj's own filters' fields are always there, nil when unused
        if self.filter is not None:
            out[self.filter] = self.filter_field
        return out

    def stored_filter(self, name: str = "<segment>") -> Optional[Filter]:
        """The filter rebuilt from its header field (None without one); SegmentCorrupt if it does not fit."""
        if self.filter is None:
            return None
        try:
            return filter_class(self.filter).from_field(self.filter_field, self.raw_size, self.payload_size,
                                                        self.stored_size)
        except FormatError as exc:
            raise SegmentCorrupt(name, None, str(exc)) from None


class EncodedSegment:
    """A segment being encoded: ``parts()`` yields the file's bytes as chunks are done (disk writes
    overlap compression); ``header`` and ``file_size`` are set at its end."""

    def __init__(self, encoder: ChunkEncoder, shape: Tuple[int, ...], layout: Dict[str, Any],
                 digest: Optional[bytes]):
        self.encoder, self.shape, self.layout, self.digest = encoder, shape, layout, digest
        self.header: Optional[Header] = None
        self.file_size = 0

    def parts(self) -> Iterator[Buffer]:
        preamble = PREAMBLE.pack(MAGIC, VERSION, 0, 0)
        yield preamble
        size = len(preamble)
        table: List[Tuple[int, int]] = []
        for body, crc in self.encoder.pieces():
            table.append((len(body), crc))
            size += len(body)
            yield body
        self.header = self._header(table)
        head = msgspec.msgpack.encode(self.header.to_map())
        if len(head) > MAX_HEADER:
            raise FormatError("segment header too large")
        yield head
        trailer = TRAILER.pack(len(head), crc32c.crc32c(head, crc32c.crc32c(preamble)), END_MAGIC)
        yield trailer
        self.file_size = size + len(head) + len(trailer)

    def _header(self, table: List[Tuple[int, int]]) -> Header:
        """The header, once every piece's (stored length, CRC) is in ``table``."""
        enc = self.encoder
        name = field = None
        side = 0
        if enc.filtered:
            side, crc = table[0]
            table = table[1:]
            name, field = enc.filter_name, enc.filtered.field(crc)
        digest = self.digest
        if digest is None:
            digest = _digest(descriptor(enc.element.name, self.shape, self.layout), CHUNK_SIZE, len(enc.raw),
                             enc.leaves())
        return Header(dtype=enc.element.name, shape=self.shape, layout=self.layout, codec=enc.codec.name,
                      params=dict(enc.codec.params), raw_size=len(enc.raw), chunk_size=CHUNK_SIZE,
                      payload_size=enc.payload_size, chunks=tuple(table),
                      stored_size=sum(t[0] for t in table) + side, digest=digest, filter=name, filter_field=field)


def encode(raw: memoryview, *, dtype: str, shape: Sequence[int], layout: Layout, digest: Optional[bytes],
           pipeline: Pipeline, pool: Optional[Executor] = None) -> EncodedSegment:
    """Encode a tensor's C-order bytes through ``pipeline``; ``digest`` is :func:`compute_digest` of
    them, or None to compute it alongside compression."""
    elem = element(dtype)
    shape = tuple(int(d) for d in shape)
    if len(raw) != math.prod(shape) * elem.itemsize:
        raise FormatError("raw size does not match dtype and shape")
    layout = canonical_layout(layout)
    encoder = ChunkEncoder(raw, elem, CHUNK_SIZE, digest is not None, pipeline, pool)
    return EncodedSegment(encoder, shape, layout, digest)


def _validate(m: Any, file_size: int, header_len: int) -> Header:
    if not isinstance(m, dict):
        raise FormatError("header is not a map")
    dtype = m.get("dtype")
    elem = element(dtype)
    shape = m.get("shape")
    # ``type(x) is int``: msgpack makes plain ints, and a bool is not one
    if type(shape) is not list or len(shape) > MAX_NDIM or not all(
            type(d) is int and 0 <= d <= MAX_RAW_SIZE for d in shape):
        raise FormatError("bad shape")
    raw_size = field_int(m, "raw_size", 0, MAX_RAW_SIZE)
    if math.prod(shape) * elem.itemsize != raw_size:
        raise FormatError("raw_size does not match dtype and shape")
    chunk_size = field_int(m, "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
    if chunk_size & (chunk_size - 1):
        raise FormatError("chunk_size is not a power of two")
    layout_json = _layout_json(m.get("layout"))  # FormatError unless plain JSON data
    layout = json.loads(layout_json)
    if m.get("digest_alg") != DIGEST_ALG:
        raise FormatError(f"unknown digest algorithm {m.get('digest_alg')!r}")
    digest = m.get("digest")
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise FormatError("bad digest field")
    codec = get_codec(m.get("codec"), m.get("params"))
    stored_size = field_int(m, "stored_size")
    if PREAMBLE.size + stored_size + header_len + TRAILER.size != file_size:
        raise FormatError("sizes in header do not add up to the file size")
    payload_size = field_int(m, "payload_size", 0, raw_size)
    named = [name for name in filter_names() if m.get(name) is not None]  # at most one filter
    if len(named) > 1:
        raise FormatError(f"header names more than one filter ({', '.join(named)})")
    filter_name = filter_field = None
    side = 0
    if named:
        filter_name = named[0]
        filt = filter_class(filter_name).from_field(m[filter_name], raw_size, payload_size, stored_size)
        filter_field, side = filt.field(), filt.side_size
    elif payload_size != raw_size:
        raise FormatError("payload_size differs from raw_size without a filter")
    if payload_size % elem.word:
        raise FormatError("payload is not whole elements")
    table = m.get("chunks")
    n_chunks = -(-payload_size // chunk_size)
    if not isinstance(table, list) or len(table) != n_chunks:
        raise FormatError("chunk table length does not match the payload size")
    chunks = []
    total = side
    for i, entry in enumerate(table):
        if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not int or type(entry[1]) is not int:
            raise FormatError(f"chunk table entry {i} malformed")
        stored, crc = entry
        raw_len = min(chunk_size, payload_size - i * chunk_size)
        if not 1 <= stored or stored * MAX_EXPANSION < raw_len or not 0 <= crc <= 0xFFFFFFFF:
            raise FormatError(f"chunk {i} sizes implausible")
        total += stored
        chunks.append((stored, crc))
    if total != stored_size:
        raise FormatError("chunk table does not add up to stored_size")
    return Header(dtype=dtype, shape=tuple(shape), layout=layout, codec=codec.name,
                  params=dict(codec.params), raw_size=raw_size, chunk_size=chunk_size,
                  payload_size=payload_size, chunks=tuple(chunks), stored_size=stored_size,
                  digest=digest, filter=filter_name, filter_field=filter_field,
                  descriptor_json=_descriptor(dtype, shape, layout_json))


def match_key(header: Header, key: Optional[str], name: str) -> Header:
    """``header``, refused (SegmentCorrupt) unless its digest is ``key`` (None: any)."""
    if key is not None and header.digest.hex() != key:
        raise SegmentCorrupt(name, None, "header digest does not match the key")
    return header


def read_header(data: Union[Buffer, Source], name: str = "<segment>", key: Optional[str] = None) -> Header:
    """Parse and validate a segment file's header (the file in memory or a Source), refused
    unless its digest is ``key`` when one is given."""
    src = as_source(data, name)
    name, size = src.name, src.size
    if size < PREAMBLE.size + TRAILER.size:
        raise SegmentCorrupt(name, None, f"file too short for a segment ({size} bytes)")
    hlen, crc, end = TRAILER.unpack(bytes(src.read(size - TRAILER.size, TRAILER.size)))
    if end != END_MAGIC:
        raise SegmentCorrupt(name, size - TRAILER.size, "end magic missing (truncated or not a segment)")
    if hlen > MAX_HEADER or hlen > size - PREAMBLE.size - TRAILER.size:
        raise SegmentCorrupt(name, size - TRAILER.size, f"header length {hlen} implausible")
    at = size - TRAILER.size - hlen
    head = bytes(src.read(at, hlen))
    preamble = bytes(src.read(0, PREAMBLE.size))
    magic, version, flags, _reserved = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise SegmentCorrupt(name, 0, "bad magic (not a kvj segment)")
    if crc32c.crc32c(head, crc32c.crc32c(preamble)) != crc:
        raise SegmentCorrupt(name, at, "header CRC mismatch")
    if version != VERSION or flags:
        raise FormatError(f"{name}: segment version {version} flags {flags} not supported")
    try:
        header = _validate(msgspec.msgpack.decode(head), size, hlen)
    except FormatError as exc:
        raise SegmentCorrupt(name, at, str(exc)) from None
    except Exception as exc:  # a malformed header: msgspec's DecodeError, RecursionError, ...
        raise SegmentCorrupt(name, at, f"header does not parse: {exc}") from None
    return match_key(header, key, name)


def check_stored(data: Buffer, name: str = "<segment>", key: Optional[str] = None) -> Header:
    """Check the header (against ``key`` when given) and every stored CRC, without decoding."""
    view = memoryview(data).cast("B")
    header = read_header(view, name, key)
    pos = PREAMBLE.size
    filt = header.stored_filter(name)
    if filt is not None:
        crc_mismatch(name, filt.side_name, pos, filt.side_size, view[pos:pos + filt.side_size], filt.side_crc)
        pos += filt.side_size
    for i, (stored, crc) in enumerate(header.chunks):
        crc_mismatch(name, f"chunk {i}", pos, stored, view[pos:pos + stored], crc)
        pos += stored
    return header


def _check_digest(header: Header, leaves: Iterable[bytes], name: str) -> Header:
    """``header``, refused unless ``leaves`` (the decoded raw bytes' leaves) make its digest."""
    if _digest(header.descriptor(), header.chunk_size, header.raw_size, leaves) != header.digest:
        raise SegmentCorrupt(name, None, "digest mismatch: decoded bytes are not what was stored")
    return header


def decode_into(data: Union[Buffer, Source], out: memoryview, *, name: str = "<segment>",
                pool: Optional[Executor] = None, header: Optional[Header] = None) -> Header:
    """Decode a whole segment file into ``out`` (exactly ``raw_size`` bytes), every chunk CRC and
    the digest checked; its header (``header``: :func:`read_header` of it, when parsed already)."""
    source = as_source(data, name)
    header = header or read_header(source)
    if len(out) != header.raw_size:
        raise InvalidArgument(f"{source.name}: decoding {header.raw_size} bytes into a buffer of {len(out)}")
    chunks = ChunkDecoder(source, header, PREAMBLE.size, element(header.dtype).word)
    unfilter = chunks.unfilter
    if unfilter is None:
        leaves = chunks.leaves(pool, lambda job: out[job.raw_offset:job.raw_offset + job.raw_len])
    else:
        # Undo the filter in parallel, each digest leaf's range hashed as soon as it is filled.
        unfilter.prepare(chunks.payload(pool), out, pool)

        def fill_and_leaf(c: Tuple[int, int]) -> bytes:
            unfilter.fill(c[0], c[1])
            return leaf(out[c[0]:c[0] + c[1]])
        leaves = pmap(pool, fill_and_leaf, spans(header.raw_size, header.chunk_size))
    return _check_digest(header, leaves, source.name)


def verify(data: Union[Buffer, Source], *, name: str = "<segment>", pool: Optional[Executor] = None,
           header: Optional[Header] = None) -> Header:
    """Check a whole segment file as :func:`decode_into` does, holding a chunk at a time, not its raw bytes.

    Whatever size a header declares, a check takes a chunk's memory per thread (a filtered
    segment holds its payload and rebuilds the raw bytes a leaf at a time).
    """
    import numpy as np

    source = as_source(data, name)
    header = header or read_header(source)
    chunks = ChunkDecoder(source, header, PREAMBLE.size, element(header.dtype).word)
    if chunks.unfilter is None:
        leaves = chunks.leaves(pool, lambda job: memoryview(np.empty(job.raw_len, np.uint8)).cast("B"))
    else:
        read = chunks.unfilter.reader(chunks.payload(pool), header.raw_size, pool)
        leaves = pmap(pool, lambda c: leaf(read(c[0], c[1])), spans(header.raw_size, header.chunk_size))
    return _check_digest(header, leaves, source.name)


def check_raw_limit(header: Header, name: str, max_raw: int) -> None:
    """Refuse a segment declaring more than ``max_raw`` raw bytes (before anything is allocated)."""
    if header.raw_size > max_raw:
        raise FormatError(f"{name} declares {header.raw_size} raw bytes, more than the limit of {max_raw} "
                          "(max_segment_bytes)")
