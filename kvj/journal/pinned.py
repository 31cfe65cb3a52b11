"""The files one read pass of a journal sees: by path (``DIRECT``), or held open (``Pinned``).

A compaction writes its snapshot and then unlinks the log files and the older snapshot it
covers. A pass that loaded the old snapshot and then walked the logs for seconds would find
them gone under it and start again; under back-to-back compactions every pass could. POSIX
keeps an unlinked file's bytes while a descriptor holds it, so a replay first holds the
directories' listings, the newest snapshot and the log files open (``replay.pin``), and reads
only through them: the journal as it was at that moment (and what the writer has appended
to those files since), as LevelDB's readers pin a ``Version``.
"""

from __future__ import annotations

import errno
import os
from typing import BinaryIO, Dict, List, Optional

from kvj.errors import KvjError
from kvj.fileio import open_read, open_regular


class Files:
    """How a pass lists, opens and sizes the journal's files: by path, as they are now."""

    def listdir(self, directory: str) -> List[str]:
        return os.listdir(directory)

    def open(self, path: str) -> BinaryIO:
        return open_read(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size


DIRECT = Files()


class Pinned(Files):
    """Listings and files held since one moment. A held file is read through its descriptor
    (from byte 0 at each ``open``: one pass, one thread), a held name that did not exist then
    does not exist for the pass, and a file not held (beyond the cap) is opened by path."""

    def __init__(self) -> None:
        self._listings: Dict[str, Optional[List[str]]] = {}
        self._fds: Dict[str, Optional[int]] = {}

    def hold_listing(self, directory: str) -> Optional[List[str]]:
        """List ``directory`` now and keep that listing (None: it does not exist)."""
        try:
            names: Optional[List[str]] = os.listdir(directory)
        except FileNotFoundError:
            names = None
        self._listings[directory] = names
        return names

    def hold(self, path: str) -> bool:
        """Open ``path`` now and keep it; False when it does not exist, or cannot be opened (a
        FIFO in its place, EIO: then it is not held, and fails as before if the pass opens it)."""
        try:
            fd: Optional[int] = open_regular(path)
        except FileNotFoundError:
            fd = None
        except (OSError, KvjError):
            return False
        self._fds[path] = fd
        return fd is not None

    def listdir(self, directory: str) -> List[str]:
        if directory not in self._listings:
            return super().listdir(directory)
        names = self._listings[directory]
        if names is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory when the pass began", directory)
        return list(names)

    def _fd(self, path: str) -> int:
        fd = self._fds[path]
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "no such file when the pass began", path)
        return fd

    def open(self, path: str) -> BinaryIO:
        if path not in self._fds:
            return super().open(path)
        fd = os.dup(self._fd(path))
        os.lseek(fd, 0, os.SEEK_SET)
        return os.fdopen(fd, "rb")

    def size(self, path: str) -> int:
        if path not in self._fds:
            return super().size(path)
        return os.fstat(self._fd(path)).st_size

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
