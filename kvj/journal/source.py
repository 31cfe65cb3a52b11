"""Where a read pass takes each commit group from: which copy of a log file (spec: man/kvj-journal.5,
MIRROR), through which files (held open since one moment, or by path). Only damage in every copy
is damage; a tail is damaged only if it is in every copy holding bytes there (a group is
acknowledged only once in every copy). A journal without a mirror is the case of one copy.
"""

from __future__ import annotations

import errno
import os
from typing import BinaryIO, Callable, Dict, List, Optional, Tuple

from kvj.errors import KvjError
from kvj.fileio import open_read, open_regular
from kvj.journal.framing import (FILE_HEADER_SIZE, FileHeader, RawRecord, decode_file_header, header_torn,
                                 later_group_exists, parse_group)
from kvj.journal.tail import TailEvidence, tail_evidence


class Pinned:
    """The listings and files one read pass sees: a compaction unlinks the files its snapshot covers,
    so replay holds them open first (as LevelDB's readers pin a ``Version``). A held file is read
    through its descriptor (from byte 0 at each ``open``: one pass, one thread), a held name that
    did not exist then does not exist for the pass, and anything not held is read by path."""

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
        """Open ``path`` now and keep it; False when it does not exist or cannot be opened (then it
        is not held, and fails as before if the pass opens it)."""
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
            return os.listdir(directory)
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
            return open_read(path)
        fd = os.dup(self._fd(path))
        os.lseek(fd, 0, os.SEEK_SET)
        return os.fdopen(fd, "rb")

    def size(self, path: str) -> int:
        return os.fstat(self._fd(path)).st_size if path in self._fds else os.stat(path).st_size

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Holding nothing: every file by path, as it is now.
DIRECT = Pinned()

class GroupSource:
    """The copies of one log file (the journal's first), read from byte ``origin`` on (a group
    boundary), each only when the walk needs it unless ``verify`` (fsck); ``data``: the one copy's
    bytes, given (a replica's download). ``report`` is told of each copy that lacks, damages or
    differs from what another holds (path, offset, why), ``counted`` of the bytes each read brings."""

    def __init__(self, paths: List[str], report: Callable[[str, Optional[int], str], None],
                 counted: Callable[[int], None], *, origin: int = 0, verify: bool = False,
                 data: Optional[bytes] = None, files: Pinned = DIRECT):
        self.paths = paths
        self.files = files
        self.origin = origin
        self.report = report
        self.counted = counted
        self.verify = verify
        self._read: Dict[int, Optional[Tuple[bytes, bytes]]] = {}
        if data is not None:
            self._read[0] = (data[:FILE_HEADER_SIZE + 1], data[origin:])
        self.dropped: Dict[int, str] = {}  # copies the walk no longer uses, and why
        self.header: Optional[FileHeader] = None
        self._order: List[int] = []
        self._main_head = b""

    def _load(self, i: int) -> Optional[Tuple[bytes, bytes]]:
        """(head, bytes from ``origin`` on) of copy ``i``, or None when it does not exist."""
        if i not in self._read:
            try:
                with self.files.open(self.paths[i]) as f:
                    if self.origin == 0:
                        data = f.read()
                        head = data[:FILE_HEADER_SIZE + 1]
                    else:
                        head = f.read(FILE_HEADER_SIZE + 1)
                        f.seek(self.origin)
                        data = f.read()
                    self.counted(len(data))
                self._read[i] = (head, data)
            except FileNotFoundError:
                self._read[i] = None
            except OSError as exc:  # a copy that cannot be read (EIO): the other one can stand in
                if len(self.paths) == 1:
                    raise
                self._read[i] = None
                self.report(self.paths[i], None, f"this copy cannot be read ({exc}); the other is read")
        return self._read[i]

    def _head(self, i: int) -> Optional[bytes]:
        loaded = self._load(i)
        return None if loaded is None else loaded[0]

    def _size(self, i: int) -> int:
        """Bytes of copy ``i`` past ``origin`` (-1: it does not exist), without reading it."""
        if i in self._read:
            loaded = self._read[i]
            return -1 if loaded is None else len(loaded[1])
        try:
            return self.files.size(self.paths[i]) - self.origin
        except FileNotFoundError:
            return -1

    def exists(self) -> bool:
        """Whether any copy of the file exists."""
        return any(self._size(i) >= 0 for i in range(len(self.paths)))

    def open(self) -> Optional[FileHeader]:
        """The file header, from the first copy that has a valid one (those before it are reported
        and dropped); None when no copy has one."""
        main = 0
        for i in range(len(self.paths)):
            head = self._head(i)
            self.header = decode_file_header(head) if head is not None else None
            if self.header is not None:
                main = i
                break
        if self.header is None:
            return None
        for i in range(main):
            what = "is missing" if self._head(i) is None else "has a bad header"
            self.report(self.paths[i], 0, f"this copy of the log file {what}; {self.paths[main]} is read")
            self.dropped[i] = what
        self._main_head = self._head(main)[:FILE_HEADER_SIZE]  # type: ignore[index]
        self._order = [main] + [i for i in range(len(self.paths)) if i != main and i not in self.dropped]
        return self.header

    def cut_short(self) -> Optional[List[Tuple[str, int]]]:
        """With no valid header in any copy: (path, size) of each copy if every one can be a
        creation cut short by a crash (no longer than a header), else None."""
        heads = [(i, h) for i in range(len(self.paths)) for h in [self._head(i)] if h is not None]
        if all(header_torn(h) for _i, h in heads):
            return [(self.paths[i], self._size(i)) for i, _h in heads]
        return None

    def copies_read(self) -> int:
        """How many copies the walk still reads."""
        return len(self._order)

    def group(self, pos: int) -> Optional[Tuple[List[RawRecord], int]]:
        """The group at ``pos`` (from ``origin``) as (records, end), from the first copy holding it
        intact (the others that do not are reported), or None when no copy does."""
        parsed, src, missing = self._arbitrate(pos)
        if parsed is not None:
            for i, why in missing:
                self.report(self.paths[i], self.origin + pos, f"{why}; the group is read from {self.paths[src]}")
                if why.startswith("this copy ends"):
                    self._order.remove(i)
                    self.dropped[i] = why
        return parsed

    def _arbitrate(self, pos: int) -> Tuple[Optional[Tuple[List[RawRecord], int]], int, List[Tuple[int, str]]]:
        """(the group at ``pos``, the copy it is from, [(copy, why) for those that lack it, damage it
        or, with ``verify``, differ])."""
        header = self.header
        assert header is not None
        order = self._order
        parsed: Optional[Tuple[List[RawRecord], int]] = None
        src = order[0]
        missing: List[Tuple[int, str]] = []
        for i in list(order):
            if parsed is not None and not self.verify:
                break
            size = self._size(i)
            if size <= pos:
                if size >= 0 and size < pos:
                    why = f"this copy ends at offset {self.origin + size}, inside or before this group"
                else:
                    why = "this copy ends here"
                if parsed is not None or any(self._size(j) > pos for j in order if j != i):
                    missing.append((i, f"{why}, where another copy goes on"))
                continue
            loaded = self._load(i)
            if loaded is None:
                continue
            if i != order[0] and loaded[0][:FILE_HEADER_SIZE] != self._main_head:
                self.report(self.paths[i], 0, "this copy's header differs from the journal's: not a copy of the "
                            "same file, not read")
                order.remove(i)
                self.dropped[i] = "different header"
                continue
            group = parse_group(loaded[1], pos, self.paths[0], header.salt, self.origin, header.version)
            if group is None:
                missing.append((i, "this copy's commit group here is damaged or incomplete"))
            elif parsed is None:
                parsed, src = group, i
            elif loaded[1][pos:group[1]] != self._load(src)[1][pos:parsed[1]]:  # type: ignore[index]
                missing.append((i, "this copy's commit group here differs from the other copy's"))
        return parsed, src, missing

    def _beyond(self, pos: int) -> List[Tuple[int, bytes]]:
        """(copy, its bytes) of each copy read that holds bytes past ``pos``."""
        return [(i, self._load(i)[1]) for i in self._order if self._size(i) > pos]  # type: ignore[index]

    def ends_at(self, pos: int) -> bool:
        """Whether every copy read ends at ``pos``: the end of this file."""
        return not any(self._size(i) > pos for i in self._order)

    def later_group(self, pos: int, after_lsn: int) -> Optional[int]:
        """Offset of a valid group past ``pos`` with LSNs after ``after_lsn`` in any copy: proof that
        what is at ``pos`` is damage, not a torn tail."""
        header = self.header
        assert header is not None
        for _i, data in self._beyond(pos):
            later = later_group_exists(data, pos, after_lsn, header.salt, header.version)
            if later is not None:
                return later
        return None

    def tail(self, pos: int) -> Tuple[bool, List[Tuple[str, int, TailEvidence]]]:
        """What the bytes from ``pos`` to the end of each copy are: (damaged in every copy, [(copy's
        path, bytes, evidence)])."""
        header = self.header
        assert header is not None
        evidence = [(self.paths[i], len(data) - pos, tail_evidence(data, pos, header.salt, header.version,
                                                                   self.origin))
                    for i, data in self._beyond(pos)]
        return all(e.damaged for _p, _n, e in evidence), evidence
