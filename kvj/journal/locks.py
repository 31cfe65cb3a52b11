"""The journal directory's locks: who may write the log, who may compact it.

Each is an exclusive ``flock`` on a file in the journal directory that also records the
holder's pid, so a second writer or compactor is refused with ``JournalLocked`` naming it.
A killed holder's lock is released by the kernel with its descriptor.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Optional

from kvj.errors import JournalLocked, UnsafePath
from kvj.fileio import open_read, open_regular

#: Held by the one process that appends to the journal (``Journal.open``, recovery).
LOCK_NAME = "LOCK"
#: Held by the one process that compacts the journal (``kvj compact``, recovery, fsck --repair).
COMPACT_LOCK = "COMPACT"


class DirLock:
    """An exclusive flock on a file in the journal directory, recording the holder's pid."""

    def __init__(self, directory: str, name: str, what: str):
        self.path = os.path.join(directory, name)
        self.directory, self.what = directory, what
        self.fd: Optional[int] = None

    def acquire(self) -> "DirLock":
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def acquire_shared(self) -> Optional["DirLock"]:
        """Hold the lock shared, for a reader that must not run beside its holder but writes
        nothing: the existing lock file is opened read-only, never created or written (this
        works on a read-only mount). None when there is no lock file: no holder ever ran."""
        try:
            fd = open_regular(self.path)
        except FileNotFoundError:
            return None
        self._flock(fd, fcntl.LOCK_SH)
        self.fd = fd
        return self

    def _flock(self, fd: int, mode: int) -> None:
        """Take the flock in ``mode`` without waiting; on failure close ``fd``, and raise
        JournalLocked naming the holder when another process holds it."""
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise JournalLocked(self.directory, self.holder_pid(), self.what) from None
            raise

    def holder_pid(self) -> Optional[int]:
        try:
            with open_read(self.path) as f:
                return int(f.read(32).strip() or 0) or None
        except (OSError, ValueError, UnsafePath):
            return None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None
