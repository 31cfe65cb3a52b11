"""Restore: a journal from its replica into a new or empty directory, every object verified.

Each object must have the size and BLAKE3 the manifest recorded (another size is refused
unread), the log files are read back strictly, and every segment the restored state needs
is checked in full before it is stored. What can fail without downloading fails first.

The target may be a mount point: everything is staged durably inside it (``STAGING``), then
moved into place, segments first, the log files newest first, the snapshot last, so a
journal cut short mid-move lacks its first LSNs (a gap replay reports). A restore holds an
exclusive ``flock`` on the target; a staging directory no restore holds was left by one cut
short, and the next removes it and what its move had put in place, nothing else.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

from kvj.errors import CorruptionError, FormatError, InvalidArgument, JournalLocked, UnsafePath
from kvj.fileio import REAL_FS, atomic_write, makedirs_durable, rename_durable
from kvj.journal.framing import FILE_HEADER_SIZE, decode_file_header, encode_group_header, encode_record, group_header_at
from kvj.journal.config import STORE_DIR, default_store_path
from kvj.journal.reader import FORMAT, LOG_RE, Damage, Scan
from kvj.journal.replay import replay
from kvj.journal.snapshot import SNAP_RE, decode_snapshot, snapshot_name
from kvj.journal.state import JournalState
from kvj.replica import manifest as mf
from kvj.replica.remote import Remote
from kvj.segments import segfile as seg

Progress = Callable[[str, int, int], None]

#: The staging directory inside the target; its presence means a restore runs or was cut short.
STAGING = ".kvj-restoring"
#: A segment object is its stored bytes plus a preamble, a header and a trailer.
SEGMENT_OVERHEAD = seg.PREAMBLE.size + seg.TRAILER.size + seg.MAX_HEADER


@dataclass
class RestoreResult:
    """What a restore wrote."""

    journal: str = ""
    last_lsn: int = 0
    snapshot_lsn: Optional[int] = None
    logs: int = 0
    segments: int = 0
    bytes: int = 0
    seconds: float = 0.0
    #: What a restore cut short had left in the target, removed before this one began.
    cleaned_up: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _checked(remote: Remote, obj: str, size: int, blake: str) -> bytes:
    """Object ``obj``, of the ``size`` and BLAKE3 the manifest declares."""
    data = remote.read(obj, size)
    if mf.digest(data) != blake:
        raise CorruptionError(f"{remote.url}/{obj}", None, "object differs from the digest the manifest recorded")
    return data


def trim_log(data: bytes, at_lsn: int, path: str) -> bytes:
    """The log file ``data`` (named ``path``) cut after LSN ``at_lsn``: the group holding it is
    re-framed up to it, in the file's format version and with the group's time. Anything the
    walk reports is an error, a torn tail too (a replicated file is whole)."""
    header = decode_file_header(data)
    if header is None:
        raise CorruptionError(path, 0, "bad log file header")
    out = [data[:FILE_HEADER_SIZE]]
    for group in Scan.of_bytes(data, path, after_lsn=header.base_lsn - 1, reporter=_whole).groups():
        records = group.records
        if records[-1].lsn <= at_lsn:
            out.append(data[group.offset:group.end])
            continue
        keep = [r for r in records if r.lsn <= at_lsn]
        if keep:
            time_ns = group_header_at(data, group.offset, header.salt, header.version)[3]  # type: ignore[index]
            body = b"".join(encode_record(r.rtype, r.lsn, r.payload) for r in keep)
            out.append(encode_group_header(len(body), len(keep), keep[0].lsn, header.salt, time_ns or 0,
                                           header.version) + body)
        break
    return b"".join(out)


def _whole(damage: Damage) -> None:
    """The reporter of a replicated log file: whatever the walk finds is an error."""
    if damage.kind == FORMAT:
        raise FormatError(f"{damage.path}: {damage.reason}")
    raise CorruptionError(damage.path, damage.offset, f"{damage.reason} in a replicated log")


def download_journal(remote: Remote, m: mf.Manifest, directory: str, at_lsn: Optional[int] = None,
                     threads: int = 8) -> int:
    """Write the replica's snapshot and log files (cut after ``at_lsn``) into ``directory``,
    each checked against the manifest; returns the bytes written."""
    written = 0
    if m.snapshot is not None:
        data = _checked(remote, m.snapshot.object, m.snapshot.size, m.snapshot.blake3)
        decode_snapshot(data, f"{remote.url}/{m.snapshot.object}")
        atomic_write(os.path.join(directory, snapshot_name(m.snapshot.lsn)), data)
        written += len(data)
    entries = _needed_logs(m, at_lsn)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [[pool.submit(_checked, remote, p.object, p.end - p.start, p.blake3) for p in e.parts]
                   for e in entries]
        for entry, parts in zip(entries, futures):
            data = b"".join(f.result() for f in parts)
            where = f"{remote.url}/{entry.name}"
            header = decode_file_header(data)
            if header is None or (header.base_lsn, header.salt, header.seq) != (entry.base_lsn, entry.salt, entry.seq):
                raise CorruptionError(where, 0, "log header disagrees with the manifest")
            if at_lsn is not None and entry.last_lsn > at_lsn:
                data = trim_log(data, at_lsn, where)
            atomic_write(os.path.join(directory, entry.name), data)
            written += len(data)
    return written


def _needed_logs(m: mf.Manifest, at_lsn: Optional[int]) -> List[mf.LogEntry]:
    return [e for e in m.logs if at_lsn is None or e.base_lsn <= at_lsn + 1]


def resolve_at(m: mf.Manifest, at_lsn: Optional[int], at_time: Optional[float]) -> Optional[int]:
    """The LSN to restore to: ``at_lsn``, the LSN replicated at ``at_time``, or None (the end)."""
    if at_time is not None:
        at_lsn = m.lsn_at(at_time)
    if at_lsn is None:
        return None
    if at_lsn > m.last_lsn:
        raise FormatError(f"the replica ends at LSN {m.last_lsn}; LSN {at_lsn} was never replicated")
    if m.snapshot is not None and at_lsn < m.snapshot.lsn:
        raise FormatError(f"LSN {at_lsn} precedes the replica's snapshot at LSN {m.snapshot.lsn}: history before "
                          "it was compacted away")
    return at_lsn


def load_manifest(remote: Remote) -> mf.Manifest:
    """The replica's manifest, checked for continuity; ``FileNotFoundError`` for an empty replica."""
    m, _ = mf.load(remote)
    if m is None:
        raise FileNotFoundError(2, "no replica here (no manifest.json)", remote.url)
    m.check(f"{remote.url}/{mf.MANIFEST_OBJECT}")
    return m


class SegmentSizes(NamedTuple):
    """What one listing says of the segments a state needs, before any is read."""

    sizes: Dict[str, int]  # key -> its object's size, for each present with a plausible size
    problems: List[str]  # one per segment missing, or whose object's size the journal contradicts
    missing: int


def segment_sizes(remote: Remote, state: JournalState) -> SegmentSizes:
    """The size of the replica's object of each segment ``state`` needs, checked against the
    journal's declaration (a request segment's stored size, plus at most a header)."""
    listed = {k: o.size for o in remote.list("segments/") for k in [mf.segment_key(o.path)] if k}
    declared: Dict[str, int] = {}
    for req in state.in_flight() + state.moved():
        for ref in req.segments.values():
            if ref.key:
                declared[ref.key] = max(declared.get(ref.key, 0), ref.stored_size)
    found = SegmentSizes({}, [], 0)
    for key, who in sorted(state.referenced_keys().items()):
        if key not in listed:
            found.problems.append(f"segment {key} ({who}) is missing from the replica")
            found = found._replace(missing=found.missing + 1)
            continue
        low, high = (0, mf.MAX_OBJECT_BYTES)
        if key in declared:
            low, high = declared[key] + seg.PREAMBLE.size + seg.TRAILER.size, declared[key] + SEGMENT_OVERHEAD
        if not low <= listed[key] <= high:
            found.problems.append(f"segment {key} ({who}): its object holds {listed[key]} bytes, but the journal "
                                  f"declares {declared.get(key)} stored bytes (not read)")
            continue
        found.sizes[key] = listed[key]
    return found


def fetch_segments(remote: Remote, sizes: Dict[str, int], store: Any, threads: int = 8,
                   progress: Optional[Progress] = None) -> int:
    """Download (no more than ``sizes`` says), verify in full and store the segments of
    ``sizes``; returns the bytes downloaded."""
    keys = sorted(sizes)

    def one(key: str) -> int:
        store.ingest_stored(key, remote.read(mf.segment_object(key), sizes[key]))
        return sizes[key]

    total = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for done, size in enumerate(pool.map(one, keys), 1):
            total += size
            if progress:
                progress("restoring segments", done, len(keys))
    return total


def _make_target(target: str) -> bool:
    """Create ``target`` (and its parents) durably, refusing a symbolic link or a file there;
    True when this call made it (a failure removes only a directory it made)."""
    if os.path.islink(target):
        raise UnsafePath(f"{target} is a symbolic link: restore into the directory it points to")
    if os.path.lexists(target) and not os.path.isdir(target):
        raise InvalidArgument(f"{target} exists and is not a directory: restore into a new or empty directory")
    makedirs_durable(os.path.dirname(target))
    try:
        REAL_FS.mkdir(target)
    except FileExistsError:
        return False
    REAL_FS.fsync_dir(os.path.dirname(target))
    return True


@contextmanager
def _target_lock(target: str) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on the target (a restore running there: ``JournalLocked``);
    yields False where directories cannot be locked (NFS)."""
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise JournalLocked(target, None, "restore") from None
            locked = False
        yield locked
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def _published(target: str, name: str) -> bool:
    """Whether ``name`` in ``target`` is what a restore's move puts there (the store
    directory, a log file, a snapshot; never a link)."""
    mode = os.lstat(os.path.join(target, name)).st_mode
    if name == STORE_DIR:
        return stat.S_ISDIR(mode)
    return stat.S_ISREG(mode) and bool(LOG_RE.match(name) or SNAP_RE.match(name))


def _remove_published(target: str, names: List[str]) -> None:
    """Remove what a restore moved into ``target``."""
    for name in names:
        path = os.path.join(target, name)
        if name == STORE_DIR:
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _check_empty(target: str, locked: bool) -> List[str]:
    """Refuse a target that is not empty (but for a fresh file system's empty ``lost+found``),
    after removing what a restore cut short left there, if this one holds the lock; returns
    what was removed."""
    names = os.listdir(target)
    removed: List[str] = []
    if STAGING in names:
        if not locked:
            raise InvalidArgument(f"{target} holds {STAGING}: another restore is running there, or one was cut "
                                  f"short (then empty {target} and restore again)")
        removed = _clean_up_cut_short(target, names)
        names = os.listdir(target)
    lost = os.path.join(target, "lost+found")
    if names == ["lost+found"] and os.path.ismount(target) and os.path.isdir(lost) and not os.listdir(lost):
        return removed
    if names:
        raise InvalidArgument(f"{target} is not empty: restore into a new or empty directory (nothing was changed)")
    return removed


def _clean_up_cut_short(target: str, names: List[str]) -> List[str]:
    """Remove the staging directory of a restore cut short and what its move had put in place
    (``names``: the target's); anything else there is not its own: refused, nothing removed."""
    left = sorted(n for n in names if n != "lost+found")
    foreign = [n for n in left if n != STAGING and not _published(target, n)]
    if foreign or not stat.S_ISDIR(os.lstat(os.path.join(target, STAGING)).st_mode):
        why = f"{foreign[0]}, which no restore writes" if foreign else f"{STAGING} is no directory"
        raise InvalidArgument(f"{target} holds {STAGING}, left by a restore cut short, and {why}: empty {target} "
                              "by hand and restore again (nothing was changed)")
    _remove_published(target, [n for n in left if n != STAGING])
    shutil.rmtree(os.path.join(target, STAGING))  # last: until it is gone, it marks what is left as restore's
    REAL_FS.fsync_dir(target)
    return left


def _check_space(path: str, nbytes: int, what: str) -> None:
    """Refuse (ENOSPC) before writing when ``path``'s file system has less than ``nbytes`` free."""
    from kvj.ops.inspection import human_size

    while not os.path.isdir(path):  # a store's folders are made as segments arrive
        path = os.path.dirname(path)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"{what} need {human_size(nbytes)} and {path} has {human_size(free)} free "
                                    "(nothing was restored)", path)


def _publish(staging: str, target: str, moved: List[str]) -> None:
    """Move the staged journal into ``target`` in the order the module docstring gives;
    ``moved`` lists what is in place."""
    names = os.listdir(staging)
    logs = sorted((n for n in names if n.endswith(".log")), reverse=True)
    order = [n for n in names if n not in logs and not n.endswith(".snap")] + logs + \
        sorted(n for n in names if n.endswith(".snap"))
    for name in order:
        rename_durable(os.path.join(staging, name), os.path.join(target, name))
        moved.append(name)
    os.rmdir(staging)
    REAL_FS.fsync_dir(target)


def restore(remote: Remote, journal: str, *, store: Optional[str] = None, at_lsn: Optional[int] = None,
            at_time: Optional[float] = None, threads: int = 8, progress: Optional[Progress] = None) -> RestoreResult:
    """Restore the replica at ``remote`` into ``journal``, a new or empty directory (a mount
    point is kept, with its owner and mode)."""
    from kvj.segments.store import SegmentStore

    t0 = time.perf_counter()
    target = os.path.abspath(journal)
    created = _make_target(target)
    staging = os.path.join(target, STAGING)
    moved: List[str] = []
    with _target_lock(target) as locked:
        try:
            cleaned = _check_empty(target, locked)
            REAL_FS.mkdir(staging)  # exclusive: without the lock, a second restore into the target stops here
            REAL_FS.fsync_dir(target)
        except BaseException:
            if created:
                shutil.rmtree(target, ignore_errors=True)
            raise
        try:
            m = load_manifest(remote)
            at = resolve_at(m, at_lsn, at_time)
            root = os.path.abspath(store) if store else default_store_path(staging)
            with SegmentStore(root, threads=threads) as seg_store:
                logs = _needed_logs(m, at)
                _check_space(staging, sum(e.size for e in logs) + (m.snapshot.size if m.snapshot else 0),
                             f"the {len(logs)} log files and the snapshot")
                result = RestoreResult(journal=target, snapshot_lsn=m.snapshot.lsn if m.snapshot else None,
                                       cleaned_up=cleaned)
                result.bytes = download_journal(remote, m, staging, at, threads)
                state = replay(staging, strict=True)
                want = m.last_lsn if at is None else at
                if state.last_lsn != want:
                    raise CorruptionError(remote.url, None, f"the replicated log ends at LSN {state.last_lsn}, the "
                                          f"manifest says {want}")
                segments = segment_sizes(remote, state)
                if segments.problems:
                    more = len(segments.problems) - 1
                    raise CorruptionError(remote.url, None,
                                          segments.problems[0] + (f" (and {more} more)" if more else ""))
                _check_space(root, sum(n for key, n in segments.sizes.items() if not seg_store.exists(key)),
                             f"the {len(segments.sizes)} segments")
                result.bytes += fetch_segments(remote, segments.sizes, seg_store, threads, progress)
                result.segments = len(segments.sizes)
            result.logs = len([n for n in os.listdir(staging) if n.endswith(".log")])
            result.last_lsn = state.last_lsn
            _publish(staging, target, moved)
        except BaseException:
            try:
                if created:
                    shutil.rmtree(target)
                else:  # the segments directory, log files, the snapshot: all restore's own
                    _remove_published(target, moved)
                    shutil.rmtree(staging)
            except OSError:  # what is left, the next restore into the target removes (STAGING marks it)
                pass
            raise
    result.seconds = time.perf_counter() - t0
    return result
