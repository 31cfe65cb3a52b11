"""The journal reader: the one walk over log files, checking every frame.

``Scan`` yields framed records in LSN order. What it finds wrong it hands to a reporter,
as LevelDB's ``log::Reader`` hands corruption to its ``Reporter``: the default raises,
so replay, compaction and the writer stop at the first damage; fsck passes one that
records each finding and returns, and the walk goes on past the damage. A damaged or
incomplete group at the end of the newest log file is a torn tail: the end of the log
(``Scan.tail``). Damage anywhere else, or damage followed by a valid later group, is
corruption. ``decode`` turns a framed record into a ``Record`` or raises
``CorruptionError``; every reader uses it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError
from kvj.fileio import open_read
from kvj.journal.framing import (
    FILE_HEADER_SIZE,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    FileHeader,
    RawRecord,
    decode_file_header,
    header_torn,
    later_group_exists,
    parse_group,
)
from kvj.journal.records import decode_payload

LOG_RE = re.compile(r"^(\d{16})\.log$")

#: Kinds of ``Damage``. Only ``corruption``, ``lsn-gap``, ``lsn-order`` and ``format`` are errors
#: in themselves; a torn tail ends the log, and a gap a snapshot covers is expected after compaction.
CORRUPTION, LSN_GAP, LSN_ORDER, FORMAT, TORN, COVERED_GAP = (
    "corruption", "lsn-gap", "lsn-order", "format", "torn", "covered-gap")


@dataclass(frozen=True)
class Record:
    """A decoded journal record, where it lives, and when its commit group was written."""

    lsn: int
    rtype: int
    payload: Dict[str, Any]
    path: str
    offset: int
    time: Optional[float] = None  # Unix seconds; None for records of kvj 0.1.0 (format version 1)


def decode(raw: RawRecord) -> Record:
    """Decode and validate a framed record's payload; a malformed one is ``CorruptionError``."""
    try:
        payload = decode_payload(raw.rtype, raw.payload)
    except FormatError as exc:
        raise CorruptionError(raw.path, raw.offset, f"LSN {raw.lsn}: {exc}") from None
    return Record(raw.lsn, raw.rtype, payload, raw.path, raw.offset, raw.time)


@dataclass
class TornTail:
    """Bytes at the end of the newest log file that do not form a complete group.

    ``offset`` 0 means the file's header itself is incomplete (a crash while creating it).
    """

    path: str
    offset: int
    length: int

    def to_dict(self) -> dict:
        return {"path": self.path, "offset": self.offset, "length": self.length}


@dataclass(frozen=True)
class Damage:
    """One thing a scan found wrong, of one of the kinds above, and where."""

    kind: str
    path: str
    offset: Optional[int]
    reason: str
    length: int = 0  # bytes affected, for a torn tail


#: Called with each ``Damage``; raising stops the scan, returning lets it go on past the damage.
Reporter = Callable[[Damage], None]


def raise_on_damage(damage: Damage) -> None:
    """The default reporter: errors raise; a torn tail and a gap a snapshot covers do not."""
    if damage.kind == FORMAT:
        raise FormatError(f"{damage.path}: {damage.reason}")
    if damage.kind not in (TORN, COVERED_GAP):
        raise CorruptionError(damage.path, damage.offset, damage.reason)


def list_logs(directory: str) -> List[str]:
    """Paths of the journal's log files, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise FormatError(f"no journal at {directory}") from None
    return [os.path.join(directory, n) for n in sorted(names) if LOG_RE.match(n)]


def log_seq(path: str) -> int:
    return int(os.path.basename(path)[:16])


def read_header(path: str) -> Optional[FileHeader]:
    """The header of log file ``path``; None when it is not (yet) a valid one."""
    with open_read(path) as f:
        return decode_file_header(f.read(FILE_HEADER_SIZE))


class Scan:
    """One pass over a journal's log files.

    Iterate it for framed records with LSN > ``after_lsn`` (``records()`` decodes them);
    afterwards ``last_lsn``, ``next_lsn``, ``tail`` and ``end_offset`` (valid length of the
    newest file) describe where the log ends. LSNs up to ``covered_lsn`` (default:
    ``after_lsn``) are in a snapshot, so log files holding only those may be gone.
    ``start`` = (path, offset) resumes inside a file at a group boundary an earlier scan
    ended on, with ``after_lsn`` the last LSN before it (how a follower polls).
    """

    def __init__(self, directory: str, *, after_lsn: int = 0, strict: bool = False,
                 logs: Optional[List[str]] = None, reporter: Reporter = raise_on_damage,
                 covered_lsn: Optional[int] = None, start: Optional[Tuple[str, int]] = None):
        self.directory = directory
        self.after_lsn = after_lsn
        self.covered_lsn = after_lsn if covered_lsn is None else covered_lsn
        self.strict = strict
        self.report = reporter
        self.logs = list_logs(directory) if logs is None else logs
        self.start = start
        self.last_lsn = after_lsn
        self.first_lsn: Optional[int] = None
        self.next_lsn: Optional[int] = None  #: the LSN the log continues with (None: no valid file)
        self.tail: Optional[TornTail] = None
        self.end_offset = 0
        self.bytes_read = 0

    def _skip_covered(self) -> None:
        """Begin at ``start``, or drop log files whose records all precede ``after_lsn`` + 1.

        Compaction deletes such files, and a crash may persist its unlinks in any order,
        so gaps among them are not corruption: start at the last file that begins at or
        before the first LSN needed.
        """
        if self.start is not None and self.start[0] in self.logs:
            self.logs = self.logs[self.logs.index(self.start[0]):]
            return
        self.start = None
        if self.after_lsn <= 0:
            return
        first = 0
        for index, path in enumerate(self.logs):
            try:
                header = read_header(path)
            except FileNotFoundError:
                continue
            if header is not None and header.base_lsn <= self.after_lsn + 1:
                first = index
        self.logs = self.logs[first:]

    def records(self) -> Iterator[Record]:
        """The decoded records (``decode``), in order."""
        for raw in self:
            yield decode(raw)

    def __iter__(self) -> Iterator[RawRecord]:
        self._skip_covered()
        expected: Optional[int] = None  # next LSN; None until a file tells
        started = False  # whether a file was read (before that, a vanished file was compacted away)
        for index, path in enumerate(self.logs):
            first = not started
            is_last = index == len(self.logs) - 1
            origin = self.start[1] if index == 0 and self.start is not None else 0
            try:
                head, data, size = self._read(path, origin)
            except FileNotFoundError:
                # a concurrent compaction removed a sealed file it had folded into a snapshot
                if not started:
                    continue
                raise
            started = True
            header = decode_file_header(head)
            if header is None:
                if is_last and header_torn(head):
                    # crashed while creating the newest file: no record in it was acknowledged
                    self._torn(path, 0, size)
                    return
                where = "in a sealed log file" if not is_last else "on a file longer than a header"
                self.report(Damage(CORRUPTION, path, 0, f"bad log file header {where}"))
                expected = None  # the walk goes on with the next file, whatever LSN it starts at
                continue
            if header.version not in READABLE_VERSIONS:
                self.report(Damage(FORMAT, path, 0, f"log format version {header.version} is not supported "
                                   f"(this kvj reads versions up to {FORMAT_VERSION})"))
                expected = None
                continue
            if header.seq != log_seq(path):
                self.report(Damage(CORRUPTION, path, 0, f"header says file number {header.seq}, "
                                   f"name says {log_seq(path)}"))
            if origin:
                expected = self.after_lsn + 1
            else:
                self._check_base(path, header.base_lsn, expected, first)
                expected = header.base_lsn
            pos = FILE_HEADER_SIZE if origin == 0 else 0
            resynced = False
            while pos < len(data):
                parsed = parse_group(data, pos, path, header.salt, origin, header.version)
                if parsed is None:
                    later = later_group_exists(data, pos, expected - 1, header.salt, header.version)
                    if later is None and is_last:
                        self.end_offset = origin + pos
                        self._torn(path, origin + pos, len(data) - pos)
                        self.next_lsn = expected
                        return
                    where = (f"followed by a valid one at offset {origin + later}" if later is not None
                             else "in a sealed log file")
                    self.report(Damage(CORRUPTION, path, origin + pos, f"damaged commit group {where}"))
                    if later is None:
                        expected = None  # the lost end of this file: the next one starts where it starts
                        break
                    pos, resynced = later, True  # go on at the group that proves itself valid
                    continue
                records, pos = parsed
                if records[0].lsn != expected and not resynced:
                    self.report(Damage(LSN_ORDER, path, records[0].offset,
                                       f"LSN {records[0].lsn} out of order, expected {expected}"))
                resynced = False
                expected = records[-1].lsn + 1
                for rec in records:
                    if rec.lsn > self.after_lsn:
                        if self.first_lsn is None:
                            self.first_lsn = rec.lsn
                        self.last_lsn = rec.lsn
                        yield rec
            if is_last:
                self.end_offset = origin + pos
            self.next_lsn = expected

    def _read(self, path: str, origin: int) -> Tuple[bytes, bytes, int]:
        """(the file's first bytes, enough for its header; its bytes from ``origin`` on; its size)."""
        with open_read(path) as f:
            if origin == 0:
                data = f.read()
                self.bytes_read += len(data)
                return data[:FILE_HEADER_SIZE + 1], data, len(data)
            head = f.read(FILE_HEADER_SIZE + 1)
            f.seek(origin)
            data = f.read()
            self.bytes_read += len(data)
            return head, data, origin + len(data)

    def _check_base(self, path: str, base: int, expected: Optional[int], first: bool) -> None:
        """Report a file that does not begin where the log before it ended."""
        if expected is None:
            if first and base > self.covered_lsn + 1:
                self.report(Damage(LSN_GAP, path, 0, f"log starts at LSN {base}, but LSNs after "
                                   f"{self.covered_lsn} are needed: {self.covered_lsn + 1}..{base - 1} "
                                   "are missing (missing log file?)"))
        elif base != expected:
            kind = COVERED_GAP if base <= self.covered_lsn + 1 else LSN_GAP
            self.report(Damage(kind, path, 0, f"log file begins at LSN {base}, expected {expected} "
                               "(missing or extra log file)"))

    def _torn(self, path: str, offset: int, length: int) -> None:
        self.report(Damage(TORN, path, offset, f"torn tail of {length} bytes", length))
        if length == 0:
            return
        self.tail = TornTail(path, offset, length)
        if self.strict:
            raise CorruptionError(path, offset, f"torn tail of {length} bytes (strict mode)")


@dataclass(frozen=True)
class LogEnd:
    """Where a journal's log ends, for status displays: the last complete commit group."""

    lsn: int  #: its last LSN (the snapshot's, or 0, when no log file holds a group)
    time: Optional[float]  #: when it was written (Unix seconds); None for kvj 0.1.0 files or no group
    path: Optional[str]  #: the log file holding it
    tail: Optional[TornTail]  #: incomplete bytes after it in the newest file (a live writer's, or a crash's)


def log_end(directory: str, snapshot_lsn: int = 0) -> LogEnd:
    """The last complete group of the log, reading only the newest log files (newest first,
    until one holds a group): what ``kvj status`` shows as the last durable write and its age.

    Complete is not durable for a live writer, whose last group may await its fdatasync;
    for a journal no writer holds, it is what replay will return.
    """
    logs = list_logs(directory)
    tail: Optional[TornTail] = None
    for index in range(len(logs) - 1, -1, -1):
        path = logs[index]
        try:
            header = read_header(path)
        except FileNotFoundError:
            continue
        if header is None:
            continue
        scan = Scan(directory, after_lsn=header.base_lsn - 1, logs=[path], reporter=lambda _d: None)
        last: Optional[RawRecord] = None
        for raw in scan:
            last = raw
        if index == len(logs) - 1:
            tail = scan.tail
        if last is not None:
            return LogEnd(last.lsn, last.time, path, tail)
    return LogEnd(snapshot_lsn, None, None, tail)
