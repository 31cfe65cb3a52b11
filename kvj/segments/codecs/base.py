"""The chunk codec interface: what every codec in this package implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict

from kvj.fileio import Buffer


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
