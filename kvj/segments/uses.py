"""The store's use log: when each segment was last used, and how many loads were served.

Eviction under a byte budget removes the least recently used segments first. A log of its own,
not file times: atime is off or lazy on most servers, mtime is the claim time collection's grace
depends on, and a pack has one mtime for all its members. Appends are one ``write`` without
fsync: the log is advisory, and what keeps a segment safe is never here (USE LOG in
``man/kvj-segment.5``, which specifies the 53-byte record).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Iterable, Iterator, Optional, Set, Tuple

import crc32c

from kvj.errors import CorruptionError, FormatError, LayoutMismatch, SegmentMissing, UnsafePath
from kvj.fileio import FS, atomic_write, open_regular

logger = logging.getLogger(__name__)

USES_NAME = "uses.kvjuse"
RECORD = struct.Struct("<B32sQQI")
USE, MISS = 1, 2
#: The key the folded totals are recorded under (no segment's digest).
TOTALS_KEY = "0" * 64


@dataclass
class Uses:
    """What the use log says: each key's last use (Unix seconds) and the load counts."""

    last: Dict[str, float] = field(default_factory=dict)
    served: int = 0
    missed: int = 0
    #: Bytes after the last valid record (a torn append).
    ignored_bytes: int = 0
    #: Records failing their CRC (or naming no kind) before a valid one: damage, skipped (fsck reports it).
    damaged: int = 0
    damage_offset: Optional[int] = None

    @property
    def asked(self) -> int:
        return self.served + self.missed

    def hit_rate(self) -> Optional[float]:
        """Loads served / loads asked; None before any load was asked."""
        return self.served / self.asked if self.asked else None


def encode(entries: Iterable[Tuple[int, str, int]], now_ns: Optional[int] = None) -> bytes:
    """Records for (kind, key, count) entries, all stamped ``now_ns`` (default: now)."""
    stamp = time.time_ns() if now_ns is None else now_ns
    out = []
    for kind, key, count in entries:
        head = struct.pack("<B32sQQ", kind, bytes.fromhex(key), stamp, count)
        out.append(head + struct.pack("<I", crc32c.crc32c(head)))
    return b"".join(out)


def parse(data: bytes) -> Uses:
    """The uses ``data`` records. Every whole record is read; one failing its CRC is skipped:
    damage (counted) when a valid record follows it, else part of the torn tail."""
    uses = Uses()
    end = 0  # after the last valid record
    bad = []  # offsets of the records failing their checks since the last valid one
    for pos in range(0, len(data) - RECORD.size + 1, RECORD.size):
        kind, key, stamp, count, crc = RECORD.unpack_from(data, pos)
        if crc32c.crc32c(data[pos:pos + RECORD.size - 4]) != crc or kind not in (USE, MISS):
            bad.append(pos)
            continue
        if bad:
            uses.damaged += len(bad)
            if uses.damage_offset is None:
                uses.damage_offset = bad[0]
            bad = []
        end = pos + RECORD.size
        if kind == MISS:
            uses.missed += count
            continue
        uses.served += count
        hexkey = key.hex()
        if hexkey != TOTALS_KEY:
            seconds = stamp / 1e9
            if seconds > uses.last.get(hexkey, 0.0):
                uses.last[hexkey] = seconds
    uses.ignored_bytes = len(data) - end
    return uses


class UseLog:
    """``root/uses.kvjuse`` of a local store. ``lock(exclusive)`` is the store's collection lock:
    appends hold it shared and a fold exclusive, so a fold never drops a concurrent append."""

    def __init__(self, root: str, fs: FS, lock: Callable[[bool], ContextManager[None]]):
        self.path = os.path.join(root, USES_NAME)
        self.fs = fs
        self.lock = lock
        self._broken = False

    def record(self, entries: Iterable[Tuple[int, str, int]]) -> None:
        """Append records for ``entries`` (one write, no fsync). A failure is logged once and
        recording stops for this store: bookkeeping never fails a load or a put."""
        data = encode(entries)
        if not data or self._broken or not os.path.isdir(os.path.dirname(self.path)):
            return
        try:
            with self.lock(False):
                fd = self.fs.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                try:
                    self.fs.write(fd, data)
                finally:
                    self.fs.close(fd)
        except OSError as exc:
            self._broken = True
            logger.warning("kvj: cannot append to %s (%s): segment uses are not recorded from now on; "
                           "eviction falls back to file times", self.path, exc)

    @contextmanager
    def counting(self, key: str) -> Iterator[None]:
        """Record a load of ``key``: served, or (when the block raises what a missing or damaged
        segment, or one of another layout, raises) asked and not served."""
        try:
            yield
        except (SegmentMissing, CorruptionError, FormatError, LayoutMismatch):
            self.record([(MISS, key, 1)])
            raise
        self.record([(USE, key, 1)])

    def read(self) -> Uses:
        """What the log records (an empty ``Uses`` when there is none). Read-only."""
        try:
            fd = open_regular(self.path)
        except (FileNotFoundError, UnsafePath):  # none, or not a file kvj wrote: it records nothing
            return Uses()
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return parse(f.read())
        finally:
            os.close(fd)

    def fold(self, keep: Set[str]) -> Uses:
        """Rewrite the log durably as one record per key of ``keep`` it knows a use of, plus the
        totals (under the exclusive collection lock); what it recorded before."""
        with self.lock(True):
            uses = self.read()
            if not os.path.lexists(self.path):
                return uses
            folded = [encode([(USE, key, 0)], int(uses.last[key] * 1e9)) for key in sorted(keep & set(uses.last))]
            folded.append(encode([(USE, TOTALS_KEY, uses.served), (MISS, TOTALS_KEY, uses.missed)]))
            atomic_write(self.path, b"".join(folded), self.fs)
        return uses
