"""Chunk codecs for segment payloads, looked up by name (zarr-v3 style).

A codec turns one chunk of raw tensor bytes into stored bytes and back. Every codec has a
``name`` and a ``params`` dict that the segment header records, so a reader rebuilds the exact
codec with :func:`get_codec`. Codecs are stateless and thread-safe: chunks of one segment are
encoded and decoded in parallel threads (zstandard and numpy release the GIL).

* ``raw``       - the bytes as they are.
* ``zstd``      - zstandard at ``level``; ``long`` turns on long-distance matching.
* ``byteplane`` - for floating point: the sign bit of each element moves down beside the
  mantissa (so the top byte holds the exponent, or its high bits for fp16/fp64), the elements
  are split into byte planes, and each plane is stored raw (``r``), entropy-coded (``e``: zstd
  tuned so that it is close to Huffman-only on literals) or zstd-compressed (``z``). A plane
  that does not shrink in a chunk is stored raw there.

:class:`RowDedup` is a segment-level filter (not a chunk codec): it finds rows repeated anywhere
in a tensor, as prompts sharing a prefix produce in a KV cache, and stores each once.

:func:`auto_codec` picks a codec per segment from a cheap sample test, and steps down to faster
choices when the caller reports backpressure (see :class:`Backpressure`).
"""

from __future__ import annotations

import struct
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import numpy as np
import zstandard

from kvj.errors import FormatError

Buffer = Union[bytes, bytearray, memoryview]

#: Largest zstd window a reader accepts (bounds decoder memory on hostile input).
MAX_WINDOW_LOG = 27

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()


def _compressor(key: Tuple[Any, ...]) -> zstandard.ZstdCompressor:
    """A per-thread compressor for ``key`` (zstd contexts must not be shared across threads)."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(key)
    if comp is None:
        kind = key[0]
        if kind == "entropy":
            # Fast strategy, minimum-size hash table and 7-byte matches: almost no matches are
            # found, so the block is Huffman-coded literals, close to the order-0 entropy.
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=6, chain_log=6,
                search_log=1, window_log=17, target_length=0, write_content_size=True)
        else:
            _, level, long = key
            params = zstandard.ZstdCompressionParameters.from_level(
                level, enable_ldm=bool(long), window_log=MAX_WINDOW_LOG if long else 0,
                write_content_size=True)
        comp = cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor(max_window_size=1 << MAX_WINDOW_LOG)
    return dec


def _check_declared(data: Buffer, raw_len: int) -> None:
    """Refuse a frame whose header does not declare exactly ``raw_len`` bytes (before decoding)."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise FormatError(f"bad zstd frame: {exc}") from None
    if declared != raw_len:
        raise FormatError(f"zstd frame declares {declared} bytes, expected {raw_len}")


def zstd_decompress(data: Buffer, raw_len: int) -> bytes:
    """Decompress one zstd frame that must hold exactly ``raw_len`` bytes.

    The declared size is checked before any allocation, so a hostile frame cannot make the
    reader allocate more than ``raw_len``.
    """
    _check_declared(data, raw_len)
    try:
        out = _decompressor().decompress(data, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd frame does not decode: {exc}") from None
    if len(out) != raw_len:
        raise FormatError(f"zstd frame decoded to {len(out)} bytes, expected {raw_len}")
    return out


def zstd_decompress_into(data: Buffer, out: memoryview) -> None:
    """Decompress one zstd frame into ``out``, which it must fill exactly.

    Like :func:`zstd_decompress` (the declared size is checked first), but the frame decodes
    straight into the caller's buffer: no allocation, no extra copy.
    """
    raw_len = len(out)
    _check_declared(data, raw_len)
    got = 0
    try:
        reader = _decompressor().stream_reader(data, read_size=max(1, len(data)))
        while got < raw_len:
            n = reader.readinto(out[got:])
            if not n:
                break
            got += n
        extra = reader.read(1) if got == raw_len else b""
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd frame does not decode: {exc}") from None
    if got != raw_len or extra:
        raise FormatError(f"zstd frame decoded to {got + len(extra)}{'+' if extra else ''} bytes, "
                          f"expected {raw_len}")


class Codec(ABC):
    """One chunk codec. ``encode`` output must decode bit-exactly with the same params."""

    name: ClassVar[str]

    def __init__(self, **params: Any) -> None:
        self.params: Dict[str, Any] = params

    @abstractmethod
    def encode(self, buf: memoryview, itemsize: int) -> Buffer:
        """Encode one chunk (``len(buf)`` is a multiple of ``itemsize``)."""

    @abstractmethod
    def decode_into(self, data: memoryview, out: memoryview, itemsize: int) -> None:
        """Decode ``data`` into ``out``, which it must fill exactly; FormatError otherwise."""

    def decode(self, data: Buffer, raw_len: int, itemsize: int) -> bytearray:
        """Decode into a new buffer of ``raw_len`` bytes."""
        out = bytearray(raw_len)
        self.decode_into(memoryview(data).cast("B"), memoryview(out), itemsize)
        return out

    def __repr__(self) -> str:
        return f"{self.name}{self.params}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and (self.name, self.params) == (other.name, other.params)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.params.items()))))


class RawCodec(Codec):
    """Stores the bytes unchanged."""

    name = "raw"

    def __init__(self) -> None:
        super().__init__()

    def encode(self, buf: memoryview, itemsize: int) -> Buffer:
        return buf

    def decode_into(self, data: memoryview, out: memoryview, itemsize: int) -> None:
        if len(data) != len(out):
            raise FormatError(f"raw chunk holds {len(data)} bytes, expected {len(out)}")
        out[:] = data


class ZstdCodec(Codec):
    """zstandard on the plain bytes; ``long`` enables long-distance matching (large window)."""

    name = "zstd"

    def __init__(self, level: int = 3, long: bool = False) -> None:
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise FormatError(f"zstd level {level!r} out of range")
        super().__init__(level=level, long=bool(long))

    def encode(self, buf: memoryview, itemsize: int) -> Buffer:
        return _compressor(("zstd", self.params["level"], self.params["long"])).compress(buf)

    def decode_into(self, data: memoryview, out: memoryview, itemsize: int) -> None:
        zstd_decompress_into(data, out)


_PLANE_MODES = "rez"
_PLANE_HEADER = struct.Struct("<BI")  # mode, stored length
_BLOCK = 1 << 17  # elements per numpy pass: keeps temporaries in cache


def _scratch(name: str, size: int, dtype: Any = np.uint8) -> np.ndarray:
    """A per-thread reusable array of at least ``size`` elements (first ``size`` returned).

    The plane and word temporaries are reused across chunks, so the split and merge passes
    run in cache-warm memory with no allocation and no page faults.
    """
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    key = (name, np.dtype(dtype).str)
    arr = cache.get(key)
    if arr is None or len(arr) < size:
        arr = cache[key] = np.empty(max(size, 1), dtype)
    return arr[:size]


def split_planes(buf: memoryview, itemsize: int, fp: bool,
                 out: Optional[Sequence[np.ndarray]] = None) -> List[np.ndarray]:
    """Byte planes of the elements in ``buf``, least significant first.

    With ``fp`` the sign bit moves to bit 7 of plane 0 (beside the low mantissa bits) and the
    bits below it move up by one, so plane ``k-1`` holds the exponent's top 8 bits (all of it
    for bf16 and fp32) with no sign mixed in. ``out``, when given, holds one uint8 array of
    ``len(buf) // itemsize`` bytes per plane to write into (and is returned).
    """
    if itemsize == 1:
        src = np.frombuffer(buf, np.uint8)
        if out is None:
            return [src]
        np.copyto(out[0], src)
        return list(out)
    utype = _UINT[itemsize]
    bits = 8 * itemsize
    words = np.frombuffer(buf, utype)
    n = len(words)
    planes = list(out) if out is not None else [np.empty(n, np.uint8) for _ in range(itemsize)]
    block = min(n, _BLOCK)
    t1, t2 = _scratch("w1", block, utype), _scratch("w2", block, utype)
    keep = utype(0x7F | (1 << (bits - 1)))
    for lo in range(0, n, _BLOCK):
        w = words[lo:lo + _BLOCK]
        hi = lo + len(w)
        t, u = t1[:len(w)], t2[:len(w)]
        for p in range(1, itemsize):  # each plane is one shift and one narrowing copy
            np.right_shift(w, 8 * p - 1 if fp else 8 * p, out=t)
            np.copyto(planes[p][lo:hi], t, casting="unsafe")
        if fp:  # low 7 bits, and the sign at bit 7
            np.bitwise_and(w, keep, out=t)
            np.right_shift(t, bits - 8, out=u)
            t |= u
            np.copyto(planes[0][lo:hi], t, casting="unsafe")
        else:
            np.copyto(planes[0][lo:hi], w, casting="unsafe")
    return planes


def merge_planes(planes: Sequence[np.ndarray], out: memoryview, itemsize: int, fp: bool) -> None:
    """Inverse of :func:`split_planes`, writing the elements into ``out``."""
    if itemsize == 1:
        np.copyto(np.frombuffer(out, np.uint8), planes[0])
        return
    utype = _UINT[itemsize]
    bits = 8 * itemsize
    words = np.frombuffer(out, utype)
    n = len(words)
    block = min(n, _BLOCK)
    t1 = _scratch("w1", block, utype)
    keep = utype(0x7F | (1 << (bits - 1)))
    spread = utype(1 | (1 << (bits - 8)))
    top = itemsize - 1
    for lo in range(0, n, _BLOCK):
        w = words[lo:lo + _BLOCK]
        hi = lo + len(w)
        t = t1[:len(w)]
        np.copyto(w, planes[top][lo:hi], casting="unsafe")
        w <<= (8 * top - 1) if fp else 8 * top
        for p in range(1, top):
            np.copyto(t, planes[p][lo:hi], casting="unsafe")
            t <<= (8 * p - 1) if fp else 8 * p
            w |= t
        if fp:  # plane 0 byte b -> b & 0x7F at bits 0..6, b's bit 7 at the sign bit
            np.copyto(t, planes[0][lo:hi], casting="unsafe")
            t *= spread  # b | b << (bits - 8): no carries, b < 256
            t &= keep
            w |= t
        else:
            np.bitwise_or(w, planes[0][lo:hi], out=w)


class BytePlaneCodec(Codec):
    """Byte planes of the elements, each plane coded on its own.

    ``planes`` has one letter per byte plane, least significant first: ``r`` raw, ``e``
    entropy-coded, ``z`` zstd at ``level``. ``fp`` applies the float bit move of
    :func:`split_planes` first (exponent alone in the top plane).

    Encoded chunk: ``u8 nplanes`` then per plane ``u8 mode, u32le length`` (mode 0 raw, 1 zstd
    frame), then the plane bodies in order.
    """

    name = "byteplane"

    def __init__(self, planes: str, fp: bool = True, level: int = 1) -> None:
        if not isinstance(planes, str) or len(planes) not in _UINT \
                or any(c not in _PLANE_MODES for c in planes):
            raise FormatError(f"byteplane planes {planes!r} invalid")
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise FormatError(f"byteplane level {level!r} out of range")
        super().__init__(planes=planes, fp=bool(fp), level=level)

    def encode(self, buf: memoryview, itemsize: int) -> Buffer:
        modes = self.params["planes"]
        if len(modes) != itemsize:
            raise FormatError(f"byteplane codec has {len(modes)} planes, element has {itemsize} bytes")
        n = len(buf) // itemsize
        head = 1 + itemsize * _PLANE_HEADER.size
        # One output buffer: the leading raw planes are split straight into their final place;
        # the others go to per-thread scratch, are compressed, and land after them.
        out = np.empty(head + len(buf), np.uint8)
        direct = 0
        while direct < itemsize and modes[direct] == "r":
            direct += 1
        scratch = _scratch("planes", n * (itemsize - direct))
        targets = [out[head + p * n:head + (p + 1) * n] if p < direct
                   else scratch[(p - direct) * n:(p - direct + 1) * n] for p in range(itemsize)]
        split_planes(buf, itemsize, self.params["fp"], targets)
        out[0] = itemsize
        pos = head + direct * n
        for p in range(itemsize):
            kind, length = 0, n
            if p >= direct:
                plane = targets[p]
                body: Buffer = plane
                if modes[p] != "r" and n:
                    key = ("entropy",) if modes[p] == "e" else ("zstd", self.params["level"], False)
                    packed = _compressor(key).compress(plane)
                    if len(packed) < n:
                        body, kind, length = packed, 1, len(packed)
                if length:
                    out[pos:pos + length] = np.frombuffer(body, np.uint8)
                pos += length
            _PLANE_HEADER.pack_into(out, 1 + p * _PLANE_HEADER.size, kind, length)
        return memoryview(out)[:pos]

    def decode_into(self, data: memoryview, out: memoryview, itemsize: int) -> None:
        raw_len = len(out)
        if itemsize != len(self.params["planes"]) or raw_len % itemsize:
            raise FormatError("byteplane chunk does not match its element size")
        plane_len = raw_len // itemsize
        head = 1 + itemsize * _PLANE_HEADER.size
        if len(data) < head or data[0] != itemsize:
            raise FormatError("byteplane chunk header is damaged")
        pos, planes = head, []
        scratch = None
        for p in range(itemsize):
            kind, length = _PLANE_HEADER.unpack_from(data, 1 + p * _PLANE_HEADER.size)
            body = data[pos:pos + length]
            if len(body) != length:
                raise FormatError("byteplane plane runs past the chunk")
            pos += length
            if kind == 0:
                if length != plane_len:
                    raise FormatError(f"raw plane holds {length} bytes, expected {plane_len}")
                planes.append(np.frombuffer(body, np.uint8))
            elif kind == 1:
                if scratch is None:
                    scratch = _scratch("dplanes", raw_len)
                plane = scratch[p * plane_len:(p + 1) * plane_len]
                zstd_decompress_into(body, memoryview(plane))
                planes.append(plane)
            else:
                raise FormatError(f"byteplane plane mode {kind} unknown")
        if pos != len(data):
            raise FormatError("byteplane chunk has trailing bytes")
        merge_planes(planes, out, itemsize, self.params["fp"])


_REGISTRY: Dict[str, Type[Codec]] = {}


def register(cls: Type[Codec]) -> Type[Codec]:
    """Add a codec class to the registry under its ``name``."""
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (RawCodec, ZstdCodec, BytePlaneCodec):
    register(_cls)


def get_codec(name: str, params: Optional[Mapping[str, Any]] = None) -> Codec:
    """Build the codec ``name`` with ``params``; FormatError for unknown names or bad params."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise FormatError(f"unknown codec {name!r}")
    if params is not None and not isinstance(params, Mapping):
        raise FormatError("codec params must be a map")
    try:
        return cls(**dict(params or {}))
    except TypeError as exc:
        raise FormatError(f"bad params for codec {name}: {exc}") from None


def codec_names() -> Tuple[str, ...]:
    """Registered codec names (plus ``auto``, which resolves to one of them per segment)."""
    return tuple(_REGISTRY) + ("auto",)


# --------------------------------------------------------------------------- row dedup


class RowDedup:
    """Segment filter that stores each distinct row once.

    The tensor is viewed as rows of ``row_bytes``; ``src[i]`` is the index of the first row
    equal to row ``i`` (``i`` itself when row ``i`` is the first of its kind). The filtered
    payload is the first-of-kind rows in order; the map is stored as ``i - src[i]`` (uint32,
    mostly zeros or a constant stride, so it compresses to almost nothing).
    """

    #: Smallest row worth deduplicating; shorter rows cost more in map than they save.
    MIN_ROW_BYTES = 64

    @staticmethod
    def row_bytes_for(shape: Tuple[int, ...], itemsize: int) -> int:
        """Bytes of the smallest trailing sub-tensor that is at least MIN_ROW_BYTES (0: none)."""
        size = itemsize
        for dim in reversed(shape):
            size *= dim
            if size >= RowDedup.MIN_ROW_BYTES:
                return size if size % 8 == 0 else 0
        return 0

    @staticmethod
    def _keys(rows: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        words = rows.shape[1]
        cols = sorted({0, 1, words // 3, words // 2, (2 * words) // 3, words - 2, words - 1})
        keys = np.zeros(rows.shape[0], np.uint64) if out is None else out
        if out is not None:
            keys.fill(0)
        mult = np.uint64(0x9E3779B97F4A7C15)
        step = max(1, (1 << 20) // (8 * words))  # ~1 MiB of rows at a time stays in cache
        for lo in range(0, rows.shape[0], step):
            k, block = keys[lo:lo + step], rows[lo:lo + step]
            for c in cols:
                k *= mult
                k ^= block[:, c]
        return keys

    @staticmethod
    def sample_dup_fraction(buf: memoryview, row_bytes: int) -> float:
        """Share of repeated rows within a random sample of 1/16 of the rows (16Ki..256Ki).

        A birthday test: with 1/16 of the rows sampled, a tensor whose rows repeat in groups of
        two shows about 1/16 of its repeated share here, so callers use a low threshold.
        """
        n = len(buf) // row_bytes
        if n < 2:
            return 0.0
        rows = np.frombuffer(buf, np.uint64).reshape(n, row_bytes // 8)
        sample_rows = min(max(16384, n // 16), 1 << 18)
        if n > sample_rows:
            idx = np.sort(np.random.default_rng(0x6B766A).choice(n, sample_rows, replace=False))
            rows = rows[idx]
        keys = RowDedup._keys(rows)
        return 1.0 - len(np.unique(keys)) / len(keys)

    @staticmethod
    def row_keys(buf: memoryview, row_bytes: int, pool: Optional[Executor] = None) -> np.ndarray:
        """The 64-bit key of every row (half of them in ``pool`` when one is given)."""
        n = len(buf) // row_bytes
        rows = np.frombuffer(buf, np.uint64).reshape(n, row_bytes // 8)
        keys = np.empty(n, np.uint64)
        if pool is None or n < 8192:
            return RowDedup._keys(rows, keys)
        half = n // 2
        fut = pool.submit(RowDedup._keys, rows[half:], keys[half:])
        RowDedup._keys(rows[:half], keys[:half])
        if fut.cancel():  # the pool is busy with other work: do that half here
            RowDedup._keys(rows[half:], keys[half:])
        else:
            fut.result()
        return keys

    @staticmethod
    def find(buf: memoryview, row_bytes: int, keys: Optional[np.ndarray] = None) -> np.ndarray:
        """``src`` for every row of ``buf`` (rows verified byte-equal, not just hash-equal).

        ``keys`` are :meth:`row_keys` of ``buf``, computed here when not given.
        """
        n = len(buf) // row_bytes
        rows = np.frombuffer(buf, np.uint64).reshape(n, row_bytes // 8)
        if keys is None:
            keys = RowDedup._keys(rows)
        # Group equal keys with a plain (SIMD) argsort and take each group's smallest row
        # index: the first row of its kind. Faster than np.unique's stable sort.
        order = np.argsort(keys)
        sk = keys[order]
        new = np.empty(n, bool)
        new[0] = True
        np.not_equal(sk[1:], sk[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        first = np.minimum.reduceat(order, starts)
        src = np.empty(n, np.int64)
        src[order] = np.repeat(first, np.diff(np.append(starts, n)))
        # Verify every candidate byte for byte: long runs at a constant distance (a shared
        # prefix) as slices, without gathering copies; the rest row by row.
        back = np.arange(n, dtype=np.int64) - src
        starts, ends, vals = RowDedup._runs(back)
        scattered = np.ones(n, bool)
        for a, b, d in zip(starts.tolist(), ends.tolist(), vals.tolist()):
            if d:
                for lo in range(a, b, 4096):
                    hi = min(b, lo + 4096)
                    if np.array_equal(rows[lo:hi], rows[lo - d:hi - d]):
                        continue
                    same = (rows[lo:hi] == rows[lo - d:hi - d]).all(axis=1)
                    src[lo:hi][~same] = np.arange(lo, hi)[~same]
            scattered[a:b] = False
        cand = np.flatnonzero(scattered & (back != 0))
        for lo in range(0, len(cand), 4096):
            part = cand[lo:lo + 4096]
            same = (rows[part] == rows[src[part]]).all(axis=1)
            src[part[~same]] = part[~same]
        return src

    #: Runs of at least this many rows are copied or compared as slices.
    MIN_RUN = 64

    @staticmethod
    def _runs(back: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, end, back value) of each maximal run of at least MIN_RUN rows with equal
        ``back`` (``i - src[i]``): a run of first-of-kind rows, or of repeats at one distance."""
        n = len(back)
        if n == 0:
            return (np.zeros(0, np.int64),) * 3
        change = np.empty(n, bool)
        change[0] = True
        np.not_equal(back[1:], back[:-1], out=change[1:])
        starts = np.flatnonzero(change)
        ends = np.append(starts[1:], n)
        keep = ends - starts >= RowDedup.MIN_RUN
        starts, ends = starts[keep], ends[keep]
        return starts, ends, back[starts]

    @staticmethod
    def encode_map(src: np.ndarray) -> bytes:
        return (np.arange(len(src), dtype=np.int64) - src).astype("<u4").tobytes()

    @staticmethod
    def decode_map(data: Buffer, n_rows: int) -> Tuple[np.ndarray, np.ndarray]:
        """Validate a stored map; return (src, positions of first-of-kind rows)."""
        if len(data) != 4 * n_rows:
            raise FormatError("dedup map has the wrong length")
        back = np.frombuffer(data, "<u4").astype(np.int64)
        src = np.arange(n_rows, dtype=np.int64) - back
        if n_rows and (src.min() < 0 or (back[src] != 0).any()):
            raise FormatError("dedup map points outside the first-of-kind rows")
        return src, np.flatnonzero(back == 0)

    @staticmethod
    def gather(buf: memoryview, row_bytes: int, src: np.ndarray) -> np.ndarray:
        """The first-of-kind rows of ``buf`` in order, as one contiguous array."""
        rows = np.frombuffer(buf, np.uint8).reshape(-1, row_bytes)
        return rows[np.flatnonzero(src == np.arange(len(src)))]

    @staticmethod
    def scatter(unique: np.ndarray, out: memoryview, row_bytes: int, src: np.ndarray,
                firsts: np.ndarray) -> None:
        """Rebuild every row of ``out`` from the first-of-kind rows."""
        rows = np.frombuffer(out, np.uint8).reshape(-1, row_bytes)
        plan = ScatterPlan(src)
        plan.firsts(rows, unique.reshape(-1, row_bytes), 0, len(src))
        plan.repeats(rows, 0, len(src))


class ScatterPlan:
    """How to rebuild rows from a dedup map, in pieces that can run in parallel.

    First :meth:`firsts` for every row range (they only write first-of-kind rows), then
    :meth:`repeats` (they read only first-of-kind rows). Long runs (first-of-kind rows in a
    row, or repeats at one distance, as a shared prefix gives) are copied as slices, the
    other rows through index arrays.
    """

    def __init__(self, src: np.ndarray):
        n = len(src)
        self.src = src
        back = np.arange(n, dtype=np.int64) - src
        is_first = back == 0
        self.pidx = np.cumsum(is_first) - 1  # payload row of each first-of-kind row
        self.starts, self.ends, self.vals = RowDedup._runs(back)
        rest = np.ones(n, bool)
        for a, b in zip(self.starts.tolist(), self.ends.tolist()):
            rest[a:b] = False
        self.short_firsts = np.flatnonzero(rest & is_first)
        self.short_repeats = np.flatnonzero(rest & ~is_first)

    def _runs_in(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        i0 = int(np.searchsorted(self.ends, lo, side="right"))
        i1 = int(np.searchsorted(self.starts, hi, side="left"))
        return [(max(a, lo), min(b, hi), d) for a, b, d in zip(
            self.starts[i0:i1].tolist(), self.ends[i0:i1].tolist(), self.vals[i0:i1].tolist())]

    @staticmethod
    def _within(idx: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return idx[np.searchsorted(idx, lo):np.searchsorted(idx, hi)]

    def firsts(self, rows: np.ndarray, unique: np.ndarray, lo: int, hi: int) -> None:
        """Write the first-of-kind rows among rows ``lo..hi-1`` from the payload rows."""
        for a, b, d in self._runs_in(lo, hi):
            if not d:
                p = int(self.pidx[a])
                rows[a:b] = unique[p:p + (b - a)]
        idx = self._within(self.short_firsts, lo, hi)
        if len(idx):
            rows[idx] = unique[self.pidx[idx]]

    def repeats(self, rows: np.ndarray, lo: int, hi: int) -> None:
        """Copy the repeated rows among ``lo..hi-1`` from their (already written) sources."""
        for a, b, d in self._runs_in(lo, hi):
            if d:
                rows[a:b] = rows[a - d:b - d]
        idx = self._within(self.short_repeats, lo, hi)
        if len(idx):
            rows[idx] = rows[self.src[idx]]


# --------------------------------------------------------------------------- auto + pressure


class Backpressure:
    """Shared hint from the flush path to :func:`auto_codec`: 0 normal, 1 busy, 2 saturated.

    At 1 only codecs that save a lot are kept (and no row dedup search); at 2 everything is
    stored raw so that compression can never be what holds the queue up.
    """

    NORMAL, BUSY, SATURATED = 0, 1, 2

    def __init__(self) -> None:
        self._level = self.NORMAL

    @property
    def level(self) -> int:
        return self._level

    def set(self, level: int) -> None:
        self._level = max(self.NORMAL, min(self.SATURATED, int(level)))


#: Minimum sampled ratio for compression to be worth its CPU, by pressure level.
_MIN_GAIN = {Backpressure.NORMAL: 1.03, Backpressure.BUSY: 1.15}
_SAMPLE_SLICE = 64 << 10
_SAMPLE_SLICES = 4


def _sample(buf: memoryview, itemsize: int) -> memoryview:
    n = len(buf)
    if n <= _SAMPLE_SLICE * _SAMPLE_SLICES:
        return buf
    step = (n - _SAMPLE_SLICE) // (_SAMPLE_SLICES - 1)
    parts = [buf[(i * step) // itemsize * itemsize:][:_SAMPLE_SLICE] for i in range(_SAMPLE_SLICES)]
    return memoryview(b"".join(parts))


def auto_codec(buf: memoryview, itemsize: int, is_float: bool, pressure: int = 0) -> Codec:
    """Pick a codec for one segment from a sample of at most 256 KiB.

    Float data gets byte planes with a per-plane choice; everything is compared against plain
    zstd and raw. Returns raw when nothing saves ``_MIN_GAIN`` (more under pressure).
    """
    if pressure >= Backpressure.SATURATED or len(buf) < 4096:
        return RawCodec()
    sample = _sample(buf, itemsize)
    n = len(sample)
    best: Codec = RawCodec()
    best_size = n / _MIN_GAIN[pressure]
    zsize = len(_compressor(("zstd", 1, False)).compress(sample))
    if zsize < best_size:
        best, best_size = ZstdCodec(level=1), zsize
    if itemsize > 1 or is_float:
        modes, total = [], 0
        for plane in split_planes(sample, itemsize, is_float):
            raw = len(plane)
            esize = len(_compressor(("entropy",)).compress(plane))
            zsz = len(_compressor(("zstd", 1, False)).compress(plane)) if pressure == 0 else raw
            choice, size = min((("r", raw), ("e", esize), ("z", zsz)), key=lambda t: t[1])
            if size > raw * 0.98:
                choice, size = "r", raw
            modes.append(choice)
            total += size
        if total < best_size and set(modes) != {"r"}:
            best, best_size = BytePlaneCodec("".join(modes), fp=is_float, level=1), total
    return best
