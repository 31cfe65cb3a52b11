"""Row dedup: the ``dedup`` filter, which stores each distinct row of a tensor once.

Rows repeat anywhere in a KV cache of prompts sharing a prefix. ``RowDedup`` is the search and
the map, ``ScatterPlan`` the rebuild, ``RowDedupFilter`` the filter (``man/kvj-segment.5``, ROW DEDUP).
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from kvj.errors import FormatError
from kvj.segments.codecs.base import MAX_EXPANSION, Buffer, Filter, Filtered, Unfilter, field_int
from kvj.segments.codecs.registry import register_filter
from kvj.segments.codecs.zstd import ZstdCodec, zstd_decompress

#: Smaller segments are not searched (two chunks: closer repeats are per-chunk zstd's job).
MIN_SEGMENT_BYTES = 2 << 20
#: Repeated share of a 1/16 row sample above which the full search runs (see
#: ``RowDedup.sample_dup_fraction``).
MIN_SAMPLED_DUPS = 0.004
_MAP_LEVEL = 3
_FIELDS = ("row_bytes", "rows", "map_raw", "map_stored", "map_crc")


class RowDedup:
    """The search: over rows of ``row_bytes``, ``src[i]`` is the first row equal to row ``i`` (``i``
    itself for the first of its kind); the map stores ``i - src[i]`` (uint32, mostly zeros or a
    constant stride: it compresses to almost nothing)."""

    #: Smallest row worth deduplicating; shorter rows cost more in map than they save.
    MIN_ROW_BYTES = 64
    #: Runs of at least this many rows are copied or compared as slices.
    MIN_RUN = 64

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


@register_filter
class RowDedupFilter(Filter):
    """The ``dedup`` filter: the payload is the first-of-kind rows of ``row_bytes`` bytes, the
    side data the map (one zstd frame of ``i - src[i]`` per row) that rebuilds the others."""

    name = "dedup"
    side_name = "dedup map"

    def __init__(self, row_bytes: int, rows: int = 0, map_raw: int = 0, map_stored: int = 0,
                 map_crc: int = 0) -> None:
        self.row_bytes, self.rows, self.map_raw = row_bytes, rows, map_raw
        self.side_size, self.side_crc = map_stored, map_crc

    @staticmethod
    def for_segment(raw: memoryview, shape: Tuple[int, ...], itemsize: int, sample: bool) -> Optional["RowDedupFilter"]:
        """The filter for a segment whose rows may repeat (at least ``MIN_SEGMENT_BYTES`` with a
        row of at least ``RowDedup.MIN_ROW_BYTES``), else None; with ``sample`` only when a
        sample of its rows shows repeats."""
        row_bytes = RowDedup.row_bytes_for(shape, itemsize) if len(raw) >= MIN_SEGMENT_BYTES else 0
        if not row_bytes or (sample and RowDedup.sample_dup_fraction(raw, row_bytes) < MIN_SAMPLED_DUPS):
            return None
        return RowDedupFilter(row_bytes)

    def encode(self, raw: memoryview, pool: Optional[Executor]) -> Optional[Filtered]:
        keys = RowDedup.row_keys(raw, self.row_bytes, pool)
        src = RowDedup.find(raw, self.row_bytes, keys)
        if np.count_nonzero(src == np.arange(len(src))) == len(src):
            return None  # no repeated rows after all
        return _Rows(raw, self.row_bytes, src)

    @classmethod
    def from_field(cls, field: Any, in_size: int, out_size: int, stored_size: int) -> "RowDedupFilter":
        if not isinstance(field, dict):
            raise FormatError("bad dedup field")
        row_bytes = field_int(field, "row_bytes", 8, in_size or 8)
        rows = field_int(field, "rows", 1, in_size)
        map_stored = field_int(field, "map_stored", 1, stored_size)
        map_crc = field_int(field, "map_crc", 0, 0xFFFFFFFF)
        map_raw = field_int(field, "map_raw")
        if row_bytes % 8 or rows * row_bytes != in_size or map_raw != 4 * rows \
                or out_size % row_bytes or 4 * rows > map_stored * MAX_EXPANSION:
            raise FormatError("dedup fields are inconsistent")
        return cls(row_bytes, rows, map_raw, map_stored, map_crc)

    def field(self) -> Dict[str, Any]:
        """The header field (``from_field``'s inverse)."""
        return dict(zip(_FIELDS, (self.row_bytes, self.rows, self.map_raw, self.side_size, self.side_crc)))

    def decoder(self, side: Buffer, out_size: int) -> Unfilter:
        src, firsts = RowDedup.decode_map(zstd_decompress(side, self.map_raw), self.rows)
        if len(firsts) * self.row_bytes != out_size:
            raise FormatError("dedup map disagrees with the payload size")
        return _Scatter(src, self.row_bytes)


class _Rows(Filtered):
    """A tensor's first-of-kind rows, gathered by the task that needs them, and the map."""

    def __init__(self, raw: memoryview, row_bytes: int, src: np.ndarray):
        self.row_bytes = row_bytes
        self.rows = np.frombuffer(raw, np.uint8).reshape(-1, row_bytes)
        self.firsts = np.flatnonzero(src == np.arange(len(src)))
        self.out_size = len(self.firsts) * row_bytes
        map_raw = RowDedup.encode_map(src)
        self.side = ZstdCodec(level=_MAP_LEVEL).encode(memoryview(map_raw), 4)
        self.n_rows, self.map_raw = len(src), len(map_raw)

    def chunk(self, offset: int, n: int) -> memoryview:
        r0, r1 = offset // self.row_bytes, -(-(offset + n) // self.row_bytes)
        block = self.rows[self.firsts[r0:r1]].reshape(-1)
        skip = offset - r0 * self.row_bytes
        return memoryview(block[skip:skip + n])

    def field(self, side_crc: int) -> Dict[str, Any]:
        return RowDedupFilter(self.row_bytes, self.n_rows, self.map_raw, len(self.side), side_crc).field()


class _Scatter(Unfilter):
    """Rebuilding rows: first-of-kind rows in two halves (``prepare``), then per range the
    repeated rows it covers (``fill``; a row straddling two ranges is written by both, with
    the same bytes)."""

    def __init__(self, src: np.ndarray, row_bytes: int):
        self.src, self.row_bytes = src, row_bytes

    def prepare(self, payload: memoryview, out: memoryview, pool: Optional[Executor]) -> None:
        self.rows = np.frombuffer(out, np.uint8).reshape(-1, self.row_bytes)
        unique = np.frombuffer(payload, np.uint8).reshape(-1, self.row_bytes)
        self.plan = ScatterPlan(self.src)
        n = len(self.src)
        halves = [(0, n // 2), (n // 2, n)]
        if pool is None:
            for lo, hi in halves:
                self.plan.firsts(self.rows, unique, lo, hi)
        else:
            list(pool.map(lambda r: self.plan.firsts(self.rows, unique, r[0], r[1]), halves))

    def fill(self, offset: int, n: int) -> None:
        self.plan.repeats(self.rows, offset // self.row_bytes,
                          min(len(self.src), -(-(offset + n) // self.row_bytes)))

    def reader(self, payload: memoryview, raw_size: int, pool: Optional[Executor]) -> Callable[[int, int], memoryview]:
        unique = np.frombuffer(payload, np.uint8).reshape(-1, self.row_bytes)
        # each row's payload row: that of its first of kind (the map is checked: src[i] is one)
        origin = (np.cumsum(self.src == np.arange(len(self.src))) - 1)[self.src]
        row_bytes = self.row_bytes

        def read(offset: int, n: int) -> memoryview:
            r0, r1 = offset // row_bytes, -(-(offset + n) // row_bytes)
            skip = offset - r0 * row_bytes
            return memoryview(unique[origin[r0:r1]].reshape(-1)[skip:skip + n])
        return read
