"""Compaction: fold sealed log files into a snapshot, delete what it replaced, collect segments.

Safe from cron beside a live writer: one compactor at a time (the ``COMPACT`` lock); only
sealed files are folded; the snapshot is durable before anything it covers is unlinked. A
segment is collected only when no live record needs it, no writer claims it
(``kvj.segments.claims``) and it is older than the grace period. With a byte budget, what
nothing needs (the prefix cache of ended requests included) is then evicted least recently
used first (``kvj.ops.evict``). ``dry_run`` changes nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, InvalidArgument, SegmentMissing
from kvj.fileio import FS, READ_ONLY_FS, REAL_FS, fsync_path
from kvj.journal.config import config_max_store_bytes, default_store_path
from kvj.journal.recovery import COMPACT_LOCK, DirLock
from kvj.journal.reader import Scan, fields_of, list_logs, read_header
from kvj.journal.replay import RecordStream, check_journal, collector_paused
from kvj.journal.snapshot import encode_snapshot, list_snapshots, load_latest, snapshot_name, write_snapshot
from kvj.journal.state import JournalState
from kvj.ops.evict import EVICT_MIN_AGE, LateReferences, evict_segments
from kvj.segments.check import opened_store

DEFAULT_GRACE = 3600.0
#: Segments deleted per ``delete_many`` call: their directories are fsynced once per batch.
COLLECT_BATCH = 4096

Progress = Callable[[str, int, int], None]


@dataclass
class CompactResult:
    """What one compaction did."""

    snapshot: Optional[str] = None  # path of the snapshot written, if any
    snapshot_lsn: int = 0
    snapshot_bytes: int = 0
    logs_removed: List[str] = field(default_factory=list)
    snapshots_removed: List[str] = field(default_factory=list)
    segments_removed: List[str] = field(default_factory=list)
    segments_kept_young: int = 0  # unreferenced but inside the grace period
    bytes_reclaimed: int = 0  # log files, old snapshots and segments deleted
    max_store_bytes: Optional[int] = None  # the byte budget applied, if any
    segments_evicted: List[str] = field(default_factory=list)  # least recently used, to fit the budget
    store_bytes: Optional[int] = None  # what the store holds after eviction (with a budget)
    over_budget: int = 0  # bytes still above the budget: segments needed, or used too recently
    dry_run: bool = False  # nothing was done: the rest says what would be

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


def _base_lsn(path: str) -> Optional[int]:
    """First LSN of a log file; None while the writer is still creating it (no header yet)."""
    header = read_header(path)
    return header.base_lsn if header is not None else None


def fold_sealed(directory: str, sealed: List[str]) -> JournalState:
    """The newest snapshot plus every record in the sealed log files, checked strictly."""
    state = load_latest(directory) or JournalState()
    if not sealed:
        return state
    with collector_paused():  # replay's fold: no Record per record, the cycle collector paused
        for raw in Scan(directory, after_lsn=state.snapshot_lsn, strict=True, logs=sealed):
            state.apply(raw.rtype, fields_of(raw), raw.lsn)
    return state


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _unlink_all(paths: List[str], directory: str, fs: FS, dry_run: bool = False) -> int:
    """Unlink ``paths`` in order, then fsync the directory; returns the bytes freed (would free)."""
    freed = 0
    for path in paths:
        size = _size(path)
        if not dry_run:
            fs.unlink(path)
        freed += size
    if paths and not dry_run:
        fs.fsync_dir(directory)
    return freed


def compact_logs(directory: str, result: CompactResult, fs: FS = REAL_FS,
                 holds: Optional[Callable[[str], bool]] = None) -> JournalState:
    """Fold the sealed logs into a durable snapshot, then delete the logs and snapshots it covers
    (with ``result.dry_run``, only count them). ``holds(key)``: whether the store still holds a
    segment; the snapshot's prefix cache keeps only those (None: the cache is kept as it is)."""
    logs = list_logs(directory)
    sealed, newest = logs[:-1], logs[-1:]
    state = fold_sealed(directory, sealed)
    snaps = list_snapshots(directory)
    if sealed:
        # Everything before the newest file's first LSN is in the sealed files, hence in ``state``.
        base = _base_lsn(newest[0])
        if base is not None and state.last_lsn < base - 1:
            raise CorruptionError(sealed[-1], None, f"sealed logs end at LSN {state.last_lsn} but the "
                                  f"newest log starts at LSN {base}")
        if state.last_lsn > state.snapshot_lsn:
            if holds is not None:
                state.cache = {chain: ref for chain, ref in state.cache.items() if ref.key and holds(ref.key)}
            if result.dry_run:
                result.snapshot = os.path.join(directory, snapshot_name(state.last_lsn))
                result.snapshot_bytes = len(encode_snapshot(state))
            else:
                result.snapshot = write_snapshot(directory, state, fs)
                result.snapshot_bytes = _size(result.snapshot)
            result.snapshot_lsn = state.last_lsn
            state.snapshot_lsn = state.last_lsn
            _drop_ended(state)  # what the snapshot holds, as a replay from it would see it
        removed = sealed  # oldest first: a crash midway leaves a suffix that still replays
        result.bytes_reclaimed += _unlink_all(removed, directory, fs, result.dry_run)
        result.logs_removed = removed
    keep = state.snapshot_lsn
    old = [path for lsn, path in snaps if lsn < keep]
    result.bytes_reclaimed += _unlink_all(sorted(old), directory, fs, result.dry_run)
    result.snapshots_removed = sorted(old)
    return state


def _drop_ended(state: JournalState) -> None:
    """Leave out of ``state`` the ended requests, as a snapshot of it does (``to_dict(include_ended=False)``)."""
    ended = [rid for rid, req in state.requests.items() if req.ended]
    for rid in ended:
        del state.requests[rid]
    state.ended_compacted += len(ended)


def collect_segments(directory: str, store: Any, result: CompactResult, folded: JournalState, *, grace: float,
                     now: float, progress: Optional[Progress] = None, fs: FS = REAL_FS,
                     keep_cache: bool = False) -> None:
    """Delete segments that no live record references and that are older than ``grace`` seconds
    (with ``keep_cache``, under a byte budget, the prefix cache's are kept: eviction's to remove).

    ``folded``: the journal's state as ``compact_logs`` left it (its snapshot and sealed logs
    folded), so that only the log after it is read here (and folded into it), not the snapshot
    just written and the log after it again.

    Candidates are listed *before* the journal is replayed for references, so a segment
    stored after the listing is never a candidate. Each candidate is deleted only if it is
    still that old, no writer claims it, and no record appended since the replay names it,
    checked and unlinked under the store's exclusive collection lock
    (``SegmentStore.delete_many(older_than=..., keep=...)``): a segment a writer in any process
    has stored or deduplicated against and not yet journaled survives, whatever the grace
    period, and one deleted first is written anew by that writer.
    The deletions are made durable a batch at a time (one fsync per directory per batch); one
    a crash undoes is an unreferenced segment again, collected by the next compaction.
    """
    cutoff = now - grace
    aged: List[Tuple[str, int]] = []
    young: List[str] = []
    for key in store.keys():
        try:
            stat = store.stat(key)
        except SegmentMissing:
            continue
        if stat.used <= cutoff:
            aged.append((key, stat.size))
        else:
            young.append(key)
    RecordStream(directory, after_lsn=folded.last_lsn).fold(folded)
    referenced = folded.referenced_keys()
    if keep_cache:
        referenced.update(folded.cached_keys())
    doomed = [(key, size) for key, size in aged if key not in referenced]
    result.segments_kept_young = sum(1 for key in young if key not in referenced)
    if result.dry_run:
        result.segments_removed = [key for key, _size in doomed]
        result.bytes_reclaimed += sum(size for _key, size in doomed)
        return
    # An END (or a new checkpoint) seen above may still sit unsynced in the page cache of a
    # live or killed writer; make it durable before deleting what it released.
    for log in list_logs(directory):
        fsync_path(log, fs)
    late = LateReferences(directory, folded.last_lsn)
    for done in range(0, len(doomed), COLLECT_BATCH):
        batch = doomed[done:done + COLLECT_BATCH]
        removed = set(store.delete_many([key for key, _size in batch], older_than=cutoff, keep=late))
        for key, size in batch:
            if key in removed:
                result.segments_removed.append(key)
                result.bytes_reclaimed += size
            elif store.exists(key):
                result.segments_kept_young += 1
        if progress:
            progress("collecting segments", done + len(batch), len(doomed))


def compact(directory: str, store: Any = None, *, grace: float = DEFAULT_GRACE,
            collect: bool = True, fs: FS = REAL_FS, now: Optional[float] = None,
            progress: Optional[Progress] = None, dry_run: bool = False,
            max_store_bytes: Optional[int] = None) -> CompactResult:
    """Compact the journal at ``directory`` (see the module docstring); returns what was done
    (with ``dry_run``, what would be, changing nothing).

    ``store`` is a ``SegmentStore`` or its root; None means ``<journal>/segments``.
    ``collect=False`` leaves segments alone. ``max_store_bytes`` is the store's byte budget
    (None: the one ``kvj.conf`` records, if any); eviction never removes a segment stored or
    claimed within ``min(grace, EVICT_MIN_AGE)`` seconds.
    """
    directory = os.path.abspath(directory)
    check_journal(directory)  # a seed-era journal: LegacyJournal
    if not os.path.isdir(directory):
        raise FormatError(f"no kvj journal directory at {directory}")
    if grace < 0:
        raise InvalidArgument("the grace period cannot be negative")
    if max_store_bytes is None:
        max_store_bytes = config_max_store_bytes(directory)
    if max_store_bytes is not None and max_store_bytes < 0:
        raise InvalidArgument("the store's byte budget cannot be negative")
    if max_store_bytes is not None and not collect:
        raise InvalidArgument("a byte budget is kept by collecting segments: it cannot go with collect=False")
    compactor = DirLock(directory, COMPACT_LOCK, "compactor")
    lock = compactor.acquire_shared() if dry_run else compactor.acquire()
    fs = READ_ONLY_FS if dry_run else fs  # a dry run that tried to write would fail, not write
    try:
        result = CompactResult(dry_run=dry_run)
        if not collect:
            compact_logs(directory, result, fs)
            return result
        with opened_store(store, default_store_path(directory), fs) as seg_store:
            state = compact_logs(directory, result, fs, seg_store.exists if seg_store is not None else None)
            if seg_store is not None:
                now = time.time() if now is None else now
                collect_segments(directory, seg_store, result, state, grace=grace, now=now,
                                 progress=progress, fs=fs, keep_cache=max_store_bytes is not None)
                if max_store_bytes is not None:
                    evict_segments(directory, seg_store, result, max_bytes=max_store_bytes, now=now,
                                   min_age=min(grace, EVICT_MIN_AGE), progress=progress, fs=fs)
                uses = seg_store.backend.uses
                if not dry_run and os.path.lexists(uses.path):
                    uses.fold(set(seg_store.keys()))  # bounded: one record per stored key
        return result
    finally:
        if lock is not None:
            lock.release()

