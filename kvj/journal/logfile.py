"""The log file being written, as LevelDB's ``log::Writer``: one commit group at a time, each
written and fdatasynced before the next (spec: man/kvj-journal.5, LOG FILE and DURABILITY).

``LogFile`` frames a group (its header, with the file's salt and the time) and hands it to a
destination, which writes and fdatasyncs it: ``FileDestination`` for the one copy in the
journal's directory, ``mirrored.MirroredDestination`` for a journal and its mirror. A new file
is created with its header written and fsynced, and its directory entry fsynced, before any
group goes into it; ``rotate`` closes a full file and creates the next. Deciding when a group
is due is the commit loop's (``writer``).
"""

from __future__ import annotations

import os
import time
from typing import List, Optional, Protocol

from kvj.fileio import FS, REAL_FS, Buffer
from kvj.journal.framing import encode_file_header, encode_group_header, new_salt


def log_name(seq: int) -> str:
    """File name of log file number ``seq`` (zero-padded so names sort in order)."""
    return f"{seq:016d}.log"


class Destination(Protocol):
    """Where the log file's bytes go: one copy, or a journal's and its mirror's."""

    def create(self, name: str, header: bytes) -> None:
        """Create file ``name`` holding ``header``, it and its directory entry durable."""

    def resume(self, name: str) -> int:
        """Open file ``name``, whole groups and durable so far, to append; returns its size."""

    def write_synced(self, parts: List[Buffer]) -> None:
        """Append ``parts`` to the open file and fdatasync it."""

    def close(self) -> None:
        """Close the open file."""

    def shutdown(self) -> None:
        """Close the open file and stop whatever the destination runs (the last call)."""


class FileDestination:
    """The one copy of the log file in ``directory``."""

    def __init__(self, directory: str, fs: FS = REAL_FS):
        self.directory = directory
        self.fs = fs
        self._fd = -1

    def create(self, name: str, header: bytes) -> None:
        fd = self.fs.open(os.path.join(self.directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        try:
            self.fs.write(fd, header)
            self.fs.fsync(fd)
            self.fs.fsync_dir(self.directory)
        except BaseException:
            self.fs.close(fd)
            raise
        self._fd = fd

    def resume(self, name: str) -> int:
        self._fd = self.fs.open(os.path.join(self.directory, name), os.O_WRONLY | os.O_APPEND)
        return os.fstat(self._fd).st_size

    def write_synced(self, parts: List[Buffer]) -> None:
        self.fs.writev(self._fd, parts)
        self.fs.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            self.fs.close(fd)

    def shutdown(self) -> None:
        self.close()


class LogFile:
    """The newest log file of a journal, appended to one commit group at a time."""

    def __init__(self, dest: Destination, *, seq: int, next_lsn: int, salt: Optional[int] = None):
        """Append to log file ``seq`` when its ``salt`` is given (its content so far is whole
        groups and durable), else create it, its first LSN ``next_lsn``."""
        self.dest = dest
        self.seq = seq
        if salt is None:
            self._create(seq, next_lsn)
        else:
            self.salt, self.size = salt, dest.resume(log_name(seq))

    def _create(self, seq: int, base_lsn: int) -> None:
        salt = new_salt()
        header = encode_file_header(seq, base_lsn, salt)
        self.dest.create(log_name(seq), header)
        self.seq, self.size, self.salt = seq, len(header), salt

    def add_group(self, body: Buffer, count: int, first_lsn: int) -> None:
        """Write the commit group of ``count`` framed records ``body`` and fdatasync it: once
        this returns, its records are durable."""
        head = encode_group_header(len(body), count, first_lsn, self.salt, time.time_ns())
        self.dest.write_synced([head, body])
        self.size += len(head) + len(body)

    def rotate(self, next_lsn: int) -> None:
        """Close this file (every group in it durable) and create the next, from ``next_lsn``."""
        self.dest.close()
        self._create(self.seq + 1, next_lsn)

    def close(self) -> None:
        self.dest.shutdown()
