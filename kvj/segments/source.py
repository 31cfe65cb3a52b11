"""A segment's stored bytes read by offset, from memory or a file by ``pread``: never mapped, so a
media error or a file truncated under the reader is a ``SegmentCorrupt`` naming it, not a SIGBUS."""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from typing import Union

from kvj.errors import SegmentCorrupt
from kvj.fileio import Buffer

#: Files up to this size are read whole in one read before they are parsed.
WHOLE_READ_BYTES = 1 << 16

_local = threading.local()


def pread_into(fd: int, out: memoryview, offset: int, name: str) -> None:
    """Fill ``out`` from ``fd`` at ``offset``; a read error or an early end is ``SegmentCorrupt``."""
    got = 0
    while got < len(out):
        try:
            n = os.preadv(fd, [out[got:]], offset + got)
        except OSError as exc:
            raise SegmentCorrupt(name, offset + got, f"read failed: {exc.strerror or exc}") from None
        if n == 0:
            raise SegmentCorrupt(name, offset + got, f"file ended after {offset + got} bytes, "
                                 f"{offset + len(out)} expected (truncated while being read)")
        got += n


def _thread_buffer(n: int) -> memoryview:
    """This thread's reusable read buffer of at least ``n`` bytes (no page faults on reuse)."""
    import numpy as np  # here: listing and stat-ing a store needs none

    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = np.empty(max(n, 1 << 20), np.uint8)
    return memoryview(buf)[:n]


class Source(ABC):
    """A segment's bytes, read by offset as the decoder needs them."""

    name: str
    size: int

    @abstractmethod
    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; ``SegmentCorrupt`` if the segment ends first."""

    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset`` in this thread's scratch buffer (valid until its next read)."""
        buf = _thread_buffer(n)
        self.read_into(offset, buf)
        return buf


class BytesSource(Source):
    """A whole segment file in memory (reads are zero-copy slices)."""

    def __init__(self, data: Buffer, name: str = "<segment>"):
        self.view = memoryview(data).cast("B")
        self.name, self.size = name, len(self.view)

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self.read(offset, len(out))

    def read(self, offset: int, n: int) -> memoryview:
        if offset + n > self.size:
            raise SegmentCorrupt(self.name, offset, "segment ends inside a chunk")
        return self.view[offset:offset + n]


class FileSource(Source):
    """A segment file, or a pack member from ``base``, read by ``pread`` (thread-safe)."""

    def __init__(self, fd: int, size: int, name: str, base: int = 0):
        self.fd, self.size, self.name, self.base = fd, size, name, base

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > self.size:
            raise SegmentCorrupt(self.name, offset, "segment ends inside a chunk")
        pread_into(self.fd, out, self.base + offset, self.name)


def as_source(data: Union[Buffer, Source], name: str = "<segment>") -> Source:
    """``data`` as a :class:`Source` (bytes in memory become a ``BytesSource``)."""
    return data if isinstance(data, Source) else BytesSource(data, name)


def whole_if_small(src: Source) -> Source:
    """``src`` read into memory in one read when it is small (parsing it then makes no more calls)."""
    if isinstance(src, BytesSource) or src.size > WHOLE_READ_BYTES:
        return src
    data = bytearray(src.size)
    src.read_into(0, memoryview(data))
    return BytesSource(data, src.name)
