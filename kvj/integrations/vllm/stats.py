"""The worker's counters, and the file that shows them: ``JOURNAL/connector.json`` (``kvj status``),
rewritten every ``STATS_EVERY`` seconds and at close."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Dict

from kvj.errors import KvjError
from kvj.fileio import atomic_write
from kvj.ops.status import CONNECTOR_STATS

log = logging.getLogger("kvj.vllm")

#: Seconds between writes of the counters.
STATS_EVERY = 10.0
#: Steps; blocks saved, journaled by reference, not journaled (kvj was behind) and the steps that
#: skipped some; blocks loaded and failed; gather rounds; segments the byte budget collected.
COUNTERS = ("steps", "blocks_saved", "blocks_referenced", "blocks_skipped", "steps_skipping", "blocks_loaded",
            "blocks_failed", "rounds", "segments_collected")


class StatsFile:
    """Writes ``counters`` (with the time, pid and rank) to the journal's stats file, on a thread of its own."""

    def __init__(self, journal: str, rank: int, counters: Dict[str, int]):
        self.path = os.path.join(journal, CONNECTOR_STATS)
        self.rank, self.counters = rank, counters
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._every, name="kvj-stats", daemon=True)
        self._thread.start()

    def _every(self) -> None:
        while not self._stop.wait(STATS_EVERY):
            self.write()

    def write(self) -> None:
        """Atomically; a failure is only logged (statistics, not the journal)."""
        try:
            doc = {"time": time.time(), "pid": os.getpid(), "rank": self.rank, **self.counters}
            atomic_write(self.path, json.dumps(doc, sort_keys=True).encode())
        except (OSError, KvjError) as exc:
            log.debug("kvj: the connector's counters were not written: %s", exc)

    def close(self) -> None:
        """Stop the thread and write the counters a last time."""
        self._stop.set()
        self._thread.join()
        self.write()
