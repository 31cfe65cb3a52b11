"""``byteplane``: elements split into byte planes, each stored raw (``r``), entropy-coded (``e``)
or zstd-compressed (``z``); for floats the sign bit first moves down beside the mantissa, so the
top plane holds the exponent. A plane that does not shrink in a chunk is stored raw there.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, List, Optional, Sequence

import numpy as np

from kvj.errors import FormatError
from kvj.segments.codecs.base import Buffer, Codec
from kvj.segments.codecs.registry import register
from kvj.segments.codecs.zstd import compressor, zstd_decompress

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()
_PLANE_MODES = "rez"
_PLANE_HEADER = struct.Struct("<BI")  # mode, stored length
_BLOCK = 1 << 17  # elements per numpy pass: keeps temporaries in cache


def _scratch(name: str, size: int, dtype: Any = np.uint8) -> np.ndarray:
    """A per-thread reusable array's first ``size`` elements (cache-warm, no page faults)."""
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
    """Byte planes of the elements in ``buf``, least significant first (into ``out`` when given).

    With ``fp`` the sign bit moves to bit 7 of plane 0 and the bits below it up by one, so the
    top plane holds the exponent's top 8 bits (all of it for bf16 and fp32) with no sign.
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


@register
class BytePlaneCodec(Codec):
    """Byte planes, one letter each in ``planes`` (least significant first): ``r``, ``e`` or ``z``
    (zstd at ``level``); ``fp``: :func:`split_planes`'s float bit move first (CODECS)."""

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
                    packed = compressor(key).compress(plane)
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
            elif kind == 1:  # one-shot into a new buffer is faster than streaming into scratch
                planes.append(np.frombuffer(zstd_decompress(body, plane_len), np.uint8))
            else:
                raise FormatError(f"byteplane plane mode {kind} unknown")
        if pos != len(data):
            raise FormatError("byteplane chunk has trailing bytes")
        merge_planes(planes, out, itemsize, self.params["fp"])
