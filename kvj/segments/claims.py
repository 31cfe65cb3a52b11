"""Claims: a writer's hold on segments it stored or deduplicated but has not journaled durably yet.

Between a put (or dedup hit) and the durable record naming the segment, a collector replaying the
journal sees it unreferenced; a claim closes that window (``man/kvj-segment.5``, CLAIMS). The
writer claims before the put looks the key up, the journal releases once the record is durable;
a collector, under the exclusive collection lock, keeps what is claimed, then what the records
appended since its replay name. A claim is a shared OFD byte-range lock on one byte of
``root/claims.lock``: no I/O, across threads and processes, dropped by the kernel when the writer
dies. A collector tests through a descriptor of its own, so it sees its own process's claims.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from typing import Dict, Iterable, Optional, Set

from kvj.fileio import open_regular

CLAIMS_NAME = "claims.lock"
#: ``struct flock`` on Linux (l_type, l_whence, l_start, l_len, l_pid, padding).
_FLOCK = struct.Struct("hhqqi4x")


def _offset(key: str) -> int:
    """The byte a claim on ``key`` locks: its first 60 bits (a collision only keeps a segment longer)."""
    return int(key[:15], 16)


def _lock(fd: int, kind: int, key: str, test: bool = False) -> int:
    """Set lock ``kind`` on ``key``'s byte, or with ``test`` the type of a conflicting one (``F_UNLCK``: none)."""
    arg = _FLOCK.pack(kind, os.SEEK_SET, _offset(key), 1, 0)
    out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK if test else fcntl.F_OFD_SETLK, arg)
    return _FLOCK.unpack(out)[0]


class Claims:
    """The claims this store handle holds, counted per key (a key put twice is released twice)."""

    def __init__(self, root: str):
        self.path = os.path.join(root, CLAIMS_NAME)
        self._fd: Optional[int] = None
        self._count: Dict[str, int] = {}
        self._lock = threading.Lock()

    def _file(self) -> int:
        if self._fd is None:
            self._fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        return self._fd

    def claim(self, keys: Iterable[str]) -> None:
        """Hold a claim on each of ``keys`` (once per occurrence) until :meth:`release`."""
        with self._lock:
            for key in keys:
                n = self._count.get(key, 0)
                if n == 0:
                    _lock(self._file(), fcntl.F_RDLCK, key)
                self._count[key] = n + 1

    def release(self, keys: Iterable[str]) -> None:
        """Give back one claim on each of ``keys``; a key this handle holds no claim on is ignored."""
        with self._lock:
            for key in keys:
                n = self._count.get(key, 0)
                if n == 1:
                    _lock(self._file(), fcntl.F_UNLCK, key)
                    del self._count[key]
                elif n > 1:
                    self._count[key] = n - 1

    def close(self) -> None:
        """Release every claim (closing the descriptor drops its locks)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._count.clear()


def claimed(root: str, keys: Iterable[str]) -> Set[str]:
    """Which of ``keys`` some writer, in any process (this one too), claims now."""
    try:
        fd = open_regular(os.path.join(root, CLAIMS_NAME))
    except FileNotFoundError:
        return set()
    try:
        return {key for key in keys if _lock(fd, fcntl.F_WRLCK, key, test=True) != fcntl.F_UNLCK}
    finally:
        os.close(fd)
