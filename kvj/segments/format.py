"""The segment file format: one tensor, checksummed chunks, a verifiable digest.

Pure bytes <-> (header, tensor); no I/O policy lives here (see ``store.py``). The format is
specified in ``man/kvj-segment.5``; the constants below are the ones named there.

File layout (integers little-endian)::

    preamble  16 B   magic "\\x89KVJSEG\\n", u16 version, u16 flags (0), u32 reserved (0)
    body      ...    [dedup map frame] chunk 0 .. chunk n-1 (stored bytes, back to back)
    header    H B    msgpack map (dtype, shape, codec, sizes, chunk table, digest, layout)
    trailer   16 B   u32 H, u32 CRC32C(preamble || header), end magic "KVJSEGOK"

The header sits at the end so chunks can be written as they are compressed. Every chunk has
its own CRC32C; the digest (BLAKE3 tree over the raw bytes and a canonical descriptor) is the
segment's content address and is verified on every decode.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import blake3
import crc32c
import msgpack
import numpy as np
import torch

from kvj.errors import FormatError, InvalidArgument, SegmentCorrupt
from kvj.fileio import Buffer
from kvj.segments.codecs import Codec, get_codec
from kvj.segments.codecs.auto import Backpressure, auto_codec
from kvj.segments.codecs.raw import RawCodec
from kvj.segments.codecs.rowdedup import RowDedup, ScatterPlan
from kvj.segments.codecs.zstd import ZstdCodec, zstd_decompress

MAGIC = b"\x89KVJSEG\n"
END_MAGIC = b"KVJSEGOK"
VERSION = 1
PREAMBLE = struct.Struct("<8sHHI")
TRAILER = struct.Struct("<II8s")
#: Raw bytes per chunk the writer uses; also the digest's leaf size.
CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 1 << 12
MAX_CHUNK_SIZE = 1 << 26
MAX_HEADER = 16 << 20
MAX_RAW_SIZE = 1 << 36
MAX_NDIM = 64
#: No valid chunk expands more than this (a zstd RLE block is 4 bytes for 128 KiB).
MAX_EXPANSION = 1 << 15
DIGEST_ALG = "blake3-tree-v1"
_DIGEST_DOMAIN = b"kvj-segment-digest-v1\n"
_MAP_LEVEL = 3

#: Every dtype with a fixed byte layout, by the name the header stores.
DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    ) if hasattr(torch, name)
}
DTYPE_NAMES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

Layout = Optional[Dict[str, Any]]


def dtype_name(dtype: torch.dtype) -> str:
    """The header name of ``dtype``; FormatError for dtypes without a fixed byte layout."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} has no fixed byte layout kvj can store") from None


def word_size(dtype: torch.dtype) -> int:
    """Bytes per scalar word the codecs see (a complex number is two floats)."""
    return dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(tensor: torch.Tensor) -> Optional[np.ndarray]:
    """A CPU tensor as a numpy array of integers of its element size (same strides, no copy);
    None for 16-byte elements, which have no such integer."""
    words = _WORDS.get(tensor.element_size())
    return None if words is None else tensor.detach().view(words).numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for CPU tensors of one shape and dtype: a plain strided byte copy.

    Done by numpy as integers of the element size, in the calling thread: torch copies a
    strided bfloat16 block element by element (~0.4 GB/s here), and for small copies its
    intra-op threads can cost more in wake-ups on a busy machine than the copy itself.
    """
    d, s = _words(dst), _words(src)
    if d is None or s is None:
        dst.copy_(src.detach())
    else:
        np.copyto(d, s)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order (copies only when it is not contiguous)."""
    dtype_name(tensor.dtype)
    if tensor.numel() == 0:
        return memoryview(b"")
    if tensor.is_contiguous():
        flat = tensor.detach().reshape(-1)
    else:
        flat = torch.empty(tensor.shape, dtype=tensor.dtype)
        copy_into(flat, tensor)
    return memoryview(flat.reshape(-1).view(torch.uint8).numpy()).cast("B")


def canonical_layout(layout: Layout) -> Layout:
    """Check that ``layout`` is JSON-shaped (str keys; str/int/float/bool/None/list/map)."""
    if layout is None:
        return None
    if not isinstance(layout, Mapping):
        raise FormatError("layout must be a map")
    try:
        return json.loads(json.dumps(layout, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise FormatError(f"layout is not plain JSON data: {exc}") from None


def descriptor(dtype: str, shape: Sequence[int], layout: Layout) -> bytes:
    """Canonical JSON of what the raw bytes mean; part of the digest."""
    return json.dumps({"dtype": dtype, "shape": list(shape), "layout": layout}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _chunks(n: int, size: int) -> List[Tuple[int, int]]:
    return [(off, min(size, n - off)) for off in range(0, n, size)]


def _map(pool: Optional[Executor], fn: Callable, items: Sequence) -> List:
    if pool is None or len(items) <= 1:
        return [fn(it) for it in items]
    return list(pool.map(fn, items))


def _leaf(view: memoryview) -> bytes:
    # blake3 releases the GIL for inputs this large, so leaves hash in parallel threads; its
    # own max_threads does not help here (the pool already keeps both cores busy).
    return blake3.blake3(view).digest()


def digest_from_leaves(dtype: str, shape: Sequence[int], layout: Layout, chunk_size: int,
                       raw_size: int, leaves: Iterable[bytes]) -> bytes:
    h = blake3.blake3(_DIGEST_DOMAIN)
    h.update(descriptor(dtype, shape, layout))
    h.update(struct.pack("<QQ", chunk_size, raw_size))
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
    dedup: Optional[Dict[str, int]]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_map(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "dtype": self.dtype, "shape": list(self.shape), "layout": self.layout,
            "codec": self.codec, "params": self.params, "raw_size": self.raw_size,
            "chunk_size": self.chunk_size, "payload_size": self.payload_size,
            "chunks": [list(c) for c in self.chunks], "stored_size": self.stored_size,
            "digest_alg": DIGEST_ALG, "digest": self.digest, "dedup": self.dedup,
        }
        return out


class EncodedSegment:
    """A segment being encoded: iterate ``parts()`` to get the file's bytes in order.

    Chunks are compressed in parallel; ``parts()`` yields each as soon as it and those before
    it are done, so the writer overlaps disk writes with compression. ``header`` and
    ``file_size`` are set once ``parts()`` is exhausted.
    """

    def __init__(self, make_header: Callable[[List[Tuple[int, int]]], Header],
                 pieces: Iterator[Tuple[bytes, ...]]):
        self._make_header = make_header
        self._pieces = pieces
        self.header: Optional[Header] = None
        self.file_size = 0

    def parts(self) -> Iterator[Union[bytes, memoryview]]:
        preamble = PREAMBLE.pack(MAGIC, VERSION, 0, 0)
        yield preamble
        size = len(preamble)
        table: List[Tuple[int, int]] = []
        for body, crc in self._pieces:
            table.append((len(body), crc))
            size += len(body)
            yield body
        self.header = self._make_header(table)
        head = msgpack.packb(self.header.to_map(), use_bin_type=True)
        if len(head) > MAX_HEADER:
            raise FormatError("segment header too large")
        yield head
        trailer = TRAILER.pack(len(head), crc32c.crc32c(head, crc32c.crc32c(preamble)), END_MAGIC)
        yield trailer
        self.file_size = size + len(head) + len(trailer)


def _resolve_codec(codec: Union[str, Codec], raw: memoryview, dtype: torch.dtype, pressure: int) -> Codec:
    if isinstance(codec, Codec):
        return codec
    if codec == "auto":
        return auto_codec(raw, word_size(dtype), is_float(dtype), pressure)
    return get_codec(codec, _default_params(codec, dtype))


def _default_params(name: str, dtype: torch.dtype) -> Dict[str, Any]:
    if name == "byteplane":
        n = word_size(dtype)
        top = "e" if is_float(dtype) else "z"
        return {"planes": "r" * (n - 1) + top, "fp": is_float(dtype)}
    return {}


class _RowPlan:
    """Row dedup for one tensor: which rows are stored, and the map that rebuilds the rest."""

    def __init__(self, raw: memoryview, row_bytes: int, src: np.ndarray):
        self.row_bytes = row_bytes
        self.rows = np.frombuffer(raw, np.uint8).reshape(-1, row_bytes)
        self.firsts = np.flatnonzero(src == np.arange(len(src)))
        self.payload_size = len(self.firsts) * row_bytes
        map_raw = RowDedup.encode_map(src)
        self.map_frame = ZstdCodec(level=_MAP_LEVEL).encode(memoryview(map_raw), 4)
        self.info = {"row_bytes": row_bytes, "rows": len(src), "map_raw": len(map_raw)}

    def chunk(self, off: int, n: int) -> memoryview:
        """Payload bytes ``off..off+n`` (first-of-kind rows), gathered by the task that needs
        them, so the payload is never built whole."""
        r0, r1 = off // self.row_bytes, -(-(off + n) // self.row_bytes)
        block = self.rows[self.firsts[r0:r1]].reshape(-1)
        skip = off - r0 * self.row_bytes
        return memoryview(block[skip:skip + n])


class SegmentEncoder:
    """Encodes the C-order bytes of one tensor into a segment, chunk by chunk.

    The digest's leaves (BLAKE3 of each raw chunk) come one of three ways:

    - *given*: the caller passed the digest (the store hashes small segments first);
    - *fused*: without a filter the payload chunks are the raw chunks, so each chunk task
      hashes what it encodes while it is in cache;
    - *separate*: with row dedup the payload is not the raw bytes, so the leaves are pool
      tasks of their own, started while the rows are searched when a pool is there.
    """

    def __init__(self, raw: memoryview, *, dtype: torch.dtype, shape: Sequence[int], layout: Layout,
                 digest: Optional[bytes], codec: Union[str, Codec], pool: Optional[Executor],
                 pressure: int, dedup: Optional[bool]):
        self.name = dtype_name(dtype)
        self.shape = tuple(int(d) for d in shape)
        if len(raw) != math.prod(self.shape) * dtype.itemsize:
            raise FormatError("raw size does not match dtype and shape")
        self.raw, self.layout, self.digest, self.pool = raw, canonical_layout(layout), digest, pool
        self.wsize = word_size(dtype)
        self.codec = _resolve_codec(codec, raw, dtype, pressure)
        self.leaf_futures: List[Future] = []
        self.rows = self._plan_rows(dtype, pressure, dedup)
        self.payload_size = self.rows.payload_size if self.rows else len(raw)
        self.spans = _chunks(self.payload_size, CHUNK_SIZE)
        self.fused = digest is None and self.rows is None and not self.leaf_futures
        self.fused_leaves: List[bytes] = []

    def _plan_rows(self, dtype: torch.dtype, pressure: int, dedup: Optional[bool]) -> Optional[_RowPlan]:
        """The row-dedup plan when it applies (``dedup`` forces it on or off; by default it
        runs when a sample shows repeated rows), else None."""
        raw = self.raw
        row_bytes = RowDedup.row_bytes_for(self.shape, dtype.itemsize) if len(raw) >= 2 * CHUNK_SIZE else 0
        if dedup is None:
            dedup = bool(row_bytes) and pressure == Backpressure.NORMAL \
                and RowDedup.sample_dup_fraction(raw, row_bytes) >= 0.004
        if not (dedup and row_bytes):
            return None
        keys = RowDedup.row_keys(raw, row_bytes, self.pool)
        if self.digest is None and self.pool is not None:  # the pool hashes while this thread searches
            self.leaf_futures = [self.pool.submit(_leaf, raw[o:o + n]) for o, n in _chunks(len(raw), CHUNK_SIZE)]
        src = RowDedup.find(raw, row_bytes, keys)
        if np.count_nonzero(src == np.arange(len(src))) == len(src):
            return None  # no repeated rows after all
        return _RowPlan(raw, row_bytes, src)

    def _chunk(self, span: Tuple[int, int]) -> memoryview:
        off, n = span
        return self.rows.chunk(off, n) if self.rows else self.raw[off:off + n]

    def _encode(self, span: Tuple[int, int]) -> Tuple[Buffer, int, Optional[bytes]]:
        """One chunk's stored bytes, their CRC, and (fused) its digest leaf."""
        chunk = self._chunk(span)
        body = self.codec.encode(chunk, self.wsize)
        return body, crc32c.crc32c(body), _leaf(chunk) if self.fused else None

    def pieces(self) -> Iterator[Tuple[Buffer, int]]:
        """(stored bytes, CRC) of the dedup map, if any, then of every chunk, in file order."""
        if self.rows:
            yield self.rows.map_frame, crc32c.crc32c(self.rows.map_frame)
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
        return digest_from_leaves(self.name, self.shape, self.layout, CHUNK_SIZE, len(self.raw), leaves)

    def header(self, table: List[Tuple[int, int]]) -> Header:
        """The header, once every piece's (stored length, CRC) is in ``table``."""
        dd = None
        if self.rows:
            dd = dict(self.rows.info, map_stored=table[0][0], map_crc=table[0][1])
            table = table[1:]
        return Header(dtype=self.name, shape=self.shape, layout=self.layout, codec=self.codec.name,
                      params=dict(self.codec.params), raw_size=len(self.raw), chunk_size=CHUNK_SIZE,
                      payload_size=self.payload_size, chunks=tuple(table),
                      stored_size=sum(t[0] for t in table) + (dd["map_stored"] if dd else 0),
                      digest=self._final_digest(), dedup=dd)


def encode(raw: memoryview, *, dtype: torch.dtype, shape: Sequence[int], layout: Layout,
           digest: Optional[bytes], codec: Union[str, Codec] = "auto", pool: Optional[Executor] = None,
           pressure: int = Backpressure.NORMAL, dedup: Optional[bool] = None) -> EncodedSegment:
    """Encode the C-order bytes ``raw`` of a tensor (see :class:`SegmentEncoder`).

    ``digest`` is :func:`compute_digest` of the same data, or None to compute it alongside
    compression (in the pool, as the chunks go by); either way ``header.digest`` holds it.
    ``codec`` is a registered name, ``"auto"`` or a :class:`Codec`. ``dedup`` forces the row
    dedup filter on or off; by default it runs when a sample shows repeated rows.
    """
    encoder = SegmentEncoder(raw, dtype=dtype, shape=shape, layout=layout, digest=digest, codec=codec,
                             pool=pool, pressure=pressure, dedup=dedup)
    return EncodedSegment(encoder.header, encoder.pieces())


# --------------------------------------------------------------------------- parsing


def _corrupt(name: str, offset: Optional[int], reason: str) -> SegmentCorrupt:
    return SegmentCorrupt(name, offset, reason)


def _int(m: Mapping, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = m.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FormatError(f"header field {key!r} missing or out of range")
    return v


def _validate(m: Any, file_size: int, header_len: int) -> Header:
    if not isinstance(m, dict):
        raise FormatError("header is not a map")
    dtype = m.get("dtype")
    if dtype not in DTYPES:
        raise FormatError(f"unknown dtype {dtype!r}")
    itemsize = DTYPES[dtype].itemsize
    shape = m.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_RAW_SIZE for d in shape):
        raise FormatError("bad shape")
    raw_size = _int(m, "raw_size", 0, MAX_RAW_SIZE)
    if math.prod(shape) * itemsize != raw_size:
        raise FormatError("raw_size does not match dtype and shape")
    chunk_size = _int(m, "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
    if chunk_size & (chunk_size - 1):
        raise FormatError("chunk_size is not a power of two")
    layout = canonical_layout(m.get("layout"))  # FormatError unless plain JSON data
    if m.get("digest_alg") != DIGEST_ALG:
        raise FormatError(f"unknown digest algorithm {m.get('digest_alg')!r}")
    digest = m.get("digest")
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise FormatError("bad digest field")
    codec = get_codec(m.get("codec"), m.get("params"))
    stored_size = _int(m, "stored_size")
    if PREAMBLE.size + stored_size + header_len + TRAILER.size != file_size:
        raise FormatError("sizes in header do not add up to the file size")
    payload_size = _int(m, "payload_size", 0, raw_size)
    dedup = m.get("dedup")
    map_stored = 0
    if dedup is not None:
        if not isinstance(dedup, dict):
            raise FormatError("bad dedup field")
        row_bytes = _int(dedup, "row_bytes", 8, raw_size or 8)
        rows = _int(dedup, "rows", 1, raw_size)
        map_stored = _int(dedup, "map_stored", 1, stored_size)
        _int(dedup, "map_crc", 0, 0xFFFFFFFF)
        if row_bytes % 8 or rows * row_bytes != raw_size or _int(dedup, "map_raw") != 4 * rows \
                or payload_size % row_bytes or 4 * rows > map_stored * MAX_EXPANSION:
            raise FormatError("dedup fields are inconsistent")
        dedup = {k: dedup[k] for k in ("row_bytes", "rows", "map_raw", "map_stored", "map_crc")}
    elif payload_size != raw_size:
        raise FormatError("payload_size differs from raw_size without a filter")
    if payload_size % word_size(DTYPES[dtype]):
        raise FormatError("payload is not whole elements")
    table = m.get("chunks")
    n_chunks = -(-payload_size // chunk_size)
    if not isinstance(table, list) or len(table) != n_chunks:
        raise FormatError("chunk table length does not match the payload size")
    chunks = []
    total = map_stored
    for i, entry in enumerate(table):
        if not (isinstance(entry, list) and len(entry) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in entry)):
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
                  digest=digest, dedup=dedup)


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
        m = msgpack.unpackb(head, raw=False, strict_map_key=True, use_list=True)
        return _validate(m, file_size, len(head))
    except FormatError as exc:
        raise _corrupt(name, file_size - TRAILER.size - len(head), str(exc)) from None
    except Exception as exc:  # msgpack raises several types on malformed input
        raise _corrupt(name, file_size - TRAILER.size - len(head), f"header does not parse: {exc}") from None


class Source(ABC):
    """A segment's stored bytes, read by offset: held in memory (:class:`BytesSource`) or read
    from a file chunk by chunk as the decoder needs them (``StorageBackend.open``), so a load
    neither copies the whole file into a buffer first nor waits for it before decoding."""

    name: str
    size: int

    @abstractmethod
    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; ``SegmentCorrupt`` if the file ends first."""

    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset``, in this thread's scratch buffer: valid until the thread's
        next read."""
        buf = _thread_buffer(n)
        self.read_into(offset, buf)
        return buf


class BytesSource(Source):
    """A whole segment file held in memory (reads are zero-copy slices)."""

    def __init__(self, data: Buffer, name: str = "<segment>"):
        self.view = memoryview(data).cast("B")
        self.name, self.size = name, len(self.view)

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > self.size:
            raise _corrupt(self.name, offset, "segment ends inside a chunk")
        out[:] = self.view[offset:offset + len(out)]

    def read(self, offset: int, n: int) -> memoryview:
        if offset + n > self.size:
            raise _corrupt(self.name, offset, "segment ends inside a chunk")
        return self.view[offset:offset + n]


_local = threading.local()


def _thread_buffer(n: int) -> memoryview:
    """This thread's reusable read buffer, at least ``n`` bytes (reused, so no page faults)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = np.empty(max(n, 1 << 20), np.uint8)
    return memoryview(buf)[:n]


def _source(data: Union[Buffer, Source], name: str) -> Source:
    return data if isinstance(data, Source) else BytesSource(data, name)


def read_header(data: Union[Buffer, Source], name: str = "<segment>") -> Header:
    """Parse and validate the header of a segment file (in memory or a :class:`Source`)."""
    src = _source(data, name)
    size = src.size
    if size < PREAMBLE.size + TRAILER.size:
        raise _corrupt(src.name, None, f"file too short for a segment ({size} bytes)")
    off, hlen, crc = header_location(bytes(src.read(size - TRAILER.size, TRAILER.size)), size, src.name)
    head = bytes(src.read(off, hlen))
    return parse_header(bytes(src.read(0, PREAMBLE.size)), head, crc, size, src.name)


def check_stored(data: Union[bytes, memoryview], name: str = "<segment>") -> Header:
    """Check the header and every stored CRC without decoding (cheap: no decompression)."""
    view = memoryview(data).cast("B")
    header = read_header(view, name)
    pos = PREAMBLE.size
    if header.dedup is not None:
        if crc32c.crc32c(view[pos:pos + header.dedup["map_stored"]]) != header.dedup["map_crc"]:
            raise _corrupt(name, pos, f"dedup map CRC mismatch: the damage is somewhere in its bytes "
                                      f"{pos}..{pos + header.dedup['map_stored']}")
        pos += header.dedup["map_stored"]
    for i, (stored, crc) in enumerate(header.chunks):
        if crc32c.crc32c(view[pos:pos + stored]) != crc:
            raise _corrupt(name, pos, f"chunk {i} CRC mismatch: the damage is somewhere in its bytes "
                                      f"{pos}..{pos + stored}")
        pos += stored
    return header


def decode_into(data: Union[Buffer, Source], out: Optional[torch.Tensor] = None, *,
                name: str = "<segment>", pool: Optional[Executor] = None,
                max_raw: int = MAX_RAW_SIZE, header: Optional[Header] = None) -> Tuple[Header, torch.Tensor]:
    """Check and decode a whole segment file; return its header and tensor (on CPU).

    ``data`` is the file in memory or a :class:`Source` (each chunk is then read by the task
    that decodes it; a raw chunk straight into ``out``). ``out``, when given, is a contiguous
    uint8 CPU tensor (e.g. pinned staging) of at least ``raw_size`` bytes that receives the
    data; the returned tensor is a view of it. Every chunk CRC and the digest are checked; any
    failure raises :class:`SegmentCorrupt` naming the segment. A segment declaring more than
    ``max_raw`` bytes is refused before anything is allocated. ``header`` is
    :func:`read_header` of the same segment when the caller has parsed it already.
    """
    source = _source(data, name)
    name = source.name
    if header is None:
        header = read_header(source)
    dtype = header.torch_dtype
    if header.raw_size > max_raw:
        raise FormatError(f"{name} declares {header.raw_size} raw bytes, more than the limit of {max_raw} "
                          "(max_segment_bytes)")
    if out is None:
        try:
            out = torch.from_numpy(np.empty(header.raw_size, np.uint8))  # numpy asks for huge pages
        except MemoryError:
            raise FormatError(f"{name} declares {header.raw_size} raw bytes: cannot allocate them") from None
    elif out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() \
            or out.numel() < header.raw_size:
        raise InvalidArgument("out must be a contiguous CPU uint8 tensor of at least raw_size bytes")
    out = out[:header.raw_size]
    raw = memoryview(out.numpy()).cast("B") if header.raw_size else memoryview(bytearray())
    codec = get_codec(header.codec, header.params)
    wsize = word_size(dtype)
    pos = PREAMBLE.size
    src = firsts = None
    if header.dedup is not None:
        dd = header.dedup
        frame = bytes(source.read(pos, dd["map_stored"]))
        if crc32c.crc32c(frame) != dd["map_crc"]:
            raise _corrupt(name, pos, f"dedup map CRC mismatch: the damage is somewhere in its bytes "
                                      f"{pos}..{pos + header.dedup['map_stored']}")
        try:
            map_raw = zstd_decompress(frame, dd["map_raw"])
            src, firsts = RowDedup.decode_map(map_raw, dd["rows"])
        except FormatError as exc:
            raise _corrupt(name, pos, str(exc)) from None
        if len(firsts) * dd["row_bytes"] != header.payload_size:
            raise _corrupt(name, pos, "dedup map disagrees with the payload size")
        pos += dd["map_stored"]
        payload = np.empty(header.payload_size, np.uint8)
        target = memoryview(payload).cast("B") if header.payload_size else memoryview(bytearray())
    else:
        target = raw
    jobs = []
    for i, (stored, crc) in enumerate(header.chunks):
        raw_off = i * header.chunk_size
        jobs.append((i, pos, stored, crc, raw_off, min(header.chunk_size, header.payload_size - raw_off)))
        pos += stored
    hash_inline = header.dedup is None
    in_place = isinstance(codec, RawCodec)  # stored bytes are the raw bytes: read them into place

    def work(job: Tuple[int, int, int, int, int, int]) -> bytes:
        i, off, stored, crc, raw_off, raw_len = job
        dest = target[raw_off:raw_off + raw_len]
        if in_place and stored == raw_len:
            source.read_into(off, dest)
            body: memoryview = dest
        else:
            body = source.read(off, stored)
        if crc32c.crc32c(body) != crc:
            raise _corrupt(name, off, f"chunk {i} CRC mismatch: the damage is somewhere in its bytes "
                                      f"{off}..{off + stored}")
        if body is not dest:
            try:
                codec.decode_into(body, dest, wsize)
            except FormatError as exc:
                raise _corrupt(name, off, f"chunk {i}: {exc}") from None
        return _leaf(dest) if hash_inline else b""

    leaves = _map(pool, work, jobs)
    if header.dedup is not None:
        # Rebuild the rows in parallel: first-of-kind rows in two halves, then per digest leaf
        # the repeated rows it covers, hashed while they are in cache.
        row_bytes, n_rows = header.dedup["row_bytes"], header.dedup["rows"]
        rows = np.frombuffer(raw, np.uint8).reshape(-1, row_bytes)
        unique = payload.reshape(-1, row_bytes)
        plan = ScatterPlan(src)
        half = n_rows // 2
        _map(pool, lambda r: plan.firsts(rows, unique, r[0], r[1]), [(0, half), (half, n_rows)])

        def repeats_and_leaf(c: Tuple[int, int]) -> bytes:
            # A row straddling two leaves is written by both tasks, with the same bytes.
            plan.repeats(rows, c[0] // row_bytes, min(n_rows, -(-(c[0] + c[1]) // row_bytes)))
            return _leaf(raw[c[0]:c[0] + c[1]])
        leaves = _map(pool, repeats_and_leaf, _chunks(header.raw_size, header.chunk_size))
    actual = digest_from_leaves(header.dtype, header.shape, header.layout, header.chunk_size,
                                header.raw_size, leaves)
    if actual != header.digest:
        raise _corrupt(name, None, "digest mismatch: decoded bytes are not what was stored")
    if header.raw_size == 0:
        return header, torch.empty(header.shape, dtype=dtype)
    return header, out.view(dtype).reshape(header.shape)
