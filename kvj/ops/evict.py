"""Eviction under a byte budget: the segment store as a bounded, least-recently-used prefix cache.

Never evicted: what the live state or a recovery manifest needs, what a writer claims or a
record appended since the replay names, anything younger than ``min_age``; removal goes through
``SegmentStore.delete_many`` under the store's collection lock, as collection does, so a
concurrent writer either keeps its segment or writes it anew. Last use comes from the store's
use log (``kvj.segments.uses``), else the file time.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from kvj.errors import FormatError, InvalidArgument, SegmentMissing
from kvj.fileio import FS, REAL_FS, fsync_path, list_dir
from kvj.journal.follow import Follower
from kvj.journal.journal import segment_keys
from kvj.journal.reader import list_logs
from kvj.journal.replay import replay
from kvj.journal.recovery import MAX_MANIFEST_BYTES, RECOVERY_DIR
from kvj.ops.recover import MANIFEST_RE, manifest_keys
from kvj.untrusted import read_json

#: Eviction never removes a segment stored or claimed this recently (nor, when the grace period
#: is shorter, more recently than the grace period): the longest a writer takes from a put to
#: the journal record that references it, many times over.
EVICT_MIN_AGE = 60.0
#: Segments deleted per ``delete_many`` call (their directories are fsynced once per batch).
EVICT_BATCH = 4096

Progress = Callable[[str, int, int], None]


class LateReferences:
    """The ``keep`` of a collector's removals (``SegmentStore.delete_many``): the keys that records
    appended since its replay (up to ``after_lsn``) name. Asked under the store's collection lock
    once the claims were checked, it reads the log as far as it goes then: a writer gives a claim
    back only once the record naming its key is in the log (man/kvj-segment.5, CLAIMS). An END
    read here releases nothing: only what the replay saw, made durable first, does."""

    def __init__(self, directory: str, after_lsn: int):
        self._follower = Follower(directory, after_lsn=after_lsn)
        self.keys: Set[str] = set()

    def __call__(self, batch: List[str]) -> Set[str]:
        for rec in self._follower.poll():
            self.keys.update(segment_keys(rec.rtype, rec.payload))
        return self.keys.intersection(batch)


def manifest_needs(journal: str) -> Set[str]:
    """Every segment key a recovery manifest in ``journal/recovery/`` plans to load. A manifest
    that cannot be read is ``FormatError`` naming it: eviction never guesses what it needs."""
    directory = os.path.join(journal, RECOVERY_DIR)
    keys: Set[str] = set()
    for name in sorted(n for n in list_dir(directory) if MANIFEST_RE.match(n)):
        path = os.path.join(directory, name)
        manifest = read_json(path, max_bytes=MAX_MANIFEST_BYTES)
        try:
            keys.update(manifest_keys(manifest))
        except (KeyError, TypeError, AttributeError):
            raise FormatError(f"{path}: not a recovery manifest (eviction needs to know what it plans to "
                              "load; kvj prune removes old manifests)") from None
    return keys


def needed_keys(journal: str) -> Tuple[Dict[str, str], int]:
    """Keys eviction must keep, mapped to who needs them: the live state's references, then
    the recovery manifests'; and the last LSN the replay read."""
    state = replay(journal)
    needed = dict(state.referenced_keys())
    for key in manifest_needs(journal):
        needed.setdefault(key, "a recovery manifest")
    return needed, state.last_lsn


def evict_segments(journal: str, store: Any, result: Any, *, max_bytes: int, now: float,
                   min_age: float = EVICT_MIN_AGE, progress: Optional[Progress] = None,
                   fs: FS = REAL_FS) -> None:
    """Evict unneeded segments, least recently used first, until ``store`` holds at most
    ``max_bytes`` (see the module docstring). Fills ``result`` (a ``CompactResult``):
    ``segments_evicted``, ``bytes_reclaimed``, ``store_bytes`` (after) and ``over_budget``
    (bytes still above the budget: needed or too young). With ``result.dry_run`` nothing is
    removed and the result says what would be.
    """
    if max_bytes < 0:
        raise InvalidArgument("the store's byte budget cannot be negative")
    if min_age < 0:
        raise InvalidArgument("the minimum age of an evicted segment cannot be negative")
    cutoff = now - min_age
    listed: List[Tuple[str, int, float]] = []  # (key, size, file time)
    for key in store.keys():
        try:
            stat = store.stat(key)
        except SegmentMissing:
            continue
        listed.append((key, stat.size, stat.used))
    total = sum(size for _key, size, _used in listed)
    result.max_store_bytes = max_bytes
    if total > max_bytes:
        needed, lsn = needed_keys(journal)  # read after the listing: a segment stored since is no candidate
        uses = store.backend.uses.read().last
        candidates = sorted(((uses.get(key, used), key, size) for key, size, used in listed
                             if key not in needed and used <= cutoff))
        total -= _evict(journal, store, result, candidates, total - max_bytes, cutoff, progress, fs,
                        LateReferences(journal, lsn))
    result.store_bytes = total
    result.over_budget = max(0, total - max_bytes)


def _evict(journal: str, store: Any, result: Any, candidates: List[Tuple[float, str, int]], excess: int,
           cutoff: float, progress: Optional[Progress], fs: FS, late: LateReferences) -> int:
    """Remove ``candidates`` (last use, key, size; oldest first) until ``excess`` bytes are gone;
    the bytes removed."""
    freed = 0
    if result.dry_run:
        for _used, key, size in candidates:
            if freed >= excess:
                break
            result.segments_evicted.append(key)
            freed += size
        result.bytes_reclaimed += freed
        return freed
    # An END seen above may still sit unsynced in the page cache of a live or killed writer;
    # make it durable before deleting what it released.
    for log in list_logs(journal):
        fsync_path(log, fs)
    pos = 0
    while freed < excess and pos < len(candidates):
        batch: List[Tuple[float, str, int]] = []
        want = excess - freed
        while pos < len(candidates) and want > 0 and len(batch) < EVICT_BATCH:
            batch.append(candidates[pos])
            want -= candidates[pos][2]
            pos += 1
        removed = set(store.delete_many([key for _used, key, _size in batch], older_than=cutoff, keep=late))
        for _used, key, size in batch:
            if key in removed:  # kept ones were claimed since the listing: the next candidates stand in
                result.segments_evicted.append(key)
                freed += size
        if progress:
            progress("evicting segments", pos, len(candidates))
    result.bytes_reclaimed += freed
    return freed
