"""A store's temp files: written under an flock, synced and renamed into place, or cleaned once abandoned.

A writer holds an flock on its temp file until it renames or removes it, and the kernel drops the
lock when the writer dies, so "not locked" means "abandoned" in any PID namespace.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from typing import Optional

from kvj.fileio import FS, Buffer, DurabilityError, discard_temp, makedirs_durable


def same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def clean_temps(tmp_dir: str, fs: FS) -> int:
    """Remove the temp files in ``tmp_dir`` that no writer holds (a torn pack among them); how many."""
    removed = 0
    try:
        names = os.listdir(tmp_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        if not name.endswith(".tmp"):
            continue
        path = os.path.join(tmp_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live writer holds it
            continue
        try:
            if same_file(path, fd):
                fs.unlink(path)
                removed += 1
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed


class TempFile:
    """A new ``tmp_dir/<pid>.<random>.tmp``, open and flocked: ``write``, then ``sync`` and ``publish``
    under its final name, or ``abort``. ``sync_every``: fdatasync as it goes, overlapping compression."""

    def __init__(self, tmp_dir: str, fs: FS, what: str, sync_every: int = 0):
        self.fs, self.what, self.sync_every = fs, what, sync_every
        self.size = self.unsynced = 0
        while True:
            path = os.path.join(tmp_dir, f"{os.getpid()}.{secrets.token_hex(6)}.tmp")
            fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            # A cleaner that locked and unlinked the file before this lock was taken has taken
            # the name away: start over with a new one.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if same_file(path, fd):
                break
            fs.close(fd)
        self.path = path
        self.fd: Optional[int] = fd

    def _failed(self, exc: OSError, doing: str) -> DurabilityError:
        self.abort()
        return DurabilityError(exc.errno or 0, f"{doing} {self.what} temp file {self.path}: {exc.strerror or exc}")

    def write(self, part: Buffer) -> None:
        assert self.fd is not None
        try:
            self.fs.write(self.fd, part)
            self.size += len(part)
            self.unsynced += len(part)
            if self.sync_every and self.unsynced >= self.sync_every:
                self.fs.fdatasync(self.fd)
                self.unsynced = 0
        except OSError as exc:
            raise self._failed(exc, "writing") from exc

    def sync(self, data_only: bool) -> None:
        """fdatasync (``data_only``) or fsync the file; never retried: a failure drops it."""
        assert self.fd is not None
        try:
            (self.fs.fdatasync if data_only else self.fs.fsync)(self.fd)
        except OSError as exc:
            raise self._failed(exc, "fsyncing") from exc

    def publish(self, final: str) -> None:
        """Rename the (synced) file to ``final`` and fsync its directory, then let go of it."""
        directory = os.path.dirname(final)
        try:
            makedirs_durable(directory, self.fs)
            self.fs.rename(self.path, final)  # still locked: no cleaner takes it from under us
            self.fs.fsync_dir(directory)
        finally:
            fd, self.fd = self.fd, None
            if fd is not None:
                self.fs.close(fd)

    def abort(self) -> None:
        """Drop the file (best effort, never raises)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            discard_temp(self.fs, fd, self.path)
