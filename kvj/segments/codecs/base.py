"""The codec interfaces: chunk codecs, filters, and the pipeline of the two a segment is written
with (zarr v3's model: filters are codecs too, run before the chunk codec)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Mapping, NamedTuple, Optional

from kvj.errors import FormatError
from kvj.fileio import Buffer

#: No valid stored piece expands more than this (a zstd RLE block is 4 bytes for 128 KiB).
MAX_EXPANSION = 1 << 15


def field_int(m: Mapping, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    """Header field ``key`` of ``m``: an integer in ``lo..hi``; FormatError otherwise."""
    v = m.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FormatError(f"header field {key!r} missing or out of range")
    return v


class Backpressure:
    """The flush path's hint to ``auto.choose``: at BUSY only codecs that save a lot are kept (and
    no row dedup search); at SATURATED everything is stored raw, so compression never holds the queue up."""

    NORMAL, BUSY, SATURATED = 0, 1, 2

    def __init__(self) -> None:
        self._level = self.NORMAL

    @property
    def level(self) -> int:
        return self._level

    def set(self, level: int) -> None:
        self._level = max(self.NORMAL, min(self.SATURATED, int(level)))


class Element(NamedTuple):
    """What the codecs know of a dtype: its header name, bytes per element, bytes per word they
    see (half the element for complex types: two floats), floating or not."""

    name: str
    itemsize: int
    word: int
    is_float: bool


class Codec(ABC):
    """One chunk codec, stateless and thread-safe; ``encode``'s output decodes bit-exactly with the same params."""

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


class Filtered(ABC):
    """One segment's raw bytes through a filter: the payload, made a chunk at a time by the task
    that compresses it (never whole), and the side data stored before the chunks."""

    out_size: int
    side: Buffer

    @abstractmethod
    def chunk(self, offset: int, n: int) -> memoryview:
        """Payload bytes ``offset .. offset + n``."""

    def field(self, side_crc: int) -> Dict[str, Any]:
        """The filter's header field, once its side data's CRC is known."""
        raise FormatError(f"filter {type(self).__name__} is not stored in segment headers")


class Unfilter(ABC):
    """Undoing a filter: ``prepare`` once the payload is decoded, then ``fill`` the output's
    ranges, which are independent (run in parallel, each hashed while in cache)."""

    @abstractmethod
    def prepare(self, payload: memoryview, out: memoryview, pool: Optional[Executor]) -> None:
        """Start rebuilding ``out`` (all of the raw bytes) from ``payload``."""

    @abstractmethod
    def fill(self, offset: int, n: int) -> None:
        """Finish ``out[offset:offset + n]``."""

    def reader(self, payload: memoryview, raw_size: int, pool: Optional[Executor]) -> Callable[[int, int], memoryview]:
        """A thread-safe function giving raw bytes ``offset .. offset + n``, for a check that hashes
        them a piece at a time. This one rebuilds them all first; a filter that can rebuild a
        piece from ``payload`` alone overrides it, so that its segments verify without them."""
        import numpy as np

        out = memoryview(np.empty(raw_size, np.uint8)).cast("B") if raw_size else memoryview(bytearray())
        self.prepare(payload, out, pool)
        self.fill(0, raw_size)
        return lambda offset, n: out[offset:offset + n]


class Filter(ABC):
    """A transform of a segment's whole raw bytes before the chunk codec.

    One stored in segment headers (``registry.register_filter``) is rebuilt from its header
    field by :meth:`from_field`; one whose reference lies outside the segment (the XOR delta's
    base) is applied by its caller and named in the segment's layout.
    """

    name: ClassVar[str]
    #: Bytes of side data stored before the chunks, and their CRC32C (from a header field).
    side_size: int = 0
    side_crc: int = 0
    #: What the side data is, for error messages.
    side_name: ClassVar[str] = "filter side data"

    @abstractmethod
    def encode(self, raw: memoryview, pool: Optional[Executor]) -> Optional[Filtered]:
        """``raw`` through this filter, or None when it would not pay for these bytes."""

    @abstractmethod
    def decoder(self, side: Buffer, out_size: int) -> Unfilter:
        """How to undo this filter from its (CRC-checked) side data; FormatError if they do not fit."""

    @classmethod
    def from_field(cls, field: Any, in_size: int, out_size: int, stored_size: int) -> "Filter":
        """The filter a header field describes, checked against the segment's raw, payload and
        stored sizes; FormatError when they do not fit."""
        raise FormatError(f"filter {cls.name} is not stored in segment headers")

    def field(self) -> Dict[str, Any]:
        """The filter's header field (:meth:`from_field`'s inverse)."""
        raise FormatError(f"filter {self.name} is not stored in segment headers")


@dataclass(frozen=True)
class Pipeline:
    """How one segment is encoded: an optional filter over its raw bytes, then the chunk codec."""

    codec: Codec
    filter: Optional[Filter] = None
