"""Open-time recovery: where a writer resuming a journal goes on, and the repairs it makes
first (spec: man/kvj-journal.5, THE END OF THE LOG and MIRROR).

``find_end`` walks the newest log file: a torn tail left by a crash is cut (its bytes kept in
``torn/`` first: ``cut_torn_tail``), the two copies of a mirrored journal are evened out (a
file only one copy has is given to the other, a newest file the copies hold differently is
made the same), what was read is made durable, and the writer continues that file or starts
the next. Mid-log corruption raises, as the reader reports it: that is fsck's. An I/O error on
the mirror's side is ``MirrorDown``, for the mirror policy to decide (``Journal.open``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.fileio import FS, REAL_FS, atomic_write, fsync_path, makedirs_durable, open_read
from kvj.journal.framing import FORMAT_VERSION
from kvj.journal.mirror import copies
from kvj.journal.reader import TORN, Damage, Scan, TornTail, log_seq, raise_on_damage
from kvj.journal.snapshot import list_snapshots

#: Where cut tails' bytes are kept, inside the journal.
TORN_DIR = "torn"


def cut_torn_tail(tail: TornTail, fs: FS = REAL_FS) -> str:
    """Move a torn tail's bytes aside into ``torn/`` (durably), then truncate the log file.

    Returns the path of the copy. The copy is durable before the truncation, so the
    cut never loses bytes, and a crash in between leaves the log as it was.
    """
    aside = keep_torn_bytes(tail, fs)
    truncate_log(tail, fs)
    return aside


def keep_torn_bytes(tail: TornTail, fs: FS = REAL_FS) -> str:
    """Copy a torn tail's bytes into ``torn/``, durably, leaving the log as it is; returns the
    copy's path. The one step of a cut that needs free space."""
    journal_dir = os.path.dirname(tail.path)
    aside_dir = os.path.join(journal_dir, TORN_DIR)
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


def _restore_copies(directory: str, mirror: str, fs: FS) -> None:
    """Give each copy what only the other holds: the newest snapshot, and every log file the
    log still needs (a copy lost with a replaced disk, or by a crash while creating it)."""
    newest = max((snaps[0] for d in (directory, mirror) for snaps in [list_snapshots(d)] if snaps), default=None)
    names = [] if newest is None else [os.path.basename(newest[1])]
    names += [os.path.basename(p) for p in Scan(directory, after_lsn=newest[0] if newest else 0,
                                                mirror=mirror).live_logs()]
    for name in names:
        have = [p for p in copies(directory, mirror, name) if os.path.exists(p)]
        for target in copies(directory, mirror, name):
            if have and target not in have:
                with open_read(have[0]) as f:
                    data = f.read()
                with mirror_side(mirror if target.startswith(mirror + os.sep) else None):
                    atomic_write(target, data, fs)


def find_end(directory: str, fs: FS, file_size_limit: int,
              mirror: Optional[str] = None) -> Tuple[int, int, Optional[str], Optional[int]]:
    """Where a writer resuming this journal goes on: (file seq, next LSN, copy of any cut
    tail, and the salt of that file when the writer appends to it, None for a new file).

    The newest log file is continued when its tail is clean, it is in the current format
    and below the size limit, and, with a ``mirror``, its two copies are the same; otherwise
    (a torn tail was cut, a 0.1.0 file, a full one, copies that differ) a new file follows
    it. With a mirror, torn tails are cut in each copy, and a copy that lacks a file the log
    needs gets it from the other first.
    """
    if mirror is not None:
        _restore_copies(directory, mirror, fs)
    snaps = [lsn for d in (directory, mirror) if d is not None for lsn, _p in list_snapshots(d)[:1]]
    snap_lsn = max(snaps, default=0)
    listing = Scan(directory, mirror=mirror or False)
    if not listing.logs:
        return 1, snap_lsn + 1, None, None
    last = listing.logs[-1]
    paths = copies(directory, mirror, os.path.basename(last))
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
            # What was just read may sit unsynced in the page cache (a writer killed between a
            # group's write and its fdatasync, or between creating the file and syncing its
            # directory). The new writer builds on it, so make it and its directory entry
            # durable before any later record is acknowledged (a file cut above was fsynced, and
            # the new file that follows it syncs the directory).
            with mirror_side(mirror if path != last else None):
                fsync_path(path, fs)
                fs.fsync_dir(os.path.dirname(path))
    next_lsn = header.base_lsn if scan.next_lsn is None else scan.next_lsn
    if (aside is None and header.version == FORMAT_VERSION and scan.end_offset < file_size_limit
            and next_lsn > snap_lsn and _same(paths)):
        return log_seq(last), next_lsn, None, header.salt
    return log_seq(last) + 1, max(next_lsn, snap_lsn + 1), aside, None


def _even_out(paths: List[str], end: int, base_lsn: int, mirror: str, fs: FS) -> None:
    """Give every copy of the newest log file the bytes of one that holds all of it (up to
    ``end``) intact on its own. The copies differ after a crash between the two copies'
    writes or syncs; left so, the shorter copy would hold a damaged group in a sealed file
    once the log goes on, and could not stand in alone for the other. Copies that are
    each damaged somewhere are left as they are (the log goes on in a new file)."""
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
