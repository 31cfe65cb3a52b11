"""Open-time recovery, as LevelDB's ``DB::Recover``: the journal directory's locks, and where a
writer resuming a journal goes on (``find_end``), with the repairs it makes first: a torn tail
cut (its bytes kept in ``torn/``), the two copies of a mirrored journal evened out, what was read
made durable. Mid-log corruption raises: that is fsck's (spec: man/kvj-journal.5, THE END OF THE LOG).
"""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, JournalLocked, KvjError, UnsafePath
from kvj.fileio import (FS, REAL_FS, DurabilityError, atomic_write, fsync_path, makedirs_durable, open_read,
                        open_regular)
from kvj.journal.framing import FORMAT_VERSION
from kvj.journal.mirror import DEGRADE, copies, log, mirror_of, resolve
from kvj.journal.reader import TORN, Damage, Scan, TornTail, log_seq, raise_on_damage
from kvj.journal.snapshot import list_snapshots

#: Held by the one process that appends to the journal (``Journal.open``, recovery).
LOCK_NAME = "LOCK"
#: Held by the one process that compacts the journal (``kvj compact``, recovery, fsck --repair).
COMPACT_LOCK = "COMPACT"
#: Where cut tails' bytes are kept, inside the journal.
TORN_DIR = "torn"
#: Where ``kvj recover`` writes its manifests (``manifest-<epoch>.json``).
RECOVERY_DIR = "recovery"
#: A recovery (or handoff) manifest is at most this large (a plan for every request and block in flight).
MAX_MANIFEST_BYTES = 256 << 20
#: A salvage's report while it is not yet in a durable recovery-epoch record.
PENDING_NAME = "SALVAGE.json"

#: Where a writer goes on: (log file seq, next LSN, the copy of a cut tail, the salt of the
#: file when the writer appends to it: None for a new file).
End = Tuple[int, int, Optional[str], Optional[int]]


class DirLock:
    """A flock on a file in the journal directory recording the holder's pid (a second holder gets
    ``JournalLocked`` naming it); the kernel releases a killed holder's lock."""

    def __init__(self, directory: str, name: str, what: str):
        self.path = os.path.join(directory, name)
        self.directory, self.what = directory, what
        self.fd: Optional[int] = None

    def acquire(self) -> "DirLock":
        """Take the lock exclusively, without waiting."""
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def acquire_shared(self) -> Optional["DirLock"]:
        """Hold the lock shared, for a reader that must not run beside its holder, never creating or
        writing the file (a read-only mount); None without one: no holder ever ran."""
        try:
            fd = open_regular(self.path)
        except FileNotFoundError:
            return None
        self._flock(fd, fcntl.LOCK_SH)
        self.fd = fd
        return self

    def _flock(self, fd: int, mode: int) -> None:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise JournalLocked(self.directory, self._holder_pid(), self.what) from None
            raise

    def _holder_pid(self) -> Optional[int]:
        try:
            with open_read(self.path) as f:
                return int(f.read(32).strip() or 0) or None
        except (OSError, ValueError, UnsafePath):
            return None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def cut_torn_tail(tail: TornTail, fs: FS = REAL_FS) -> str:
    """Move a torn tail's bytes aside into ``torn/``, then truncate the log file; returns the
    copy's path. The copy is durable first, so a crash in between leaves the log as it was."""
    aside = keep_torn_bytes(tail, fs)
    truncate_log(tail, fs)
    return aside


def keep_torn_bytes(tail: TornTail, fs: FS = REAL_FS) -> str:
    """Copy a torn tail's bytes into ``torn/``, durably, leaving the log as it is (the one step
    of a cut that needs free space); returns the copy's path."""
    aside_dir = os.path.join(os.path.dirname(tail.path), TORN_DIR)
    makedirs_durable(aside_dir, fs)
    with open_read(tail.path) as f:
        f.seek(tail.offset)
        data = f.read()
    name = f"{os.path.basename(tail.path)}.{tail.offset}.torn"
    aside, n = os.path.join(aside_dir, name), 1
    while os.path.lexists(aside):  # a cut at the same place before (a salvaged file continued, then cut again)
        if _holds(aside, data):  # this cut, kept by an attempt that stopped after it
            return aside
        aside, n = os.path.join(aside_dir, f"{name}.{n}"), n + 1
    atomic_write(aside, data, fs)
    return aside


def _holds(path: str, data: bytes) -> bool:
    try:
        with open_read(path) as f:
            return f.read(len(data) + 1) == data
    except (OSError, KvjError):
        return False


def truncate_log(tail: TornTail, fs: FS = REAL_FS) -> None:
    """Cut the log file at the torn tail, durably (after ``keep_torn_bytes``)."""
    fd = fs.open(tail.path, os.O_WRONLY)
    try:
        fs.ftruncate(fd, tail.offset)
        fs.fsync(fd)
    finally:
        fs.close(fd)


class MirrorDown(Exception):
    """An I/O error on the mirror's side while a writer opens a mirrored journal."""

    def __init__(self, mirror: str, error: OSError):
        super().__init__(f"mirror {mirror}: {error}")
        self.error = error


@contextmanager
def mirror_side(mirror: Optional[str]) -> Iterator[None]:
    """Mark an I/O error in the block as the mirror's (its policy decides), not the journal's."""
    try:
        yield
    except OSError as exc:
        if mirror is None:
            raise
        raise MirrorDown(mirror, exc) from exc


def open_end(path: str, fs: FS, file_size_limit: int, mirror: Optional[str], mirror_policy: str,
             locks: List[DirLock]) -> Tuple[End, Optional[str]]:
    """With the journal's writer lock held (``locks``), lock its mirror (``mirror.resolve``) and find
    where a writer goes on: (``find_end``'s answer, the mirror used). An I/O error on the mirror's
    side fails the open, or under mirror policy degrade drops the mirror."""
    try:
        with mirror_side(mirror if mirror is not None else mirror_of(path)):
            chosen = resolve(path, mirror, mirror_policy, fs)
            if chosen is not None:
                locks.append(DirLock(chosen, LOCK_NAME, "writer").acquire())
        return find_end(path, fs, file_size_limit, chosen), chosen
    except MirrorDown as down:
        if mirror_policy != DEGRADE:
            raise DurabilityError(down.error.errno or errno.EIO, str(down)) from down.error
        log.warning("journal %s: %s; writing the primary copy only (mirror policy degrade)", path, down)
        for lock in locks[1:]:
            lock.release()
        del locks[1:]
        return find_end(path, fs, file_size_limit), None


def find_end(directory: str, fs: FS, file_size_limit: int, mirror: Optional[str] = None) -> End:
    """Where a writer resuming this journal goes on: the newest log file when its tail is clean, it
    is in the current format, below the size limit and the same in every copy, else a new file."""
    if mirror is not None:
        _restore_copies(directory, mirror, fs)
    snaps = [lsn for d in (directory, mirror) if d is not None for lsn, _p in list_snapshots(d)[:1]]
    snap_lsn = max(snaps, default=0)
    listing = Scan(directory, mirror=mirror or False)
    if not listing.logs:
        return 1, snap_lsn + 1, None, None
    last = listing.logs[-1]
    paths = copies(last, mirror)
    header = listing.header_of(last)
    torn: List[Damage] = []

    def report(damage: Damage) -> None:
        if damage.kind == TORN:
            torn.append(damage)
        raise_on_damage(damage)

    scan = Scan(directory, after_lsn=header.base_lsn - 1 if header else 0, logs=[last], reporter=report,
                mirror=mirror or False)
    for _ in scan:  # raises on corruption, including a bad header on a file longer than a header
        pass
    if header is None:  # crashed while creating the file: nothing in it was ever acknowledged
        cuts = []
        for path in [p for p in paths if os.path.exists(p)]:
            with mirror_side(mirror if path != last else None):
                cuts.append(cut_torn_tail(TornTail(path, 0, os.path.getsize(path)), fs))
                fs.unlink(path)
                fs.fsync_dir(os.path.dirname(path))
        seq, lsn, _, salt = find_end(directory, fs, file_size_limit, mirror)
        return seq, lsn, cuts[0] if cuts else None, salt
    cut = {}
    for damage in torn:
        if damage.length:
            with mirror_side(mirror if damage.path != last else None):
                cut[damage.path] = cut_torn_tail(TornTail(damage.path, damage.offset or 0, damage.length), fs)
    aside = cut.get(last, next(iter(cut.values()), None))
    if mirror is not None and not _same(paths):
        _even_out(paths, scan.end_offset, header.base_lsn, mirror, fs)
    for path in paths:
        if path not in cut and os.path.exists(path):
            # What was read may sit unsynced in the page cache (a writer killed before its
            # fdatasync, or before syncing the directory): the new writer builds on it, so make it
            # durable before any later record is acknowledged (a cut file was fsynced already).
            with mirror_side(mirror if path != last else None):
                fsync_path(path, fs)
                fs.fsync_dir(os.path.dirname(path))
    next_lsn = header.base_lsn if scan.next_lsn is None else scan.next_lsn
    if (aside is None and header.version == FORMAT_VERSION and scan.end_offset < file_size_limit
            and next_lsn > snap_lsn and _same(paths)):
        return log_seq(last), next_lsn, None, header.salt
    return log_seq(last) + 1, max(next_lsn, snap_lsn + 1), aside, None


def _restore_copies(directory: str, mirror: str, fs: FS) -> None:
    """Give each copy what only the other holds: the newest snapshot, and every log file the
    log still needs (a copy lost with a replaced disk, or by a crash while creating it)."""
    newest = max((snaps[0] for d in (directory, mirror) for snaps in [list_snapshots(d)] if snaps), default=None)
    names = [] if newest is None else [os.path.basename(newest[1])]
    names += [os.path.basename(p) for p in Scan(directory, after_lsn=newest[0] if newest else 0,
                                                mirror=mirror).live_logs()]
    for name in names:
        both = copies(os.path.join(directory, name), mirror)
        have = [p for p in both if os.path.exists(p)]
        for target in both:
            if have and target not in have:
                with open_read(have[0]) as f:
                    data = f.read()
                with mirror_side(mirror if target.startswith(mirror + os.sep) else None):
                    atomic_write(target, data, fs)


def _even_out(paths: List[str], end: int, base_lsn: int, mirror: str, fs: FS) -> None:
    """Give every copy of the newest log file the bytes of one that holds all of it (up to ``end``)
    intact (else, once sealed, the shorter copy would hold a damaged group); copies each damaged
    somewhere are left as they are (the log goes on in a new file)."""
    for path in paths:
        if not os.path.exists(path):
            continue
        alone = Scan(os.path.dirname(path), after_lsn=base_lsn - 1, logs=[path], mirror=False)
        try:
            for _ in alone:
                pass
        except (CorruptionError, FormatError):
            continue
        if alone.end_offset != end or alone.tail is not None:
            continue
        with open_read(path) as f:
            data = f.read(end)
        for other in paths:
            if other != path:
                with mirror_side(mirror if other != paths[0] else None):
                    atomic_write(other, data, fs)
        return


def _same(paths: List[str]) -> bool:
    """Whether every copy of a log file exists and holds the same bytes."""
    contents = []
    for path in paths:
        try:
            with open_read(path) as f:
                contents.append(f.read())
        except FileNotFoundError:
            return False
    return all(c == contents[0] for c in contents)
