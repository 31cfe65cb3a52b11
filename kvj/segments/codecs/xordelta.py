"""XOR delta: a filter storing a tensor's bits XORed with a base's of the same size.

Values that change little keep sign and exponent, so the high byte planes are nearly all zeros.
The base is another segment: the caller (``kvj.integrations.training.delta``) applies this and
records the base in the layout (kvj-segment(5), XOR DELTA).
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Optional

import numpy as np

from kvj.errors import FormatError
from kvj.fileio import Buffer
from kvj.segments.codecs.base import Filter, Filtered, Unfilter


def _u8(buf: Buffer) -> np.ndarray:
    return np.frombuffer(buf, np.uint8)


class XorDelta(Filter):
    """``raw XOR base``, byte for byte (XOR is its own inverse)."""

    name = "xor"

    def __init__(self, base: Buffer) -> None:
        self.base = _u8(base)

    def _check(self, n: int) -> None:
        if n != len(self.base):
            raise FormatError(f"XOR delta of {n} bytes against a base of {len(self.base)}")

    def encode(self, raw: memoryview, pool: Optional[Executor]) -> Filtered:
        self._check(len(raw))
        return _Xored(_u8(raw), self.base)

    def decoder(self, side: Buffer, out_size: int) -> Unfilter:
        if len(side):
            raise FormatError("XOR delta has no side data")
        self._check(out_size)
        return _Unxor(self.base)

    def apply(self, raw: Buffer) -> np.ndarray:
        """``raw`` XOR the base in a new array: the delta to store, or the bytes a stored one stands for."""
        self._check(len(raw))
        return np.bitwise_xor(_u8(raw), self.base)


class _Xored(Filtered):
    side = b""

    def __init__(self, raw: np.ndarray, base: np.ndarray):
        self.raw, self.base, self.out_size = raw, base, len(raw)

    def chunk(self, offset: int, n: int) -> memoryview:
        return memoryview(np.bitwise_xor(self.raw[offset:offset + n], self.base[offset:offset + n]))


class _Unxor(Unfilter):
    def __init__(self, base: np.ndarray):
        self.base = base

    def prepare(self, payload: memoryview, out: memoryview, pool: Optional[Executor]) -> None:
        self.payload, self.out = _u8(payload), np.frombuffer(out, np.uint8)

    def fill(self, offset: int, n: int) -> None:
        end = offset + n
        np.bitwise_xor(self.payload[offset:end], self.base[offset:end], out=self.out[offset:end])
