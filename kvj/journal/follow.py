"""Following a live journal like ``tail -F``, never showing a record that is not complete.

Each poll is a ``Scan`` resuming where the previous one ended: an incomplete group at the end is
its torn tail, read again next time. When compaction deletes log files a follower had not read,
it goes on after the snapshot that absorbed them and says which LSNs it could not show.
"""

from __future__ import annotations

import time
from typing import Iterator, List, Optional, Tuple

from kvj.errors import CorruptionError
from kvj.journal.reader import Record, Scan, list_logs
from kvj.journal.snapshot import list_snapshots


class Follower:
    """Yields records after ``after_lsn`` as they become durable; ``poll`` returns the new ones."""

    def __init__(self, directory: str, *, after_lsn: int = 0):
        self.directory = directory
        self.expected = after_lsn + 1  # the next LSN to show
        self.position: Optional[Tuple[str, int]] = None  # (log file, offset) the next poll reads from
        #: (first, last) LSN ranges compacted into a snapshot before they could be shown.
        self.skipped: List[Tuple[int, int]] = []

    def poll(self) -> List[Record]:
        """Every complete record that appeared since the last poll (possibly none)."""
        found: List[Record] = []
        logs = list_logs(self.directory)  # before the snapshots: compaction writes one before unlinking
        snaps = list_snapshots(self.directory)
        if not logs:
            return found
        covered = max(snaps[0][0] if snaps else 0, self.expected - 1)
        scan = Scan(self.directory, after_lsn=self.expected - 1, covered_lsn=covered, logs=logs,
                    start=self.position)
        try:
            for rec in scan.records():
                if rec.lsn > self.expected:  # the files holding these were compacted away meanwhile
                    self.skipped.append((self.expected, rec.lsn - 1))
                found.append(rec)
                self.expected = rec.lsn + 1
        except (CorruptionError, FileNotFoundError):
            # A compaction that deleted files during this pass looks like a gap or a missing
            # file; the next poll lists again from the last record shown.
            self.position = None
            if found or (list_logs(self.directory), list_snapshots(self.directory)) != (logs, snaps):
                return found  # what is found is shown; damage that stays is raised by the next poll
            raise
        if scan.tail is not None:
            self.position = (scan.tail.path, scan.tail.offset)
        elif scan.next_lsn is not None:
            self.position = (scan.logs[-1], scan.end_offset)
        return found

    def follow(self, interval: float = 0.2) -> Iterator[Record]:
        """Yield records forever, polling every ``interval`` seconds when there is nothing new."""
        while True:
            batch = self.poll()
            yield from batch
            if not batch:
                time.sleep(interval)
