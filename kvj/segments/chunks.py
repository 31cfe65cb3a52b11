"""A segment's chunks coded in parallel: the filter, the chunk codec, each chunk's CRC32C and digest leaf
(``segfile`` frames them and checks the digest of the leaves)."""

from __future__ import annotations

import collections
from concurrent.futures import Executor, Future, wait
from typing import TYPE_CHECKING, Callable, Deque, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import blake3
import crc32c

from kvj.errors import FormatError, SegmentCorrupt
from kvj.fileio import Buffer
from kvj.segments.codecs.base import Element, Filter, Filtered, Pipeline, Unfilter
from kvj.segments.codecs.raw import RawCodec
from kvj.segments.codecs.registry import get_codec
from kvj.segments.source import Source

if TYPE_CHECKING:
    from kvj.segments.segfile import Header

#: Tasks :func:`pmap` keeps submitted at once (millions of tiny chunks are not millions of futures).
IN_FLIGHT = 64


def spans(n: int, size: int) -> List[Tuple[int, int]]:
    """(offset, length) of each ``size`` piece of ``n`` bytes."""
    return [(off, min(size, n - off)) for off in range(0, n, size)]


def pmap(pool: Optional[Executor], fn: Callable, items: Sequence) -> List:
    """``[fn(it) for it in items]`` in ``pool``; on an error the tasks not started are cancelled
    and the running ones waited for, so none still writes into a caller's buffer."""
    if pool is None or len(items) <= 1:
        return [fn(it) for it in items]
    results: List = []
    pending: Deque[Future] = collections.deque()
    try:
        for item in items:
            if len(pending) == IN_FLIGHT:
                results.append(pending.popleft().result())
            pending.append(pool.submit(fn, item))
        while pending:
            results.append(pending.popleft().result())
    finally:
        for fut in pending:
            fut.cancel()
        wait(pending)
    return results


def leaf(view: memoryview) -> bytes:
    """One digest leaf (blake3 releases the GIL on inputs this large, so leaves hash in parallel)."""
    return blake3.blake3(view).digest()


class ChunkEncoder:
    """One tensor's raw bytes through a pipeline: the filter over the whole, then the codec per chunk.

    Digest leaves are not needed (``hashed``), *fused* (no filter: each chunk task hashes what it
    encodes while in cache) or pool tasks started before the filter runs.
    """

    def __init__(self, raw: memoryview, element: Element, chunk_size: int, hashed: bool,
                 pipeline: Pipeline, pool: Optional[Executor]):
        self.raw, self.element, self.chunk_size, self.pool = raw, element, chunk_size, pool
        self.codec = pipeline.codec
        self.filter_name = pipeline.filter.name if pipeline.filter is not None else None
        self.leaf_futures: List[Future] = []
        self.filtered = self._filter(pipeline.filter, hashed)
        self.payload_size = self.filtered.out_size if self.filtered else len(raw)
        self.spans = spans(self.payload_size, chunk_size)
        self.fused = not hashed and self.filtered is None and not self.leaf_futures
        self.fused_leaves: List[bytes] = []

    def _filter(self, filt: Optional[Filter], hashed: bool) -> Optional[Filtered]:
        """The raw bytes through ``filt`` (None without one, or when it does not pay)."""
        if filt is None:
            return None
        if not hashed and self.pool is not None:  # the pool hashes while the filter runs
            self.leaf_futures = [self.pool.submit(leaf, self.raw[o:o + n])
                                 for o, n in spans(len(self.raw), self.chunk_size)]
        return filt.encode(self.raw, self.pool)

    def _encode(self, span: Tuple[int, int]) -> Tuple[Buffer, int, Optional[bytes]]:
        """One chunk's stored bytes, their CRC, and (fused) its digest leaf."""
        off, n = span
        chunk = self.filtered.chunk(off, n) if self.filtered else self.raw[off:off + n]
        body = self.codec.encode(chunk, self.element.word)
        return body, crc32c.crc32c(body), leaf(chunk) if self.fused else None

    def pieces(self) -> Iterator[Tuple[Buffer, int]]:
        """(stored bytes, CRC) of the filter's side data, if any, then of every chunk, in file order."""
        if self.filtered:
            yield self.filtered.side, crc32c.crc32c(self.filtered.side)
        if self.pool is None or len(self.spans) <= 1:
            done: Iterator = map(self._encode, self.spans)
            futures: List[Future] = []
        else:
            futures = [self.pool.submit(self._encode, span) for span in self.spans]
            done = (fut.result() for fut in futures)
        try:
            for body, crc, chunk_leaf in done:
                if chunk_leaf is not None:
                    self.fused_leaves.append(chunk_leaf)
                yield body, crc
        finally:
            for fut in futures:
                fut.cancel()

    def leaves(self) -> List[bytes]:
        """The raw bytes' digest leaves, once :meth:`pieces` is exhausted (not given ones)."""
        if self.fused:
            return self.fused_leaves
        if self.leaf_futures:
            return [f.result() for f in self.leaf_futures]
        return [leaf(self.raw[o:o + n]) for o, n in spans(len(self.raw), self.chunk_size)]


class _Job(NamedTuple):
    """One chunk: its index, where its stored bytes are and their CRC, where its decoded bytes go."""

    index: int
    offset: int
    stored: int
    crc: int
    raw_offset: int
    raw_len: int


class ChunkDecoder:
    """One segment's chunks, each read, CRC-checked and decoded by any thread (no chunk is read until
    then), and its filter undone from the side data read and checked here."""

    def __init__(self, source: Source, header: "Header", start: int, word: int):
        self.source, self.header, self.name = source, header, source.name
        self.codec = get_codec(header.codec, header.params)
        self.word = word
        self.in_place = isinstance(self.codec, RawCodec)  # stored bytes are the raw bytes: read into place
        filt = header.stored_filter(self.name)
        pos = start
        self.unfilter: Optional[Unfilter] = None
        if filt is not None:
            side = bytes(source.read(pos, filt.side_size))
            crc_mismatch(self.name, filt.side_name, pos, filt.side_size, side, filt.side_crc)
            try:
                self.unfilter = filt.decoder(side, header.payload_size)
            except FormatError as exc:
                raise SegmentCorrupt(self.name, pos, str(exc)) from None
            pos += filt.side_size
        self.jobs: List[_Job] = []
        for i, (stored, crc) in enumerate(header.chunks):
            raw_off = i * header.chunk_size
            self.jobs.append(_Job(i, pos, stored, crc, raw_off, min(header.chunk_size, header.payload_size - raw_off)))
            pos += stored

    def decode(self, job: _Job, dest: memoryview) -> None:
        """Read chunk ``job``, check its CRC and decode it into ``dest``, which it must fill exactly."""
        if self.in_place and job.stored == job.raw_len:
            self.source.read_into(job.offset, dest)
            body: memoryview = dest
        else:
            body = self.source.read(job.offset, job.stored)
        crc_mismatch(self.name, f"chunk {job.index}", job.offset, job.stored, body, job.crc)
        if body is not dest:
            try:
                self.codec.decode_into(body, dest, self.word)
            except FormatError as exc:
                raise SegmentCorrupt(self.name, job.offset, f"chunk {job.index}: {exc}") from None

    def leaves(self, pool: Optional[Executor], into: Callable[[_Job], memoryview]) -> List[bytes]:
        """Each chunk decoded into ``into(job)`` and hashed there (without a filter the chunks are
        the raw bytes' leaves)."""
        def decode_and_leaf(job: _Job) -> bytes:
            dest = into(job)
            self.decode(job, dest)
            return leaf(dest)
        return pmap(pool, decode_and_leaf, self.jobs)

    def payload(self, pool: Optional[Executor]) -> memoryview:
        """Every chunk decoded into a new buffer of the payload (the filter's output)."""
        import numpy as np

        if not self.header.payload_size:
            return memoryview(bytearray())
        target = memoryview(np.empty(self.header.payload_size, np.uint8)).cast("B")
        pmap(pool, lambda job: self.decode(job, target[job.raw_offset:job.raw_offset + job.raw_len]), self.jobs)
        return target


def crc_mismatch(name: str, what: str, pos: int, size: int, data: Buffer, crc: int) -> None:
    """Raise ``SegmentCorrupt`` naming ``what`` and its byte range unless ``data`` has CRC32C ``crc``."""
    if crc32c.crc32c(data) != crc:
        raise SegmentCorrupt(name, pos, f"{what} CRC mismatch: the damage is somewhere in its bytes "
                                        f"{pos}..{pos + size}")
