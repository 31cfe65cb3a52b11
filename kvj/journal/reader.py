"""The journal reader, as LevelDB's ``log::Reader``: ``Scan``, the one walk over log files, checking
every frame and handing what it finds wrong to a ``Reporter`` (the default raises; fsck's records
and goes on). An invalid last group with no valid group after it is the end of the log: torn, or
damaged when a torn write cannot leave it (``tail``); anything else is corruption, never skipped.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, Tuple, Union

from kvj.errors import CorruptionError, FormatError, InvalidArgument
from kvj.journal.framing import (FILE_HEADER_SIZE, FORMAT_VERSION, READABLE_VERSIONS, FileHeader, RawRecord,
                                 decode_file_header)
from kvj.journal.mirror import copies, mirror_of
from kvj.journal.records import decode_fields, decode_payload
from kvj.journal.source import DIRECT, GroupSource, Pinned

LOG_RE = re.compile(r"^(\d{16})\.log$")

#: Kinds of ``Damage``: errors, but for a torn tail (the end of the log), a gap a snapshot covers,
#: and ``copy`` (one copy of a mirrored journal lacking or damaging what the other holds intact).
CORRUPTION, LSN_GAP, LSN_ORDER, FORMAT, TORN, COVERED_GAP, COPY, DAMAGED_TAIL = (
    "corruption", "lsn-gap", "lsn-order", "format", "torn", "covered-gap", "copy", "damaged-tail")

#: Recovery modes, after RocksDB's ``WALRecoveryMode``: what ends the log and what is an error,
#: for ``kvj recover`` and ``kvj fsck``. Skipping corrupted records is not offered.
TOLERATE_TORN_TAIL, ABSOLUTE_CONSISTENCY, POINT_IN_TIME = "tolerate-torn-tail", "absolute-consistency", "point-in-time"
RECOVERY_MODES = (TOLERATE_TORN_TAIL, ABSOLUTE_CONSISTENCY, POINT_IN_TIME)


def check_mode(mode: str) -> str:
    """``mode`` if it is one of ``RECOVERY_MODES``, else ``InvalidArgument``."""
    if mode not in RECOVERY_MODES:
        raise InvalidArgument(f"unknown recovery mode {mode!r}: expected one of {', '.join(RECOVERY_MODES)}")
    return mode


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
    return Record(raw.lsn, raw.rtype, payload_of(raw), raw.path, raw.offset, raw.time)


def payload_of(raw: RawRecord) -> Dict[str, Any]:
    """The decoded, validated payload of a framed record; a malformed one is ``CorruptionError``."""
    try:
        return decode_payload(raw.rtype, raw.payload)
    except FormatError as exc:
        raise CorruptionError(raw.path, raw.offset, f"LSN {raw.lsn}: {exc}") from None


def fields_of(raw: RawRecord) -> Any:
    """The payload decoded once for a fold (``JournalState.apply`` takes it): its type's struct,
    or an unknown type's map; a malformed one is ``CorruptionError``."""
    try:
        return decode_fields(raw.rtype, raw.payload)
    except FormatError as exc:
        raise CorruptionError(raw.path, raw.offset, f"LSN {raw.lsn}: {exc}") from None


@dataclass(frozen=True)
class Group:
    """A valid commit group: its records, and where it starts and ends in its log file."""

    records: List[RawRecord]
    offset: int
    end: int


@dataclass
class TornTail:
    """Bytes at the end of the newest log file that are no valid group (``offset`` 0: no header);
    ``damaged``: no torn write (``why`` says); ``records``: how many its group declares, if known."""

    path: str
    offset: int
    length: int
    damaged: bool = False
    records: Optional[int] = None
    why: str = ""

    def to_dict(self) -> dict:
        return {"path": self.path, "offset": self.offset, "length": self.length, "damaged": self.damaged,
                "records": self.records, "why": self.why}


@dataclass(frozen=True)
class Damage:
    """One thing a scan found wrong, of one of the kinds above, and where."""

    kind: str
    path: str
    offset: Optional[int]
    reason: str
    length: int = 0  # bytes affected, for a torn or damaged tail
    records: Optional[int] = None  # records the group there declares, for a torn or damaged tail (when known)


#: Called with each ``Damage``; raising stops the scan, returning lets it go on past the damage.
Reporter = Callable[[Damage], None]


def raise_on_damage(damage: Damage) -> None:
    """The default reporter: errors raise; a torn tail, a gap a snapshot covers and a copy's do not."""
    if damage.kind == FORMAT:
        raise FormatError(f"{damage.path}: {damage.reason}")
    if damage.kind not in (TORN, COVERED_GAP, COPY):
        raise CorruptionError(damage.path, damage.offset, damage.reason)


def list_logs(directory: str, files: Pinned = DIRECT) -> List[str]:
    """Paths of the journal's log files, oldest first."""
    try:
        names = files.listdir(directory)
    except FileNotFoundError:
        raise FormatError(f"no journal at {directory}") from None
    return [os.path.join(directory, n) for n in sorted(names) if LOG_RE.match(n)]


def log_seq(path: str) -> int:
    """The number of log file ``path``."""
    return int(os.path.basename(path)[:16])


def read_header(path: str, files: Pinned = DIRECT) -> Optional[FileHeader]:
    """The header of log file ``path``; None when it is not (yet) a valid one."""
    with files.open(path) as f:
        return decode_file_header(f.read(FILE_HEADER_SIZE))


class Scan:
    """One pass over a journal's log files: iterate it for framed records with LSN > ``after_lsn``
    (``records()`` decodes them, ``groups()`` gives commit groups); afterwards ``last_lsn``,
    ``next_lsn``, ``tail`` and ``end_offset`` say where the log ends. LSNs up to ``covered_lsn``
    are in a snapshot (their files may be gone). ``start`` = (path, offset) resumes where an
    earlier scan ended. ``mirror``: True reads the recorded mirror, False the journal's copy
    alone, a path that mirror; ``copies`` lists what one copy lacked or damaged."""

    def __init__(self, directory: str, *, after_lsn: int = 0, strict: bool = False,
                 logs: Optional[List[str]] = None, reporter: Reporter = raise_on_damage,
                 covered_lsn: Optional[int] = None, start: Optional[Tuple[str, int]] = None,
                 mirror: Union[bool, str] = True, verify_copies: bool = False, files: Pinned = DIRECT):
        self.directory = directory
        self.files = files
        self.after_lsn = after_lsn
        self.covered_lsn = after_lsn if covered_lsn is None else covered_lsn
        self.strict = strict
        self.report = reporter
        self.mirror: Optional[str] = (mirror_of(directory) if mirror is True else mirror or None)
        self.verify_copies = verify_copies
        self.copies: List[Damage] = []
        self.logs = self._list() if logs is None else logs
        self.start = start
        self.last_lsn = after_lsn
        self.first_lsn: Optional[int] = None
        self.next_lsn: Optional[int] = None  #: the LSN the log continues with (None: no valid file)
        self.tail: Optional[TornTail] = None
        self.end_offset = 0
        self.bytes_read = 0
        self._given: Dict[str, bytes] = {}

    @classmethod
    def of_bytes(cls, data: bytes, path: str, **options: Any) -> "Scan":
        """A walk of one log file given as bytes (a replica's download), named ``path``."""
        scan = cls(os.path.dirname(path), logs=[path], mirror=False, **options)
        scan._given[path] = data
        return scan

    def _list(self) -> List[str]:
        """The journal's log files, and those only its mirror still has (under the journal's name)."""
        names = {os.path.basename(p) for p in list_logs(self.directory, self.files)}
        if self.mirror is not None:
            try:
                names.update(os.path.basename(p) for p in list_logs(self.mirror, self.files))
            except FormatError:
                self._copy(self.mirror, None, "the mirror directory is missing; the journal's copy is read alone")
        return [os.path.join(self.directory, n) for n in sorted(names)]

    def header_of(self, path: str) -> Optional[FileHeader]:
        """The header of log file ``path`` from the first copy that has a valid one."""
        if path in self._given:
            return decode_file_header(self._given[path][:FILE_HEADER_SIZE])
        for copy in copies(path, self.mirror):
            try:
                header = read_header(copy, self.files)
            except FileNotFoundError:
                continue
            if header is not None:
                return header
        return None

    def live_logs(self) -> List[str]:
        """The log files the walk reads: from ``start``, else from the last file that begins at or
        before ``after_lsn`` + 1 (compaction deletes those before, in any order)."""
        if self.start is not None and self.start[0] in self.logs:
            self.logs = self.logs[self.logs.index(self.start[0]):]
            return list(self.logs)
        self.start = None
        if self.after_lsn > 0:
            first = 0
            for index, path in enumerate(self.logs):
                header = self.header_of(path)
                if header is not None and header.base_lsn <= self.after_lsn + 1:
                    first = index
            self.logs = self.logs[first:]
        return list(self.logs)

    def records(self) -> Iterator[Record]:
        """The decoded records (``decode``), in order."""
        for raw in self:
            yield decode(raw)

    def __iter__(self) -> Iterator[RawRecord]:
        after = self.after_lsn
        for group in self.groups():
            for rec in group.records:
                if rec.lsn > after:
                    yield rec

    def groups(self) -> Iterator[Group]:
        """The valid commit groups, in order, that hold a record with LSN > ``after_lsn``."""
        self.live_logs()
        self._expected: Optional[int] = None  # next LSN; None until a file tells
        started = False  # whether a file was read (before that, a vanished file was compacted away)
        for index, path in enumerate(self.logs):
            origin = self.start[1] if index == 0 and self.start is not None else 0
            given = self._given.get(path)
            source = GroupSource([path] if given is not None else copies(path, self.mirror), self._copy,
                                 self._count, origin=origin, verify=self.verify_copies, data=given, files=self.files)
            if not source.exists():
                # a concurrent compaction removed a sealed file it had folded into a snapshot
                if not started:
                    continue
                raise FileNotFoundError(errno.ENOENT, "log file vanished during the scan", path)
            first, started = not started, True
            if (yield from self._file(source, index == len(self.logs) - 1, first)):
                return

    def _count(self, n: int) -> None:
        self.bytes_read += n

    def _file(self, source: GroupSource, is_last: bool, first: bool) -> Generator[Group, None, bool]:
        """Walk one log file, group by group, checking that LSNs go on from the file before and
        from group to group; True when the log ends in it."""
        path, origin = source.paths[0], source.origin
        header = source.open()
        if header is None:
            cut = source.cut_short() if is_last else None
            if cut is not None:
                # crashed while creating the newest file: no record in it was acknowledged
                for copy, size in cut:
                    self._torn(copy, 0, size)
                return True
            where = "in a sealed log file" if not is_last else "on a file longer than a header"
            self.report(Damage(CORRUPTION, path, 0, f"bad log file header {where}"
                               + (" (in every copy)" if len(source.paths) > 1 else "")))
            self._expected = None  # the walk goes on with the next file, whatever LSN it starts at
            return False
        if header.version not in READABLE_VERSIONS:
            self.report(Damage(FORMAT, path, 0, f"log format version {header.version} is not supported "
                               f"(this kvj reads versions up to {FORMAT_VERSION})"))
            self._expected = None
            return False
        if header.seq != log_seq(path):
            self.report(Damage(CORRUPTION, path, 0, f"header says file number {header.seq}, "
                               f"name says {log_seq(path)}"))
        if origin:
            self._expected = self.after_lsn + 1
        else:
            self._check_base(path, header.base_lsn, self._expected, first)
            self._expected = header.base_lsn
        pos = FILE_HEADER_SIZE if origin == 0 else 0
        resynced = False
        after = self.after_lsn
        while True:
            parsed = source.group(pos)
            if parsed is None:
                if source.ends_at(pos):
                    break  # every copy ends here: the end of this file
                later = source.later_group(pos, self._expected - 1)  # type: ignore[operator]
                if later is None and is_last:
                    self.end_offset = origin + pos
                    damaged, evidence = source.tail(pos)
                    for copy, length, e in evidence:
                        self._torn(copy, origin + pos, length, e.why, e.records, damaged)
                    self.next_lsn = self._expected
                    return True
                where = (f"followed by a valid one at offset {origin + later}" if later is not None
                         else "in a sealed log file")
                every = " (in every copy)" if source.copies_read() > 1 else ""
                self.report(Damage(CORRUPTION, path, origin + pos, f"damaged commit group {where}{every}"))
                if later is None:
                    self._expected = None  # the lost end of this file: the next one starts where it starts
                    break
                pos, resynced = later, True  # go on at the group that proves itself valid
                continue
            records, end = parsed
            if records[0].lsn != self._expected and not resynced:
                self.report(Damage(LSN_ORDER, path, records[0].offset,
                                   f"LSN {records[0].lsn} out of order, expected {self._expected}"))
            resynced = False
            self._expected = records[-1].lsn + 1
            if records[-1].lsn > after:
                if self.first_lsn is None:
                    self.first_lsn = next(r.lsn for r in records if r.lsn > after)
                self.last_lsn = records[-1].lsn
                yield Group(records, origin + pos, origin + end)
            pos = end
        if is_last:
            self.end_offset = origin + pos
        self.next_lsn = self._expected
        return False

    def _copy(self, path: str, offset: Optional[int], reason: str) -> None:
        damage = Damage(COPY, path, offset, reason)
        self.copies.append(damage)
        self.report(damage)

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

    def _torn(self, path: str, offset: int, length: int, why: str = "", records: Optional[int] = None,
              damaged: bool = False) -> None:
        """The end of the log: a torn tail (or, ``damaged``, a damaged one: an error) of ``length`` bytes."""
        said = f": {why}" if why else ""
        if damaged:
            self.tail = self.tail or TornTail(path, offset, length, True, records, why)
            self.report(Damage(DAMAGED_TAIL, path, offset, f"damaged last commit group, {length} bytes{said}",
                               length, records))
            return
        self.report(Damage(TORN, path, offset, f"torn tail of {length} bytes{said}", length, records))
        if length == 0:
            return
        if self.tail is None:
            self.tail = TornTail(path, offset, length, False, records, why)
        if self.strict:
            raise CorruptionError(path, offset, f"torn tail of {length} bytes{said} (strict mode)")


@dataclass(frozen=True)
class LogEnd:
    """Where a journal's log ends, for status displays: the last complete commit group."""

    lsn: int  #: its last LSN (the snapshot's, or 0, when no log file holds a group)
    time: Optional[float]  #: when it was written (Unix seconds); None for kvj 0.1.0 files or no group
    path: Optional[str]  #: the log file holding it
    tail: Optional[TornTail]  #: incomplete bytes after it in the newest file (a live writer's, or a crash's)


def newest_first(logs: List[str]) -> Iterator[Tuple[str, FileHeader, bool]]:
    """The log files ``logs`` names, newest first, with their headers and whether each is the newest
    (one removed meanwhile or without a header is passed over)."""
    for index in range(len(logs) - 1, -1, -1):
        try:
            header = read_header(logs[index])
        except FileNotFoundError:
            continue
        if header is not None:
            yield logs[index], header, index == len(logs) - 1


def log_end(directory: str, snapshot_lsn: int = 0, mirror: Union[bool, str] = True) -> LogEnd:
    """The last complete group of the log, from the newest log files only: what ``kvj status`` shows
    as the last durable write. ``mirror`` as for ``Scan``."""
    tail: Optional[TornTail] = None
    for path, header, newest in newest_first(list_logs(directory)):
        scan = Scan(directory, after_lsn=header.base_lsn - 1, logs=[path], reporter=lambda _d: None, mirror=mirror)
        last: Optional[RawRecord] = None
        for raw in scan:
            last = raw
        if newest:
            tail = scan.tail
        if last is not None:
            return LogEnd(last.lsn, last.time, path, tail)
    return LogEnd(snapshot_lsn, None, None, tail)
