"""The worker's periodic background work: its counters to ``JOURNAL/connector.json`` (``kvj status``)
every ``STATS_EVERY`` seconds, and with ``max_store_bytes`` the store kept within its byte budget
(``kvj compact --max-store-bytes``, nothing in flight evicted) every ``BUDGET_EVERY`` seconds."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, Dict

from kvj.errors import JournalLocked, KvjError
from kvj.fileio import atomic_write
from kvj.ops.status import CONNECTOR_STATS
from kvj.segments.store import SegmentStore

log = logging.getLogger("kvj.vllm")

STATS_EVERY = 10.0
BUDGET_EVERY = 300.0
#: Steps; blocks saved, journaled by reference, not journaled (kvj was behind) and the steps that
#: skipped some; blocks loaded and failed; gather rounds; segments the byte budget collected.
COUNTERS = ("steps", "blocks_saved", "blocks_referenced", "blocks_skipped", "steps_skipping", "blocks_loaded",
            "blocks_failed", "rounds", "segments_collected")


class Every:
    """``work`` on a daemon thread every ``seconds`` (first at once with ``now``) until ``close``."""

    def __init__(self, name: str, seconds: float, work: Callable[[], None], now: bool = False):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(seconds, work, now), name=name, daemon=True)
        self._thread.start()

    def _run(self, seconds: float, work: Callable[[], None], now: bool) -> None:
        if now:
            work()
        while not self._stop.wait(seconds):
            work()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def write_stats(journal: str, rank: int, counters: Dict[str, int]) -> None:
    """The counters, with the time, pid and rank, atomically; a failure is only logged (statistics)."""
    try:
        doc = {"time": time.time(), "pid": os.getpid(), "rank": rank, **counters}
        atomic_write(os.path.join(journal, CONNECTOR_STATS), json.dumps(doc, sort_keys=True).encode())
    except (OSError, KvjError) as exc:
        log.debug("kvj: the connector's counters were not written: %s", exc)


class Budget:
    """One compaction of ``journal`` within ``max_bytes`` per call, counted in ``stats``; a compaction
    already running (cron) is left to finish, another failure is logged once."""

    def __init__(self, journal: str, store: SegmentStore, max_bytes: int, stats: Dict[str, int]):
        self.journal, self.store, self.max_bytes, self.stats = journal, store, max_bytes, stats
        self._warned = False

    def __call__(self) -> None:
        from kvj.ops.compact import compact

        try:
            result = compact(self.journal, self.store, max_store_bytes=self.max_bytes)
            self.stats["segments_collected"] += len(result.segments_removed) + len(result.segments_evicted)
        except JournalLocked:
            pass
        except (KvjError, OSError) as exc:
            if not self._warned:
                log.warning("kvj: keeping the store within %d bytes failed (serving goes on): %s", self.max_bytes, exc)
                self._warned = True
