"""The store's byte budget, kept by the worker in the background (``max_store_bytes``): at start and
every ``BUDGET_EVERY`` seconds, ``kvj compact --max-store-bytes`` (nothing in flight is evicted)."""

from __future__ import annotations

import logging
import threading
from typing import Dict

from kvj.errors import JournalLocked, KvjError
from kvj.segments.store import SegmentStore

log = logging.getLogger("kvj.vllm")

#: Seconds between the worker's compactions under a byte budget.
BUDGET_EVERY = 300.0


class Budget:
    """A thread compacting ``journal`` within ``max_bytes``; counts what it removed in ``stats``."""

    def __init__(self, journal: str, store: SegmentStore, max_bytes: int, stats: Dict[str, int],
                 every: float = BUDGET_EVERY):
        self.journal, self.store, self.max_bytes, self.stats, self.every = journal, store, max_bytes, stats, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="kvj-budget", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        """A compaction already running (cron) is left to finish; another failure is logged once."""
        from kvj.ops.compact import compact

        warned = False
        while not self._stop.is_set():
            try:
                result = compact(self.journal, self.store, max_store_bytes=self.max_bytes)
                self.stats["segments_collected"] += len(result.segments_removed) + len(result.segments_evicted)
            except JournalLocked:
                pass
            except (KvjError, OSError) as exc:
                if not warned:
                    log.warning("kvj: keeping the store within %d bytes failed (serving goes on): %s",
                                self.max_bytes, exc)
                    warned = True
            self._stop.wait(self.every)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
