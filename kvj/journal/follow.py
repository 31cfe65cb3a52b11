"""Following a live journal like ``tail -f``, never showing a record that is not complete.

The writer appends whole commit groups; a group is shown only once it parses completely
(length, every CRC, LSN sequence). An incomplete group at the end of the newest log file
is re-read from the same offset on the next poll. Once a newer log file exists, the
current one is sealed: whatever still does not parse there is a torn tail left by a
crash, and following moves on to the next file. A follower that falls behind a compaction
continues after the snapshot that absorbed the records it missed.
"""

from __future__ import annotations

import time
from typing import Iterator, List, Optional

from kvj.errors import CorruptionError, FormatError
from kvj.journal.framing import FILE_HEADER_SIZE, decode_file_header, parse_group
from kvj.journal.reader import list_logs
from kvj.journal.records import decode_payload
from kvj.journal.replay import Record
from kvj.journal.snapshot import list_snapshots


class Follower:
    """Yields records after ``after_lsn`` as they become durable; ``poll`` returns the new ones."""

    def __init__(self, directory: str, *, after_lsn: int = 0):
        self.directory = directory
        self.expected = after_lsn + 1  # the next LSN to show
        self.path: Optional[str] = None
        self.offset = 0
        self.salt = 0  # of the file at ``path``, read with its header

    def _start(self, logs: List[str]) -> None:
        """Begin at the newest file whose first LSN is not past the next one we need."""
        start = logs[0]
        for path in logs:
            try:
                with open(path, "rb") as f:
                    header = decode_file_header(f.read(FILE_HEADER_SIZE))
            except FileNotFoundError:
                continue
            if header is not None and header.base_lsn <= self.expected:
                start = path
        self.path, self.offset = start, 0

    def poll(self) -> List[Record]:
        """Every complete record that appeared since the last poll (possibly none)."""
        found: List[Record] = []
        while True:
            logs = list_logs(self.directory)
            if not logs:
                return found
            if self.path is None or (self.path not in logs and not any(p > self.path for p in logs)):
                self._start(logs)
            assert self.path is not None
            newer = [p for p in logs if p > self.path]  # listed before reading: see the module docstring
            if self.path in logs:
                found += self._read(self.path)
            if not newer:
                return found
            self.path, self.offset = newer[0], 0

    def _skip_compacted(self, path: str, base_lsn: int) -> None:
        """Jump to ``base_lsn`` when a compaction folded the records before it into a snapshot
        while we were behind (like ``tail -F`` after a rotation); otherwise it is a gap."""
        snaps = list_snapshots(self.directory)
        if not snaps or snaps[0][0] < base_lsn - 1:
            raise CorruptionError(path, 0, f"log starts at LSN {base_lsn}, expected {self.expected} "
                                  "(missing log file?)")
        self.expected = base_lsn

    def _read(self, path: str) -> List[Record]:
        try:
            with open(path, "rb") as f:
                if self.offset == 0:
                    head = f.read(FILE_HEADER_SIZE)
                    header = decode_file_header(head)
                    if header is None:
                        return []  # being created; read again on the next poll
                    if header.base_lsn > self.expected:
                        self._skip_compacted(path, header.base_lsn)
                    self.offset, self.salt = FILE_HEADER_SIZE, header.salt
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        records: List[Record] = []
        pos = 0
        while pos < len(data):
            parsed = parse_group(data, pos, path, self.salt)
            if parsed is None:
                break  # incomplete (still being written) or torn
            raws, pos_next = parsed
            for raw in raws:
                if raw.lsn < self.expected:
                    continue
                if raw.lsn > self.expected:
                    raise CorruptionError(path, self.offset + raw.offset, f"LSN {raw.lsn} out of order, "
                                          f"expected {self.expected}")
                try:
                    payload = decode_payload(raw.rtype, raw.payload)
                except FormatError as exc:
                    raise CorruptionError(path, self.offset + raw.offset, f"LSN {raw.lsn}: {exc}") from None
                records.append(Record(raw.lsn, raw.rtype, payload, path, self.offset + raw.offset))
                self.expected = raw.lsn + 1
            pos = pos_next
        self.offset += pos
        return records

    def follow(self, interval: float = 0.2) -> Iterator[Record]:
        """Yield records forever, polling every ``interval`` seconds when there is nothing new."""
        while True:
            batch = self.poll()
            yield from batch
            if not batch:
                time.sleep(interval)
