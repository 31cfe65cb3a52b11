"""The journal reader: walks log files in order and yields records, checking every frame.

A damaged or incomplete group at the end of the newest log file is a torn tail: the end
of the log (reported in ``Scan.tail``). Damage anywhere else, or damage followed by a
valid later group, is corruption and raises ``CorruptionError`` with file and offset.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional

from kvj.errors import CorruptionError, FormatError
from kvj.journal.framing import (
    FILE_HEADER_SIZE,
    FORMAT_VERSION,
    RawRecord,
    decode_file_header,
    header_torn,
    later_group_exists,
    parse_group,
)

LOG_RE = re.compile(r"^(\d{16})\.log$")


@dataclass
class TornTail:
    """Bytes at the end of the newest log file that do not form a complete group."""

    path: str
    offset: int
    length: int

    def to_dict(self) -> dict:
        return {"path": self.path, "offset": self.offset, "length": self.length}


def list_logs(directory: str) -> List[str]:
    """Paths of the journal's log files, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise FormatError(f"no journal at {directory}") from None
    return [os.path.join(directory, n) for n in sorted(names) if LOG_RE.match(n)]


def log_seq(path: str) -> int:
    return int(os.path.basename(path)[:16])


class Scan:
    """One pass over a journal's log files.

    Iterate it for records with LSN > ``after_lsn``; afterwards ``last_lsn``, ``tail`` and
    ``end_offset`` (valid length of the newest file) describe where the log ends.
    """

    def __init__(self, directory: str, *, after_lsn: int = 0, strict: bool = False,
                 logs: Optional[List[str]] = None):
        self.directory = directory
        self.after_lsn = after_lsn
        self.strict = strict
        self.logs = list_logs(directory) if logs is None else logs
        self.last_lsn = after_lsn
        self.first_lsn: Optional[int] = None
        self.tail: Optional[TornTail] = None
        self.end_offset = 0
        self.bytes_read = 0

    def _skip_covered(self) -> None:
        """Drop log files whose records all precede ``after_lsn`` + 1 (a snapshot covers them).

        Compaction deletes such files, and a crash may persist its unlinks in any order,
        so gaps among them are not corruption: start at the last file that begins at or
        before the first LSN needed.
        """
        if self.after_lsn <= 0:
            return
        start = 0
        for index, path in enumerate(self.logs):
            try:
                with open(path, "rb") as f:
                    header = decode_file_header(f.read(FILE_HEADER_SIZE))
            except FileNotFoundError:
                continue
            if header is not None and header.base_lsn <= self.after_lsn + 1:
                start = index
        self.logs = self.logs[start:]

    def __iter__(self) -> Iterator[RawRecord]:
        self._skip_covered()
        expected: Optional[int] = None  # next LSN; None until the first file tells
        for index, path in enumerate(self.logs):
            is_last = index == len(self.logs) - 1
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                # a concurrent compaction removed a sealed file it had folded into a snapshot
                if expected is None:
                    continue
                raise
            self.bytes_read += len(data)
            header = decode_file_header(data)
            if header is None:
                if is_last and header_torn(data):
                    # crashed while creating the newest file: no record in it was acknowledged
                    self._torn(path, 0, len(data))
                    return
                raise CorruptionError(path, 0, "bad log file header")
            if header.version != FORMAT_VERSION:
                raise FormatError(f"{path}: log format version {header.version} is not supported "
                                  f"(this kvj reads version {FORMAT_VERSION})")
            if expected is None:
                if header.base_lsn > self.after_lsn + 1:
                    raise CorruptionError(path, 0, f"log starts at LSN {header.base_lsn}, but LSNs "
                                          f"after {self.after_lsn} are needed (missing log file?)")
            elif header.base_lsn != expected:
                raise CorruptionError(path, 0, f"log file begins at LSN {header.base_lsn}, "
                                      f"expected {expected} (missing or extra log file)")
            expected = header.base_lsn
            off = FILE_HEADER_SIZE
            while off < len(data):
                parsed = parse_group(data, off, path, header.salt)
                if parsed is None:
                    if not is_last:
                        raise CorruptionError(path, off, "damaged commit group in a sealed log file")
                    later = later_group_exists(data, off, expected - 1, header.salt)
                    if later is not None:
                        raise CorruptionError(path, off, f"damaged commit group followed by a valid "
                                              f"one at offset {later}")
                    self.end_offset = off
                    self._torn(path, off, len(data) - off)
                    return
                records, off = parsed
                if records[0].lsn != expected:
                    raise CorruptionError(path, records[0].offset,
                                          f"LSN {records[0].lsn} out of order, expected {expected}")
                expected = records[-1].lsn + 1
                for rec in records:
                    if rec.lsn > self.after_lsn:
                        if self.first_lsn is None:
                            self.first_lsn = rec.lsn
                        self.last_lsn = rec.lsn
                        yield rec
            if is_last:
                self.end_offset = off

    def _torn(self, path: str, offset: int, length: int) -> None:
        if length == 0:
            return
        self.tail = TornTail(path, offset, length)
        if self.strict:
            raise CorruptionError(path, offset, f"torn tail of {length} bytes (strict mode)")
