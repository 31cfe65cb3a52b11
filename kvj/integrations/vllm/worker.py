"""The worker side of kvj's vLLM connector, without vLLM: carries out each step's ``StepPlan``.

vLLM calls, in each worker process: ``register`` (its caches), ``step`` and ``start_loads`` at the
start of every step before the forward pass, ``poll`` / ``load_errors`` / ``news`` after it, and
``close`` at shutdown (or the interpreter's exit: what was queued is drained). ``step`` journals the
STARTs, TOKENS and ENDs (an END after its request's segments, on kvj's threads) and hands the saves
to ``saves``; loads go through ``loads``. The serving thread never waits on kvj (docs/vllm.md, "The
serving thread"): memory is bounded and made once (``buffers``), slots are polled, and when kvj is
behind blocks are not journaled rather than the step delayed. A failed write or fsync stops
journaling for good, logged once; serving goes on either way.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from concurrent.futures import Future, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

import kvj
from kvj.errors import KvjError
from kvj.fileio import CountedFS
from kvj.integrations.vllm.buffers import GATHER_BYTES, STAGING_BYTES, Buffers
from kvj.integrations.vllm.cpus import Placement
from kvj.integrations.vllm.durable import DurableBlocks
from kvj.integrations.vllm.loads import Loads
from kvj.integrations.vllm.plan import PARKED, Finish, StepPlan, WorkerNews
from kvj.integrations.vllm.saves import Saves
from kvj.integrations.vllm.upkeep import BUDGET_EVERY, COUNTERS, STATS_EVERY, Budget, Every, write_stats
from kvj.journal.config import default_store_path
from kvj.segments.flusher import Flusher
from kvj.segments.kvblock import KVBlockLayout
from kvj.segments.store import SegmentStore

log = logging.getLogger("kvj.vllm")


class WorkerJournal:
    """One worker's journal: carries out the connector's step plans (module docstring)."""

    def __init__(self, path: str, layout: KVBlockLayout, *, codec: str = "auto", threads: Optional[int] = None,
                 load_threads: Optional[int] = None, gather_bytes: int = GATHER_BYTES,
                 staging_bytes: int = STAGING_BYTES, max_store_bytes: Optional[int] = None,
                 budget_every: float = BUDGET_EVERY, sources: Sequence[str] = ()):
        cpus = os.cpu_count() or 1
        self.layout = layout
        #: every file operation of the journal and the store, counted (the benchmark's fsyncs per step)
        self.fs = CountedFS()
        self.blocks = DurableBlocks(path, layout.seed(), layout.rank, sources)
        # loads are counted (kvj status: the hit rate) and every load or reference is a use (the budget's LRU)
        store = SegmentStore(default_store_path(path), fs=self.fs, threads=threads or cpus, count_loads=True)
        self.journal = kvj.Journal.open(path, store=store, fs=self.fs)
        self.stats: Dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.buffers = Buffers(gather_bytes, staging_bytes)
        # More flush workers than cores: a worker waiting for its fsync uses no CPU (see Flusher).
        flusher = Flusher(store, workers=max(4, 2 * (threads or cpus)), codec=codec, staging_bytes=staging_bytes)
        self.saves = Saves(self.journal, layout, self.buffers, self.blocks, flusher, self.stats, self._fail)
        self.loads = Loads(self.journal, layout, self.buffers, self.blocks, self.stats, load_threads or min(8, cpus))
        self._placement: Optional[Placement] = None
        self._starts: List[Tuple[str, Union[int, "Future[int]"]]] = []  #: (vLLM id, LSN of its START)
        self._ending: Set["Future[Any]"] = set()
        self._sent: Set[str] = set()  #: finished requests whose blocks vLLM may free
        self._lock = threading.Lock()
        self._failed: Optional[BaseException] = None
        self._closed = False
        #: what the last step before closing must journal, when someone else holds it (see close)
        self.last_plan: Optional[Callable[[], Optional[StepPlan]]] = None
        # Drained at interpreter exit before the thread pools stop taking work (threading's
        # exit hooks run before atexit's, newest first: after concurrent.futures' own).
        threading._register_atexit(_close_at_exit, weakref.ref(self))  # type: ignore[attr-defined]
        self._path = path
        self._background = [Every("kvj-stats", STATS_EVERY, self._write_stats)]
        if max_store_bytes is not None:
            self._background.append(Every("kvj-budget", budget_every,
                                          Budget(path, store, max_store_bytes, self.stats), now=True))

    def register(self, caches: Sequence[torch.Tensor]) -> None:
        """The per-layer paged caches, in layer order; refused unless they fit the block layout.
        Allocates the host staging (pinned for a device cache) now, never during a step."""
        self.layout.check_caches(caches)
        self._placement = Placement()  # of the calling thread: vLLM's bound compute thread
        self._placement.place()
        self.buffers.register(caches, self.layout.nbytes)

    def step(self, plan: StepPlan) -> None:
        """Journal the plan's starts, tokens, saves and finishes."""
        self.stats["steps"] += 1
        if self._failed is None:
            try:
                for s in plan.starts:
                    self._starts.append((s.vllm_id, self.journal.start(s.jid, None, s.tokens, s.meta)))
                for jid, at, ids in plan.tokens:
                    self.journal.tokens(jid, at, ids)
                self.saves.save(plan.saves)
            except (KvjError, OSError) as exc:
                self._fail(exc)
        for fin in plan.finishes:  # released even when journaling has stopped
            self._finish(fin)
        if self._placement is not None:
            self._placement.place()

    def _finish(self, fin: Finish) -> None:
        """END once the request's segments are recorded; its blocks may go back to vLLM now."""
        self._sent.add(fin.vllm_id)
        saved = self.saves.recorded(fin.jid)
        if self._failed is not None:
            return
        with self._lock:
            self._ending.add(saved)
        saved.add_done_callback(lambda f: self._end(fin, f))

    def _end(self, fin: Finish, saved: "Future[None]") -> None:
        try:
            if saved.exception() is not None:
                self._fail(saved.exception())  # type: ignore[arg-type]
            if self._failed is None and fin.status != PARKED:  # parked: no END, it stays in flight
                for earlier in fin.resumes:
                    self.journal.end(earlier, "resumed")
                if fin.to is not None:
                    self.journal.handoff(fin.jid, fin.to)
                else:
                    self.journal.end(fin.jid, fin.status)
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._lock:
                self._ending.discard(saved)

    def _fail(self, exc: BaseException) -> None:
        """A failed write or fsync is final: log it once, stop journaling, keep serving."""
        with self._lock:
            first = self._failed is None
            if first:
                self._failed = exc
        if first:
            log.error("kvj: journaling stopped, nothing after this is durable: %s", exc)

    @property
    def failed(self) -> Optional[BaseException]:
        return self._failed

    def counters(self) -> Dict[str, int]:
        """What this worker did so far (``upkeep.COUNTERS``), as ``kvj status`` shows it."""
        return dict(self.stats)

    def _write_stats(self) -> None:
        write_stats(self._path, self.layout.rank, self.stats)

    def start_loads(self, plan: StepPlan) -> None:
        """Queue the plan's loads (``loads``)."""
        self.loads.start(plan.loads)

    def poll(self) -> Tuple[Set[str], Set[str]]:
        """Finished sends (blocks vLLM may free) and finished loads, for vLLM's ``get_finished``."""
        recving = self.loads.poll()
        sending, self._sent = self._sent, set()
        return sending, recving

    def load_errors(self) -> Set[int]:
        return self.loads.errors()

    def news(self) -> Optional[WorkerNews]:
        """What happened since the last call: blocks now durable or lost, STARTs durable, loads done."""
        durable_lsn = self.journal.durable_lsn
        started, waiting = [], []
        for vllm_id, lsn in self._starts:
            if isinstance(lsn, Future):
                lsn = lsn.result() if lsn.done() and lsn.exception() is None else lsn
            (started if isinstance(lsn, int) and lsn <= durable_lsn else waiting).append((vllm_id, lsn))
        self._starts = waiting
        news = self.blocks.take_news()
        news.started = {vllm_id: [self.layout.rank] for vllm_id, _ in started}
        return news if news else None

    def drain(self) -> None:
        """Wait until everything queued so far is durable: segments, their records, ENDs."""
        try:
            self.saves.drain()
        except OSError as exc:
            self._fail(exc)
        while True:
            with self._lock:
                ending = list(self._ending)
            if not ending:
                break
            wait(ending)
        if self._failed is None:
            try:
                self.journal.sync()
            except (KvjError, OSError) as exc:
                self._fail(exc)

    def close(self) -> None:
        """Carry out ``last_plan()`` if set, drain, then stop kvj's threads and close the journal
        (vLLM's shutdown; the interpreter's exit)."""
        if self._closed:
            return
        self._closed = True
        try:
            plan = self.last_plan() if self.last_plan is not None else None
            if plan is not None:
                self.step(plan)
            self.drain()
        finally:
            for thread in self._background:
                thread.close()
            self.saves.close()
            self.loads.close()
            self.saves.flusher.close()
            try:
                self.journal.close()
            except (KvjError, OSError) as exc:
                self._fail(exc)
            finally:
                self.journal.store.close()
                self.blocks.close()
                self._write_stats()


def _close_at_exit(ref: Callable[[], Optional[WorkerJournal]]) -> None:
    """At exit: an engine process that exits without vLLM's shutdown still drains what it queued."""
    worker = ref()
    if worker is not None:
        worker.close()
