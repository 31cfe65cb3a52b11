"""The segment file format in bytes: one tensor's bytes, checksummed chunks, a verifiable digest.

Pure bytes <-> (header, bytes); no torch (``tensors.py`` makes tensors of what this decodes)
and no I/O policy (``store.py``). The format is specified in ``man/kvj-segment.5``; the
constants below are the ones named there.

File layout (integers little-endian)::

    preamble  16 B   magic "\\x89KVJSEG\\n", u16 version, u16 flags (0), u32 reserved (0)
    body      ...    [filter side data] chunk 0 .. chunk n-1 (stored bytes, back to back)
    header    H B    msgpack map (dtype, shape, codec, sizes, chunk table, digest, layout, filter)
    trailer   16 B   u32 H, u32 CRC32C(preamble || header), end magic "KVJSEGOK"

The header sits at the end so chunks can be written as they are compressed. Every chunk has
its own CRC32C; the digest (BLAKE3 tree over the raw bytes and a canonical descriptor) is the
segment's content address and is verified on every decode. A segment is encoded by a
``codecs.Pipeline``: an optional filter over the whole raw bytes, then the chunk codec.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import struct
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, Union)

import blake3
import crc32c
import msgspec

from kvj.errors import FormatError, InvalidArgument, SegmentCorrupt
from kvj.fileio import Buffer
from kvj.segments.backend import BytesSource, Source
from kvj.segments.codecs.base import MAX_EXPANSION, Element, Filter, Filtered, Pipeline, Unfilter, field_int
from kvj.segments.codecs.raw import RawCodec
from kvj.segments.codecs.registry import FILTERS, filter_class, filter_names, get_codec

if TYPE_CHECKING:
    import numpy as np

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

#: Every dtype with a fixed byte layout, by the name the header stores (little-endian, as torch
#: lays them out in memory; a complex number is two floats).
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
    """``layout`` as canonical JSON (keys sorted, no spaces, ASCII escapes, no NaN); FormatError
    unless it is JSON-shaped (str keys; str/int/float/bool/None/list/map)."""
    if layout is not None and not isinstance(layout, (dict, Mapping)):  # dict first: typing's check is slow
        raise FormatError("layout must be a map")
    try:
        text = json.dumps(layout, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"layout is not plain JSON data: {exc}") from None
    _check_ints(layout)
    return text


def _check_ints(value: Any) -> None:
    """The header is MessagePack, whose integers are 64-bit: a larger one is refused here, before
    anything is written, rather than failing the header's encoding."""
    if type(value) is int:
        if not -(1 << 63) <= value < (1 << 64):
            raise FormatError(f"layout holds the integer {value}, outside the 64-bit range a segment header holds")
    elif isinstance(value, dict):
        for item in value.values():
            _check_ints(item)
    elif isinstance(value, list):
        for item in value:
            _check_ints(item)


def canonical_layout(layout: Layout) -> Dict[str, Any]:
    """``layout`` as every writer keys it: checked JSON-shaped (str keys; str/int/float/bool/None/
    list/map), and no layout at all as the empty map, so one tensor has one key however it is stored."""
    return {} if layout is None else json.loads(_layout_json(layout))


def _descriptor(dtype: str, shape: Sequence[int], layout_json: str) -> bytes:
    # the canonical JSON of {"dtype", "layout", "shape"} (keys in sorted order), assembled from
    # the layout's canonical JSON so that a parsed header serialises its layout once
    return f'{{"dtype":{json.dumps(dtype)},"layout":{layout_json},"shape":[{",".join(map(str, shape))}]}}'.encode()


def descriptor(dtype: str, shape: Sequence[int], layout: Layout) -> bytes:
    """Canonical JSON of what the raw bytes mean; part of the digest."""
    return _descriptor(dtype, [int(d) for d in shape], _layout_json(layout))


def _chunks(n: int, size: int) -> List[Tuple[int, int]]:
    return [(off, min(size, n - off)) for off in range(0, n, size)]


#: Tasks :func:`_map` keeps submitted at once: enough to keep any pool busy, few enough that a
#: header of millions of tiny chunks does not become millions of futures (2 KB each).
_IN_FLIGHT = 64


def _map(pool: Optional[Executor], fn: Callable, items: Sequence) -> List:
    """``[fn(it) for it in items]``, run in ``pool`` (at most ``_IN_FLIGHT`` submitted at a time).

    On the first error the tasks not yet started are cancelled and the running ones waited for,
    so none still writes into a caller's buffer once this raises."""
    if pool is None or len(items) <= 1:
        return [fn(it) for it in items]
    results: List = []
    pending: Deque[Future] = collections.deque()
    try:
        for item in items:
            if len(pending) == _IN_FLIGHT:
                results.append(pending.popleft().result())
            pending.append(pool.submit(fn, item))
        while pending:
            results.append(pending.popleft().result())
    finally:
        for fut in pending:
            fut.cancel()
        wait(pending)
    return results


def _leaf(view: memoryview) -> bytes:
    # blake3 releases the GIL for inputs this large, so leaves hash in parallel threads; its
    # own max_threads does not help here (the pool already keeps both cores busy).
    return blake3.blake3(view).digest()


def digest_from_leaves(dtype: str, shape: Sequence[int], layout: Layout, chunk_size: int,
                       raw_size: int, leaves: Iterable[bytes]) -> bytes:
    return _digest(descriptor(dtype, shape, layout), chunk_size, raw_size, leaves)


def _digest(desc: bytes, chunk_size: int, raw_size: int, leaves: Iterable[bytes]) -> bytes:
    h = blake3.blake3(_DIGEST_DOMAIN)
    h.update(desc)
    h.update(_SIZES.pack(chunk_size, raw_size))
    for leaf in leaves:
        h.update(leaf)
    return h.digest()


def compute_digest(raw: memoryview, dtype: str, shape: Sequence[int], layout: Layout,
                   pool: Optional[Executor] = None, chunk_size: int = CHUNK_SIZE) -> bytes:
    """The segment digest: BLAKE3 over the descriptor, sizes and per-chunk BLAKE3 leaves.

    Leaves are independent, so hashing runs in parallel; the tree is fixed by ``chunk_size``.
    """
    leaves = _map(pool, lambda c: _leaf(raw[c[0]:c[0] + c[1]]), _chunks(len(raw), chunk_size))
    return digest_from_leaves(dtype, shape, layout, chunk_size, len(raw), leaves)


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
    #: :func:`descriptor` of dtype, shape and layout, as parsing made it (empty: not made yet).
    descriptor_json: bytes = dataclasses.field(default=b"", compare=False, repr=False)

    def descriptor(self) -> bytes:
        """What the digest says the raw bytes mean (:func:`descriptor`)."""
        return self.descriptor_json or descriptor(self.dtype, self.shape, self.layout)

    def to_map(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "dtype": self.dtype, "shape": list(self.shape), "layout": self.layout,
            "codec": self.codec, "params": self.params, "raw_size": self.raw_size,
            "chunk_size": self.chunk_size, "payload_size": self.payload_size,
            "chunks": [list(c) for c in self.chunks], "stored_size": self.stored_size,
            "digest_alg": DIGEST_ALG, "digest": self.digest,
        }
        for name in FILTERS:  # kvj's own filters' fields are always there, nil when unused
            out[name] = None
        if self.filter is not None:
            out[self.filter] = self.filter_field
        return out

    def stored_filter(self) -> Optional[Filter]:
        """The filter, rebuilt from its header field (None without one)."""
        if self.filter is None:
            return None
        return filter_class(self.filter).from_field(self.filter_field, self.raw_size, self.payload_size,
                                                    self.stored_size)


class EncodedSegment:
    """A segment being encoded: iterate ``parts()`` to get the file's bytes in order.

    Chunks are compressed in parallel; ``parts()`` yields each as soon as it and those before
    it are done, so the writer overlaps disk writes with compression. ``header`` and
    ``file_size`` are set once ``parts()`` is exhausted.
    """

    def __init__(self, make_header: Callable[[List[Tuple[int, int]]], Header],
                 pieces: Iterator[Tuple[Buffer, int]]):
        self._make_header = make_header
        self._pieces = pieces
        self.header: Optional[Header] = None
        self.file_size = 0

    def parts(self) -> Iterator[Buffer]:
        preamble = PREAMBLE.pack(MAGIC, VERSION, 0, 0)
        yield preamble
        size = len(preamble)
        table: List[Tuple[int, int]] = []
        for body, crc in self._pieces:
            table.append((len(body), crc))
            size += len(body)
            yield body
        self.header = self._make_header(table)
        head = msgspec.msgpack.encode(self.header.to_map())
        if len(head) > MAX_HEADER:
            raise FormatError("segment header too large")
        yield head
        trailer = TRAILER.pack(len(head), crc32c.crc32c(head, crc32c.crc32c(preamble)), END_MAGIC)
        yield trailer
        self.file_size = size + len(head) + len(trailer)


class SegmentEncoder:
    """Encodes the C-order bytes of one tensor into a segment, through its pipeline: the filter
    (if any) over the whole bytes, then the chunk codec on each chunk of the filtered payload.

    The digest's leaves (BLAKE3 of each raw chunk) come one of three ways:

    - *given*: the caller passed the digest (the store hashes small segments first);
    - *fused*: without a filter the payload chunks are the raw chunks, so each chunk task
      hashes what it encodes while it is in cache;
    - *separate*: with a filter the payload is not the raw bytes, so the leaves are pool tasks
      of their own, started before the filter runs when a pool is there.
    """

    def __init__(self, raw: memoryview, *, dtype: str, shape: Sequence[int], layout: Layout,
                 digest: Optional[bytes], pipeline: Pipeline, pool: Optional[Executor]):
        self.element = element(dtype)
        self.shape = tuple(int(d) for d in shape)
        if len(raw) != math.prod(self.shape) * self.element.itemsize:
            raise FormatError("raw size does not match dtype and shape")
        self.raw, self.layout, self.digest, self.pool = raw, canonical_layout(layout), digest, pool
        self.codec = pipeline.codec
        self.filter_name = pipeline.filter.name if pipeline.filter is not None else None
        self.leaf_futures: List[Future] = []
        self.filtered = self._filter(pipeline.filter)
        self.payload_size = self.filtered.out_size if self.filtered else len(raw)
        self.spans = _chunks(self.payload_size, CHUNK_SIZE)
        self.fused = digest is None and self.filtered is None and not self.leaf_futures
        self.fused_leaves: List[bytes] = []

    def _filter(self, filt: Optional[Filter]) -> Optional[Filtered]:
        """The raw bytes through ``filt`` (None without one, or when it does not pay)."""
        if filt is None:
            return None
        if self.digest is None and self.pool is not None:  # the pool hashes while the filter runs
            self.leaf_futures = [self.pool.submit(_leaf, self.raw[o:o + n])
                                 for o, n in _chunks(len(self.raw), CHUNK_SIZE)]
        return filt.encode(self.raw, self.pool)

    def _chunk(self, span: Tuple[int, int]) -> memoryview:
        off, n = span
        return self.filtered.chunk(off, n) if self.filtered else self.raw[off:off + n]

    def _encode(self, span: Tuple[int, int]) -> Tuple[Buffer, int, Optional[bytes]]:
        """One chunk's stored bytes, their CRC, and (fused) its digest leaf."""
        chunk = self._chunk(span)
        body = self.codec.encode(chunk, self.element.word)
        return body, crc32c.crc32c(body), _leaf(chunk) if self.fused else None

    def pieces(self) -> Iterator[Tuple[Buffer, int]]:
        """(stored bytes, CRC) of the filter's side data, if any, then of every chunk, in file order."""
        if self.filtered:
            side = self.filtered.side
            yield side, crc32c.crc32c(side)
        if self.pool is None or len(self.spans) <= 1:
            for span in self.spans:
                body, crc, leaf = self._encode(span)
                if leaf is not None:
                    self.fused_leaves.append(leaf)
                yield body, crc
            return
        separate = self.digest is None and not self.fused and not self.leaf_futures
        leaf_spans = _chunks(len(self.raw), CHUNK_SIZE) if separate else []
        futures = []
        for i in range(max(len(self.spans), len(leaf_spans))):  # interleaved: hashing keeps pace
            if i < len(self.spans):
                futures.append(self.pool.submit(self._encode, self.spans[i]))
            if i < len(leaf_spans):
                o, n = leaf_spans[i]
                self.leaf_futures.append(self.pool.submit(_leaf, self.raw[o:o + n]))
        try:
            for fut in futures:
                body, crc, leaf = fut.result()
                if leaf is not None:
                    self.fused_leaves.append(leaf)
                yield body, crc
        finally:
            for fut in futures:
                fut.cancel()

    def _final_digest(self) -> bytes:
        if self.digest is not None:
            return self.digest
        if self.fused:
            leaves = self.fused_leaves
        elif self.leaf_futures:
            leaves = [f.result() for f in self.leaf_futures]
        else:
            leaves = [_leaf(self.raw[o:o + n]) for o, n in _chunks(len(self.raw), CHUNK_SIZE)]
        return digest_from_leaves(self.element.name, self.shape, self.layout, CHUNK_SIZE, len(self.raw), leaves)

    def header(self, table: List[Tuple[int, int]]) -> Header:
        """The header, once every piece's (stored length, CRC) is in ``table``."""
        name = field = None
        side = 0
        if self.filtered:
            side, crc = table[0]
            table = table[1:]
            name, field = self.filter_name, self.filtered.field(crc)
        return Header(dtype=self.element.name, shape=self.shape, layout=self.layout, codec=self.codec.name,
                      params=dict(self.codec.params), raw_size=len(self.raw), chunk_size=CHUNK_SIZE,
                      payload_size=self.payload_size, chunks=tuple(table),
                      stored_size=sum(t[0] for t in table) + side, digest=self._final_digest(),
                      filter=name, filter_field=field)


def encode(raw: memoryview, *, dtype: str, shape: Sequence[int], layout: Layout, digest: Optional[bytes],
           pipeline: Pipeline, pool: Optional[Executor] = None) -> EncodedSegment:
    """Encode the C-order bytes ``raw`` of a tensor of ``dtype`` (a header dtype name) through
    ``pipeline`` (``codecs.auto.choose``; see :class:`SegmentEncoder`).

    ``digest`` is :func:`compute_digest` of the same data, or None to compute it alongside
    compression (in the pool, as the chunks go by); either way ``header.digest`` holds it.
    """
    encoder = SegmentEncoder(raw, dtype=dtype, shape=shape, layout=layout, digest=digest, pipeline=pipeline,
                             pool=pool)
    return EncodedSegment(encoder.header, encoder.pieces())


# --------------------------------------------------------------------------- parsing


def _corrupt(name: str, offset: Optional[int], reason: str) -> SegmentCorrupt:
    return SegmentCorrupt(name, offset, reason)


def _header_filter(m: Dict[str, Any], raw_size: int, payload_size: int,
                   stored_size: int) -> Tuple[Optional[str], Optional[Dict[str, Any]], int]:
    """The filter a header names (at most one), its field as read back, its side data's size."""
    named = [name for name in filter_names() if m.get(name) is not None]
    if len(named) > 1:
        raise FormatError(f"header names more than one filter ({', '.join(named)})")
    if not named:
        if payload_size != raw_size:
            raise FormatError("payload_size differs from raw_size without a filter")
        return None, None, 0
    name = named[0]
    filt = filter_class(name).from_field(m[name], raw_size, payload_size, stored_size)
    return name, filt.field(), filt.side_size


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
    filter_name, filter_field, side = _header_filter(m, raw_size, payload_size, stored_size)
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


def header_location(tail: bytes, file_size: int, name: str = "<segment>") -> Tuple[int, int, int]:
    """From the last 16 bytes of a file: (header offset, header length, expected header CRC)."""
    if file_size < PREAMBLE.size + TRAILER.size or len(tail) != TRAILER.size:
        raise _corrupt(name, None, f"file too short for a segment ({file_size} bytes)")
    header_len, crc, end = TRAILER.unpack(tail)
    if end != END_MAGIC:
        raise _corrupt(name, file_size - TRAILER.size, "end magic missing (truncated or not a segment)")
    if header_len > MAX_HEADER or header_len > file_size - PREAMBLE.size - TRAILER.size:
        raise _corrupt(name, file_size - TRAILER.size, f"header length {header_len} implausible")
    return file_size - TRAILER.size - header_len, header_len, crc


def parse_header(preamble: bytes, head: bytes, crc: int, file_size: int, name: str = "<segment>") -> Header:
    """Validate the preamble and header bytes (located with :func:`header_location`)."""
    magic, version, flags, _reserved = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise _corrupt(name, 0, "bad magic (not a kvj segment)")
    if crc32c.crc32c(head, crc32c.crc32c(preamble)) != crc:
        raise _corrupt(name, file_size - TRAILER.size - len(head), "header CRC mismatch")
    if version != VERSION or flags:
        raise FormatError(f"{name}: segment version {version} flags {flags} not supported")
    try:
        m = msgspec.msgpack.decode(head)
        return _validate(m, file_size, len(head))
    except FormatError as exc:
        raise _corrupt(name, file_size - TRAILER.size - len(head), str(exc)) from None
    except Exception as exc:  # a malformed header: msgspec's DecodeError, RecursionError, ...
        raise _corrupt(name, file_size - TRAILER.size - len(head), f"header does not parse: {exc}") from None


def as_source(data: Union[Buffer, Source], name: str = "<segment>") -> Source:
    """``data`` as a :class:`Source` (a file in memory becomes a ``BytesSource``)."""
    return data if isinstance(data, Source) else BytesSource(data, name)


#: Files up to this size are read whole, in one read, before they are parsed (a small tensor's
#: segment is a few hundred bytes); larger ones are read by offset, chunk by chunk.
WHOLE_READ_BYTES = 1 << 16


def whole_if_small(src: Source) -> Source:
    """``src``, read into memory in one read when it is a small file (parsing it then makes no
    more system calls: one read instead of one per part of the file)."""
    if isinstance(src, BytesSource) or src.size > WHOLE_READ_BYTES:
        return src
    data = bytearray(src.size)
    src.read_into(0, memoryview(data))
    return BytesSource(data, src.name)


def read_header(data: Union[Buffer, Source], name: str = "<segment>") -> Header:
    """Parse and validate the header of a segment file (in memory or a :class:`Source`)."""
    src = as_source(data, name)
    size = src.size
    if size < PREAMBLE.size + TRAILER.size:
        raise _corrupt(src.name, None, f"file too short for a segment ({size} bytes)")
    off, hlen, crc = header_location(bytes(src.read(size - TRAILER.size, TRAILER.size)), size, src.name)
    head = bytes(src.read(off, hlen))
    return parse_header(bytes(src.read(0, PREAMBLE.size)), head, crc, size, src.name)


def check_stored(data: Buffer, name: str = "<segment>") -> Header:
    """Check the header and every stored CRC without decoding (cheap: no decompression)."""
    view = memoryview(data).cast("B")
    header = read_header(view, name)
    pos = PREAMBLE.size
    filt = _stored_filter(header, name)
    if filt is not None:
        if crc32c.crc32c(view[pos:pos + filt.side_size]) != filt.side_crc:
            raise _corrupt(name, pos, f"{filt.side_name} CRC mismatch: the damage is somewhere in its bytes "
                                      f"{pos}..{pos + filt.side_size}")
        pos += filt.side_size
    for i, (stored, crc) in enumerate(header.chunks):
        if crc32c.crc32c(view[pos:pos + stored]) != crc:
            raise _corrupt(name, pos, f"chunk {i} CRC mismatch: the damage is somewhere in its bytes "
                                      f"{pos}..{pos + stored}")
        pos += stored
    return header


def _stored_filter(header: Header, name: str) -> Optional[Filter]:
    try:
        return header.stored_filter()
    except FormatError as exc:
        raise _corrupt(name, None, str(exc)) from None


class _Job(NamedTuple):
    """One chunk: its index, where its stored bytes are and their CRC, where its decoded bytes go."""

    index: int
    offset: int
    stored: int
    crc: int
    raw_offset: int
    raw_len: int


class _Chunks:
    """One segment's chunks, each read, CRC-checked and decoded on its own (by any thread), and
    its filter undone: what :func:`decode_into` and :func:`verify` share.

    The filter's side data is read and checked here, so it is in memory; no chunk is, until a
    task decodes it into the buffer it is given.
    """

    def __init__(self, source: Source, header: Header):
        self.source, self.header, self.name = source, header, source.name
        self.codec = get_codec(header.codec, header.params)
        self.wsize = element(header.dtype).word
        self.in_place = isinstance(self.codec, RawCodec)  # stored bytes are the raw bytes: read them into place
        filt = _stored_filter(header, self.name)
        pos = PREAMBLE.size
        self.unfilter: Optional[Unfilter] = None
        if filt is not None:
            side = bytes(source.read(pos, filt.side_size))
            if crc32c.crc32c(side) != filt.side_crc:
                raise _corrupt(self.name, pos, f"{filt.side_name} CRC mismatch: the damage is somewhere in its "
                                               f"bytes {pos}..{pos + filt.side_size}")
            try:
                self.unfilter = filt.decoder(side, header.payload_size)
            except FormatError as exc:
                raise _corrupt(self.name, pos, str(exc)) from None
            pos += filt.side_size
        self.jobs: List[_Job] = []
        for i, (stored, crc) in enumerate(header.chunks):
            raw_off = i * header.chunk_size
            self.jobs.append(_Job(i, pos, stored, crc, raw_off, min(header.chunk_size, header.payload_size - raw_off)))
            pos += stored

    def decode(self, job: _Job, dest: memoryview) -> None:
        """Read chunk ``job``, check its CRC and decode it into ``dest`` (exactly its raw length);
        a chunk that does not decode to exactly that is corrupt."""
        if self.in_place and job.stored == job.raw_len:
            self.source.read_into(job.offset, dest)
            body: memoryview = dest
        else:
            body = self.source.read(job.offset, job.stored)
        if crc32c.crc32c(body) != job.crc:
            raise _corrupt(self.name, job.offset, f"chunk {job.index} CRC mismatch: the damage is somewhere in its "
                                                  f"bytes {job.offset}..{job.offset + job.stored}")
        if body is not dest:
            try:
                self.codec.decode_into(body, dest, self.wsize)
            except FormatError as exc:
                raise _corrupt(self.name, job.offset, f"chunk {job.index}: {exc}") from None

    def leaves(self, pool: Optional[Executor], into: Callable[[_Job], memoryview]) -> List[bytes]:
        """Each chunk decoded into ``into(job)`` and hashed there: the digest leaves of a segment
        without a filter (its chunks are the raw bytes' leaves)."""
        def decode_and_leaf(job: _Job) -> bytes:
            dest = into(job)
            self.decode(job, dest)
            return _leaf(dest)
        return _map(pool, decode_and_leaf, self.jobs)

    def payload(self, pool: Optional[Executor]) -> memoryview:
        """Every chunk decoded into a new buffer of the payload (the filter's output) size."""
        import numpy as np

        if not self.header.payload_size:
            return memoryview(bytearray())
        target = memoryview(np.empty(self.header.payload_size, np.uint8)).cast("B")
        _map(pool, lambda job: self.decode(job, target[job.raw_offset:job.raw_offset + job.raw_len]), self.jobs)
        return target

    def check_digest(self, leaves: Iterable[bytes]) -> None:
        """Refuse the segment unless ``leaves`` (the raw bytes' digest leaves) make its digest."""
        header = self.header
        if _digest(header.descriptor(), header.chunk_size, header.raw_size, leaves) != header.digest:
            raise _corrupt(self.name, None, "digest mismatch: decoded bytes are not what was stored")


def decode_into(data: Union[Buffer, Source], out: memoryview, *, name: str = "<segment>",
                pool: Optional[Executor] = None, header: Optional[Header] = None) -> Header:
    """Check and decode a whole segment file into ``out`` (exactly ``raw_size`` bytes); its header.

    ``data`` is the file in memory or a :class:`Source` (each chunk is then read by the task
    that decodes it; a raw chunk straight into ``out``). Every chunk CRC and the digest are
    checked; any failure raises :class:`SegmentCorrupt` naming the segment. ``header`` is
    :func:`read_header` of the same segment when the caller has parsed it already.
    """
    source = as_source(data, name)
    if header is None:
        header = read_header(source)
    if len(out) != header.raw_size:
        raise InvalidArgument(f"{source.name}: decoding {header.raw_size} bytes into a buffer of {len(out)}")
    chunks = _Chunks(source, header)
    unfilter = chunks.unfilter
    if unfilter is None:
        leaves = chunks.leaves(pool, lambda job: out[job.raw_offset:job.raw_offset + job.raw_len])
    else:
        # Undo the filter in parallel, each digest leaf's range hashed as soon as it is filled.
        unfilter.prepare(chunks.payload(pool), out, pool)

        def fill_and_leaf(c: Tuple[int, int]) -> bytes:
            unfilter.fill(c[0], c[1])
            return _leaf(out[c[0]:c[0] + c[1]])
        leaves = _map(pool, fill_and_leaf, _chunks(header.raw_size, header.chunk_size))
    chunks.check_digest(leaves)
    return header


def verify(data: Union[Buffer, Source], *, name: str = "<segment>", pool: Optional[Executor] = None,
           header: Optional[Header] = None) -> Header:
    """Check a whole segment file as :func:`decode_into` does (every chunk CRC, then the digest),
    without holding its raw bytes; its header.

    Each chunk is decoded into a buffer of its own raw length (at most ``chunk_size``: a chunk
    that would decode to more is corrupt, refused at once), hashed into its digest leaf and
    dropped, so checking a segment takes a chunk's memory per thread whatever its header
    declares: a small file declaring gigabytes of zeros is refused when its digest fails, not
    after that much memory was filled. A filtered segment holds its payload (the filter's
    output) and rebuilds the raw bytes a digest leaf at a time.
    """
    import numpy as np

    source = as_source(data, name)
    if header is None:
        header = read_header(source)
    chunks = _Chunks(source, header)
    if chunks.unfilter is None:
        leaves = chunks.leaves(pool, lambda job: memoryview(np.empty(job.raw_len, np.uint8)).cast("B"))
    else:
        read = chunks.unfilter.reader(chunks.payload(pool), header.raw_size, pool)
        leaves = _map(pool, lambda c: _leaf(read(c[0], c[1])), _chunks(header.raw_size, header.chunk_size))
    chunks.check_digest(leaves)
    return header


def check_raw_limit(header: Header, name: str, max_raw: int) -> None:
    """Refuse a segment declaring more than ``max_raw`` raw bytes (before anything is allocated)."""
    if header.raw_size > max_raw:
        raise FormatError(f"{name} declares {header.raw_size} raw bytes, more than the limit of {max_raw} "
                          "(max_segment_bytes)")


def allocate(header: Header, name: str, max_raw: int = MAX_RAW_SIZE) -> "np.ndarray":
    """A new uint8 buffer for the raw bytes ``header`` declares, at most ``max_raw``."""
    import numpy as np

    check_raw_limit(header, name, max_raw)
    try:
        return np.empty(header.raw_size, np.uint8)  # numpy asks for huge pages
    except MemoryError:
        raise FormatError(f"{name} declares {header.raw_size} raw bytes: cannot allocate them") from None


def decode(data: Union[Buffer, Source], *, name: str = "<segment>", pool: Optional[Executor] = None,
           max_raw: int = MAX_RAW_SIZE) -> Tuple[Header, memoryview]:
    """Check and decode a whole segment file into a new buffer (see :func:`decode_into`); its
    header and raw bytes. No more than ``max_raw`` bytes are allocated."""
    source = as_source(data, name)
    header = read_header(source)
    raw = memoryview(allocate(header, source.name, max_raw)).cast("B")
    decode_into(source, raw, pool=pool, header=header)
    return header, raw
