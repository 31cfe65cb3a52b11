"""The replicator: ships a journal's durable bytes to its replica, round by round.

A round reads what is new in the log files (whole commit groups only, every CRC checked),
fsyncs those files (so nothing is shipped that the node itself could still lose), uploads
new segments (create-only, per key, CRCs checked first), the newest snapshot and the new
log bytes as create-only *parts* named with the lease generation, then commits the
manifest by compare-and-swap. Data goes before the manifest that points at it. Log files
and snapshots that the newest snapshot covers, and segments that the node collected and
no log or snapshot in the manifest references, leave the manifest and become garbage,
deleted once they have been garbage for the grace period.

The replicator only reads the journal's files: the writer never waits on it or on the
network. ``follow`` runs rounds every ``interval`` seconds; what a lost node can lose is
what was written since the last completed round.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from kvj.errors import CorruptionError, FormatError, KvjError, SegmentMissing
from kvj.fileio import fsync_path, open_read
from kvj.journal.framing import FILE_HEADER_SIZE
from kvj.journal.config import default_store_path
from kvj.journal.reader import TORN, Damage, Scan, list_logs, log_seq, raise_on_damage, read_header
from kvj.journal.records import RecordType, decode_payload
from kvj.journal.snapshot import decode_snapshot, list_snapshots
from kvj.replica import manifest as mf
from kvj.replica.lease import DEFAULT_TTL, Lease
from kvj.replica.remote import LostRace, UnexpectedSize, Remote, RemoteUnavailable, md5_etag

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


@dataclass
class _LocalLog:
    """What the replicator knows of one local log file: its header and its parsed prefix."""

    seq: int
    base_lsn: int
    salt: int
    valid_end: int
    last_lsn: int
    keys: Set[str] = field(default_factory=set)
    checked: bool = False  # its shipped prefix was compared with the replica's


def record_keys(rtype: int, payload: bytes) -> List[str]:
    """Segment keys a record points at."""
    if rtype == RecordType.SEGMENT:
        return [decode_payload(rtype, payload)["key"]]
    if rtype in (RecordType.CHECKPOINT, RecordType.DELTA):
        return [k for k in decode_payload(rtype, payload)["keys"].values() if isinstance(k, str)]
    return []


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
        self._logs: Dict[int, _LocalLog] = {}
        self._remote_keys: Set[str] = set()
        self._snap_keys: Optional[Set[str]] = None
        self._store: Any = None

    # -- lifecycle ----------------------------------------------------------------------

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

    # -- one round ----------------------------------------------------------------------

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
            paths = list_logs(self.journal)
            local = self._scan_logs(paths)
            snap, pending = self._prepare_snapshot(snaps, m, result)
            local_keys = self._ship_segments(result)
            if pending is not None:  # after the segments its state points at
                self._put_checked(*pending)
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

    # -- logs ---------------------------------------------------------------------------

    def _scan_logs(self, paths: List[str]) -> List[_LocalLog]:
        """Walk what is new in each log file (whole groups, with ``reader.Scan``), then fsync
        the files read."""
        found: List[_LocalLog] = []
        for index, path in enumerate(paths):
            sealed = index < len(paths) - 1
            seq = log_seq(path)
            info = self._logs.get(seq)
            if info is None:
                header = read_header(path)
                if header is None:
                    if not sealed and os.path.getsize(path) <= FILE_HEADER_SIZE:
                        break  # the writer is creating it: nothing in it was acknowledged
                    raise CorruptionError(path, 0, "bad log file header")
                info = _LocalLog(seq, header.base_lsn, header.salt, FILE_HEADER_SIZE, header.base_lsn - 1)
                self._logs[seq] = info
            if self._walk(path, info, sealed):
                fsync_path(path)  # what we ship must be durable here too: the node can never lose it
            found.append(info)
        live = {i.seq for i in found}
        for seq in [s for s in self._logs if s not in live]:
            del self._logs[seq]
        return found

    def _walk(self, path: str, info: _LocalLog, sealed: bool) -> int:
        """Read the whole groups after ``info.valid_end`` (the journal's own copy: its bytes are
        what is uploaded), note their segment keys; returns the bytes consumed. Damage raises
        ``CorruptionError``; an incomplete group at the end of the newest file is one still
        being written (or a torn tail the writer will cut) and waits for the next round."""
        def report(damage: Damage) -> None:
            if damage.kind == TORN and sealed:
                raise CorruptionError(path, damage.offset, "damaged commit group in a sealed log file")
            raise_on_damage(damage)

        scan = Scan(self.journal, logs=[path], after_lsn=info.last_lsn, start=(path, info.valid_end),
                    reporter=report, mirror=False)
        for rec in scan:
            try:
                info.keys.update(record_keys(rec.rtype, rec.payload))
            except FormatError as exc:
                raise CorruptionError(path, rec.offset, f"LSN {rec.lsn}: {exc}") from None
            info.last_lsn = rec.lsn
        if scan.end_offset < info.valid_end:  # the walk found no file: a compaction removed it
            raise FileNotFoundError(errno.ENOENT, "log file vanished during the round", path)
        consumed = scan.end_offset - info.valid_end
        info.valid_end = scan.end_offset
        return consumed

    def _ship_logs(self, local: List[_LocalLog], m: mf.Manifest, result: RoundResult, now: float) -> None:
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
            entry.last_lsn = self._logs[entry.seq].last_lsn
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

    def _check_same(self, info: _LocalLog, entry: mf.LogEntry) -> None:
        """The replica's copy of a log must be a prefix of ours (same header, same bytes)."""
        name = f"{self.remote.url} log {entry.name}"
        if (info.base_lsn, info.salt) != (entry.base_lsn, entry.salt):
            raise Diverged(f"{name} belongs to another journal than {self.journal} (different header)")
        if info.valid_end < entry.size:
            raise Diverged(f"{name} holds {entry.size} bytes but the local file has only {info.valid_end} valid "
                           "bytes: the replica is ahead of this journal")
        if not info.checked and entry.parts:
            last = entry.parts[-1]
            with open_read(os.path.join(self.journal, entry.name)) as f:
                f.seek(last.start)
                if mf.digest(f.read(last.end - last.start)) != last.blake3:
                    raise Diverged(f"{name}: bytes {last.start}-{last.end} differ from the local file")
            info.checked = True

    def _upload_part(self, seq: int, start: int, end: int) -> mf.Part:
        with open_read(os.path.join(self.journal, f"{seq:016d}.log")) as f:
            f.seek(start)
            data = f.read(end - start)
        if len(data) != end - start:
            raise CorruptionError(f.name, start, "log file shrank while it was being replicated")
        obj = mf.part_object(seq, start, end, self.lease.generation)
        self._put_checked(obj, data)
        return mf.Part(obj, start, end, mf.digest(data))

    # -- snapshots and segments ---------------------------------------------------------

    def _prepare_snapshot(self, snaps: List[Tuple[int, str]], m: mf.Manifest,
                          result: RoundResult) -> Tuple[Optional[Set[str]], Optional[Tuple[str, bytes]]]:
        """Enter the newest local snapshot in ``m`` if the replica's is older: (the keys the
        replica's snapshot needs, None if unknown; the (object, bytes) still to upload)."""
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
        self._put_checked(mf.segment_object(key), data)
        return len(data)

    def _put_checked(self, obj: str, data: Any) -> None:
        """Create-only upload; an existing object must hold the same bytes (else corruption)."""
        etag = self.remote.put_create(obj, data)
        if etag is None:
            try:
                same = self.remote.read(obj, len(data)) == bytes(data)
            except UnexpectedSize:
                same = False
            if not same:
                raise CorruptionError(f"{self.remote.url}/{obj}", None, "the replica holds different bytes under "
                                      "this name")
            return
        if self.verify and _plain_md5(etag) and etag != md5_etag(data):
            raise CorruptionError(f"{self.remote.url}/{obj}", None, f"the object store stored other bytes than "
                                  f"were sent (ETag {etag})")

    def _collect_segments(self, m: mf.Manifest, local: Set[str], now: float, snap_keys: Optional[Set[str]]) -> None:
        """Segments gone locally that no log or snapshot in the manifest references become garbage."""
        if snap_keys is None and m.snapshot is not None:
            return  # what the replica's snapshot needs is unknown here: collect nothing
        needed = set(snap_keys or ())
        for entry in m.logs:
            needed |= self._logs[entry.seq].keys
        for key in self._remote_keys:
            obj = mf.segment_object(key)
            if key in local or key in needed:
                m.garbage.pop(obj, None)
            else:
                m.garbage.setdefault(obj, now)

    # -- follow -------------------------------------------------------------------------

    def follow(self, interval: float, stop: threading.Event,
               on_round: Optional[Callable[[RoundResult], None]] = None,
               on_error: Optional[Callable[[BaseException], None]] = None) -> None:
        """Run rounds every ``interval`` seconds until ``stop`` is set.

        An unreachable endpoint or a concurrent compaction fails only that round (reported
        to ``on_error``); rounds retry with a backoff doubling up to 30 s. Losing the lease,
        corruption and divergence end the loop (raised).
        """
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


def _plain_md5(etag: str) -> bool:
    inner = etag.strip('"')
    return len(inner) == 32 and all(c in "0123456789abcdef" for c in inner)


def replicate_once(replicator: Replicator, attempts: int = 5) -> RoundResult:
    """One round, retried when a concurrent compaction moved files under it."""
    for attempt in range(attempts):
        try:
            return replicator.round()
        except JournalChanged:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
