"""The replicator: ships a journal's durable bytes to its replica, round by round.

A round reads the log files' new whole commit groups (every CRC checked) and fsyncs them,
uploads new segments, the newest snapshot and the new log bytes as create-only objects
named with the lease generation, then commits the manifest by compare-and-swap: data before
the manifest pointing at it. What the newest snapshot covers, and segments collected on the
node that nothing in the manifest references, become garbage, deleted after the grace
period. The replicator only reads the journal's files: the writer never waits on it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from kvj.errors import FormatError, KvjError, SegmentMissing
from kvj.fileio import open_read
from kvj.journal.config import default_store_path
from kvj.journal.snapshot import decode_snapshot, list_snapshots
from kvj.replica import manifest as mf
from kvj.replica.lease import DEFAULT_TTL, Lease
from kvj.replica.remote import LostRace, Remote, RemoteUnavailable
from kvj.replica.tail import JournalTail, LocalLog

DEFAULT_INTERVAL = 1.0
DEFAULT_GRACE = 3600.0
MAX_BACKOFF = 30.0


class Diverged(KvjError):
    """The replica holds history this journal does not have (another journal, or an older copy)."""


class JournalChanged(KvjError):
    """A file vanished mid-round (a concurrent compaction); the next round sees it consistently."""


@dataclass
class RoundResult:
    """What one round shipped."""

    last_lsn: int = 0
    committed: bool = False
    segments_uploaded: int = 0
    segment_bytes: int = 0
    parts_uploaded: int = 0
    log_bytes: int = 0
    snapshot_lsn: Optional[int] = None
    objects_deleted: int = 0
    generation: int = 0
    seconds: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class Replicator:
    """Replicates the journal at ``journal`` to ``remote``. Use as a context manager."""

    def __init__(self, journal: str, remote: Remote, *, store: Optional[str] = None, lease_ttl: float = DEFAULT_TTL,
                 grace: float = DEFAULT_GRACE, threads: int = 8, verify: bool = True, owner: Optional[str] = None,
                 clock: Callable[[], float] = time.time, break_lease: Optional[str] = None):
        self.journal = os.path.abspath(journal)
        self.remote = remote
        self.store_root = store or default_store_path(self.journal)
        self.grace = grace
        self.verify = verify
        self.clock = clock
        self.lease = Lease(remote, owner, lease_ttl, clock)
        self.break_lease = break_lease  # the holder whose live lease open() may take (see Lease.acquire)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvj-replica")
        self.manifest = mf.Manifest()
        self._etag: Optional[str] = None
        self._unacked: Optional[bytes] = None  # a manifest sent whose answer was lost
        self._tail = JournalTail(self.journal)
        self._remote_keys: Set[str] = set()
        self._snap_keys: Optional[Set[str]] = None
        self._store: Any = None

    def open(self) -> "Replicator":
        """Take the lease, fence older holders (manifest carries our generation), list the replica."""
        if not os.path.isdir(self.journal):
            raise FormatError(f"no journal at {self.journal}")
        current, _ = mf.load(self.remote)
        self.lease.acquire(floor=current.generation if current else 0, breaking=self.break_lease)
        try:
            self._fence()
            self._remote_keys = {k for k in (mf.segment_key(o.path) for o in self.remote.list("segments/")) if k}
            self._sweep()
        except BaseException:
            self.close()
            raise
        return self

    def _fence(self) -> None:
        """Commit the manifest under our generation: any older holder's next commit now fails."""
        for _ in range(5):
            current, etag = mf.load(self.remote)
            manifest = current or mf.Manifest()
            if manifest.generation > self.lease.generation:
                raise self.lease.fenced()
            manifest.generation = self.lease.generation
            manifest.updated = self.clock()
            try:
                self._etag = mf.commit(self.remote, manifest, etag)
            except LostRace:
                continue
            self.manifest = manifest
            return
        raise KvjError(f"{self.remote.url}: the manifest keeps changing under a fresh lease")

    def _sweep(self) -> None:
        """Log parts and snapshots the manifest does not name (a crashed or fenced round's
        uploads) become garbage once older than the grace period."""
        now = self.clock()
        needed = self.manifest.objects()
        changed = False
        for prefix in ("logs/", "snapshots/"):
            for obj in self.remote.list(prefix):
                if obj.path not in needed and obj.path not in self.manifest.garbage and \
                        now - obj.mtime >= self.grace and mf.is_object_name(obj.path):  # others are not kvj's
                    self.manifest.garbage[obj.path] = now
                    changed = True
        if changed:
            self._commit(self.manifest)

    def close(self) -> None:
        """Release the lease (best effort) and stop the upload threads."""
        try:
            self.lease.release()
        except RemoteUnavailable:
            pass  # it expires on its own
        finally:
            self.pool.shutdown(wait=True)
            if self._store is not None:
                self._store.close()
                self._store = None

    def __enter__(self) -> "Replicator":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def round(self) -> RoundResult:
        """Ship everything durable now; returns what was shipped. See the module docstring."""
        t0 = time.perf_counter()
        result = RoundResult(generation=self.lease.generation)
        now = self.clock()
        self.lease.ensure()
        old = self.manifest
        m = mf.Manifest.from_json(old.to_json(), "manifest")
        try:
            snaps = list_snapshots(self.journal)
            local = self._tail.scan()
            snap, pending = self._prepare_snapshot(snaps, m, result)
            local_keys = self._ship_segments(result)
            if pending is not None:  # after the segments its state points at
                self.remote.put_once(*pending, self.verify)
            self._ship_logs(local, m, result, now)
        except FileNotFoundError as exc:
            raise JournalChanged(f"{exc.filename or exc}: vanished during the round (compaction); retrying") from None
        if m.last_lsn < old.last_lsn:
            raise Diverged(f"the journal {self.journal} ends at LSN {m.last_lsn} but the replica {self.remote.url} "
                           f"already holds LSN {old.last_lsn}: refusing to replicate a shorter history (restore "
                           "from the replica, or replicate to a new prefix)")
        self._collect_segments(m, local_keys, now, snap)
        expired = [obj for obj, since in m.garbage.items() if now - since >= self.grace]
        for obj in expired:
            del m.garbage[obj]
        if m.last_lsn > old.last_lsn:
            m.history = (m.history + [[now, m.last_lsn]])[-mf.HISTORY_LIMIT:]
        changed = m.to_json() != old.to_json()
        if changed:
            m.updated = now
            m.generation = self.lease.generation
            m.check(f"{self.remote.url}/{mf.MANIFEST_OBJECT} (about to be written)")
            self._commit(m)
            result.committed = True
        for obj in expired:
            self.remote.delete(obj)
            key = mf.segment_key(obj)
            if key:
                self._remote_keys.discard(key)
            result.objects_deleted += 1
        result.last_lsn = self.manifest.last_lsn
        result.seconds = time.perf_counter() - t0
        return result

    def _commit(self, m: mf.Manifest) -> None:
        mf.Manifest.from_json(m.to_json(), "the manifest about to be written")  # never one kvj would refuse
        self.lease.ensure()
        try:
            self._etag = mf.commit(self.remote, m, self._etag, self._unacked)
        except RemoteUnavailable:
            self._unacked = m.to_json()  # it may have landed: the next commit recognises it
            raise
        except LostRace:
            current, _ = mf.load(self.remote)
            if current is not None and current.generation > self.lease.generation:
                raise self.lease.fenced() from None
            raise KvjError(f"{self.remote.url}: the manifest was changed by something other than this "
                           "replicator; stopping") from None
        self._unacked = None
        self.manifest = m

    def _ship_logs(self, local: List[LocalLog], m: mf.Manifest, result: RoundResult, now: float) -> None:
        """Upload new log bytes as parts; the manifest keeps the logs the snapshot does not cover."""
        floor = m.snapshot.lsn if m.snapshot else 0
        start = 0
        for i, info in enumerate(local):
            if info.base_lsn <= floor + 1:
                start = i
        needed = local[start:]
        entries = {e.seq: e for e in m.logs}
        uploads: List[Tuple[mf.LogEntry, int, int]] = []
        kept: List[mf.LogEntry] = []
        for i, info in enumerate(needed):
            entry = entries.pop(info.seq, None)
            if entry is None:
                entry = mf.LogEntry(info.seq, info.base_lsn, info.salt, 0, info.base_lsn - 1, False)
            else:
                self._check_same(info, entry)
            entry.sealed = i < len(needed) - 1
            if info.valid_end > entry.size:
                uploads.append((entry, entry.size, info.valid_end))
            kept.append(entry)
        for entry in entries.values():  # covered by the snapshot (or gone): no longer needed
            for part in entry.parts:
                m.garbage.setdefault(part.object, now)
        futures = [(entry, start_, end, self.pool.submit(self._upload_part, entry.seq, start_, end))
                   for entry, start_, end in uploads]
        for entry, start_, end, fut in futures:
            entry.parts.append(fut.result())
            entry.size = end
            entry.last_lsn = self._tail.logs[entry.seq].last_lsn
            result.parts_uploaded += 1
            result.log_bytes += end - start_
        for entry in kept:  # a sealed log's parts become one object: restore reads one, not thousands
            if entry.sealed and len(entry.parts) > 1:
                whole = self._upload_part(entry.seq, 0, entry.size)
                for part in entry.parts:
                    m.garbage.setdefault(part.object, now)
                entry.parts = [whole]
                result.parts_uploaded += 1
                result.log_bytes += entry.size
        m.logs = kept
        m.last_lsn = kept[-1].last_lsn if kept else floor

    def _check_same(self, info: LocalLog, entry: mf.LogEntry) -> None:
        """The replica's copy of a log must be a prefix of ours (same header, same bytes)."""
        name = f"{self.remote.url} log {entry.name}"
        if (info.base_lsn, info.salt) != (entry.base_lsn, entry.salt):
            raise Diverged(f"{name} belongs to another journal than {self.journal} (different header)")
        if info.valid_end < entry.size:
            raise Diverged(f"{name} holds {entry.size} bytes but the local file has only {info.valid_end} valid "
                           "bytes: the replica is ahead of this journal")
        if not info.checked and entry.parts:
            last = entry.parts[-1]
            if mf.digest(self._tail.read(entry.seq, last.start, last.end)) != last.blake3:
                raise Diverged(f"{name}: bytes {last.start}-{last.end} differ from the local file")
            info.checked = True

    def _upload_part(self, seq: int, start: int, end: int) -> mf.Part:
        data = self._tail.read(seq, start, end)
        obj = mf.part_object(seq, start, end, self.lease.generation)
        self.remote.put_once(obj, data, self.verify)
        return mf.Part(obj, start, end, mf.digest(data))

    def _prepare_snapshot(self, snaps: List[Tuple[int, str]], m: mf.Manifest,
                          result: RoundResult) -> Tuple[Optional[Set[str]], Optional[Tuple[str, bytes]]]:
        """Enter the newest local snapshot in ``m`` if the replica's is older: (the keys the
        replica's snapshot needs, None if unknown; the (object, bytes) to upload)."""
        if not snaps:
            return (set() if m.snapshot is None else None), None
        lsn, path = snaps[0]
        if m.snapshot is not None and lsn < m.snapshot.lsn:
            raise Diverged(f"the replica {self.remote.url} has a snapshot at LSN {m.snapshot.lsn}, newer than "
                           f"the journal's newest ({lsn})")
        if m.snapshot is not None and lsn == m.snapshot.lsn and self._snap_keys is not None:
            return self._snap_keys, None
        with open_read(path) as f:
            data = f.read()
        keys = set(decode_snapshot(data, path).referenced_keys())  # CRC and body checked
        pending = None
        if m.snapshot is None or lsn > m.snapshot.lsn:
            obj = mf.snapshot_object(lsn, self.lease.generation)
            pending = (obj, data)
            if m.snapshot is not None:
                m.garbage.setdefault(m.snapshot.object, self.clock())
            m.snapshot = mf.SnapshotEntry(lsn, obj, len(data), mf.digest(data))
            result.snapshot_lsn = lsn
        self._snap_keys = keys
        return keys, pending

    def _segment_store(self) -> Any:
        if self._store is None and os.path.isdir(self.store_root):
            from kvj.segments.store import SegmentStore
            self._store = SegmentStore(self.store_root)
        return self._store

    def _ship_segments(self, result: RoundResult) -> Set[str]:
        """Upload every local segment the replica lacks (before any record pointing at it)."""
        store = self._segment_store()
        local = set(store.keys()) if store is not None else set()
        missing = sorted(local - self._remote_keys)
        futures = [(key, self.pool.submit(self._upload_segment, store, key)) for key in missing]
        for key, fut in futures:
            size = fut.result()
            if size is not None:
                self._remote_keys.add(key)
                result.segments_uploaded += 1
                result.segment_bytes += size
        return local

    def _upload_segment(self, store: Any, key: str) -> Optional[int]:
        from kvj.segments.segfile import check_stored

        try:
            data = store.read_stored(key)
        except SegmentMissing:
            return None  # collected locally since the listing
        if self.verify:
            check_stored(data, store.backend.describe(key))  # never ship a damaged copy as good
        self.remote.put_once(mf.segment_object(key), data, self.verify)
        return len(data)

    def _collect_segments(self, m: mf.Manifest, local: Set[str], now: float, snap_keys: Optional[Set[str]]) -> None:
        """Segments gone locally that no log or snapshot in the manifest references become garbage."""
        if snap_keys is None and m.snapshot is not None:
            return  # what the replica's snapshot needs is unknown here: collect nothing
        needed = set(snap_keys or ())
        for entry in m.logs:
            needed |= self._tail.logs[entry.seq].keys
        for key in self._remote_keys:
            obj = mf.segment_object(key)
            if key in local or key in needed:
                m.garbage.pop(obj, None)
            else:
                m.garbage.setdefault(obj, now)

    def follow(self, interval: float, stop: threading.Event,
               on_round: Optional[Callable[[RoundResult], None]] = None,
               on_error: Optional[Callable[[BaseException], None]] = None) -> None:
        """Run rounds every ``interval`` seconds until ``stop`` is set. An unreachable endpoint
        or a concurrent compaction fails only that round (``on_error``; the wait doubles up to
        ``MAX_BACKOFF``); losing the lease, corruption and divergence raise."""
        wait = interval
        while not stop.is_set():
            started = time.monotonic()
            try:
                result = self.round()
            except (RemoteUnavailable, JournalChanged) as exc:
                if on_error:
                    on_error(exc)
                wait = min(max(wait * 2, interval), MAX_BACKOFF)
            else:
                wait = interval
                if on_round:
                    on_round(result)
            stop.wait(max(0.0, wait - (time.monotonic() - started)))


def replicate_once(replicator: Replicator, attempts: int = 5) -> RoundResult:
    """One round, retried when a concurrent compaction moved files under it."""
    for _ in range(attempts - 1):
        try:
            return replicator.round()
        except JournalChanged:
            pass
    return replicator.round()
