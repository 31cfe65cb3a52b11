"""The worker side of kvj's vLLM connector, without vLLM: what each engine step journals and loads.

``KvjConnector`` (``kvj.integrations.vllm``) builds a :class:`StepPlan` per step on the
scheduler side; in each worker process a :class:`WorkerJournal` carries it out. Nothing here
imports vLLM, so the same code runs under kvj's CUDA stand-in in the tests and on a GPU
machine without vLLM. The hooks, in the order vLLM 0.32 calls them in ``execute_model``:

``step(plan)`` (from ``handle_preemptions``, at the start of every step, zero-token steps
included, before the forward pass):

* START records of the requests that arrived (whether scheduled yet or not), TOKENS records of
  the tokens each request generated since the last step, and END of the requests that finished
  (queued behind their segments, on kvj's threads);
* the saves: every block named was computed by the end of the previous step. A block already
  durable (loaded, or saved for another request) is journaled again by reference. The others
  go through **one gather** per round: one indexed copy (one per layer unless the layers share
  one allocation), on the compute stream, into a slot of a small ring of device buffers, so
  that any later kernel that overwrites a block (a finished or preempted request's) is ordered
  after it; for a device cache, then **one copy** into a slot of pinned host staging on kvj's
  side stream, which the compute stream never waits for. **One job** per round on kvj's
  thread then waits for that copy and hands the slot to the flusher, which compresses, writes
  and fsyncs the blocks in place and journals each SEGMENT record once its segment is durable;
  the slot is free again after that. A finished request's blocks can go back to vLLM once
  their gather is enqueued: it is reported ``finished_sending`` in the same step.

The serving thread never waits on kvj (docs/vllm.md, "The serving thread"). Ring slots are
polled (``event.query()``); host staging is allocated once, at ``register``, and taken without
waiting. When kvj falls behind (no free ring slot or staging: the flusher is slower than the
engine), the step's remaining blocks are **not journaled** (``blocks_skipped``), never the step
delayed; nor is any later block of those requests, so that a request's journaled blocks stay a
prefix: it stays durable up to its last journaled block, and recovery recomputes the rest.

``start_loads(plan)`` (from ``start_load_kv``): loads are asynchronous across steps and go
through the same bounded staging, in chunks of a ring slot's blocks, whatever the prompt's
length. The blocks of each chunk are read, checked (chunk CRCs, digest, layout) and decoded by
kvj's loader threads into a staging slot; ``poll()`` (from ``get_finished``, every step) copies
a chunk in once its reads are done (one copy to the device, one scatter), and its slot is free
again once that copy is; a request is reported ``finished_recving`` once all its chunks are in,
with its failed blocks (the first that failed and all after it) reported by ``load_errors()``
in the same pass (vLLM recomputes them).

Memory is bounded and made once: ``gather_bytes`` of device buffers, made on the first step
that needs them (if the device has no room, vLLM may have taken it all, steps' blocks are not
journaled and loads are recomputed; tried again every ``ROOM_RETRY`` seconds), and
``staging_bytes`` of host staging for saves and as much for loads (pinned for a device cache),
at ``register`` (if the host cannot give it: nothing is journaled or loaded, with a warning).
A failed write or fsync stops journaling for good, logged once. Serving goes on either way.
``close()`` (vLLM's shutdown, and the interpreter's exit) drains everything queued. Every
``STATS_EVERY`` seconds and at close the counters go to ``JOURNAL/connector.json``, which
``kvj status`` shows.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

import kvj
from kvj.errors import DeviceOutOfMemory, KvjError, LayoutMismatch, SegmentCorrupt
from kvj.fileio import FS, atomic_write
from kvj.journal.config import default_store_path
from kvj.ops.status import CONNECTOR_STATS
from kvj.segments import device
from kvj.segments import tensors as seg
from kvj.segments import kvblock, segfile
from kvj.segments.flusher import Flusher
from kvj.segments.kvblock import KVBlockLayout
from kvj.segments.staging import SlotPool
from kvj.segments.store import SegmentInfo, SegmentStore

log = logging.getLogger("kvj.vllm")

#: Default bounds: the device buffers (a ring of ``RING_SLOTS``) and each host staging pool
#: (one for saves, one for loads), in bytes.
GATHER_BYTES = 64 << 20
STAGING_BYTES = 512 << 20
RING_SLOTS = 4
#: Seconds between tries to make the device buffers once the device had no room for them (a
#: failed device allocation makes torch free its cache, which synchronizes the device).
ROOM_RETRY = 60.0
#: Seconds between writes of the counters to ``JOURNAL/connector.json``, and between warnings
#: that blocks were not journaled.
STATS_EVERY = 10.0
#: Seconds between the worker's compactions under a byte budget (``max_store_bytes``).
BUDGET_EVERY = 300.0


# ---------------------------------------------------------------------------- what a step carries


@dataclass
class Start:
    vllm_id: str
    jid: str
    tokens: List[int]
    meta: Dict[str, Any]


@dataclass
class Save:
    jid: str
    block: int  #: index of the block in the request
    block_id: int  #: where it sits in the paged cache
    chain: str
    token_ids: List[int]  #: the block's tokens and the next one


@dataclass
class Load:
    vllm_id: str
    blocks: List[Tuple[int, str]]  #: (block id, chain key), in order from the request's first loaded block


#: A ``Finish`` status that journals nothing: the request stays in flight (kvj serve resumes it).
PARKED = "parked"


@dataclass
class Finish:
    vllm_id: str
    jid: str
    status: str
    resumes: List[str]  #: earlier incarnations it carries, ended "resumed" before it
    to: Optional[str] = None  #: with status "handoff": the engine that continues it (a HANDOFF record, not an END)


@dataclass
class StepPlan:
    """One step's work for the workers (the connector's metadata)."""

    starts: List[Start] = field(default_factory=list)
    tokens: List[Tuple[str, int, List[int]]] = field(default_factory=list)  #: (journal id, position, ids)
    saves: List[Save] = field(default_factory=list)
    loads: List[Load] = field(default_factory=list)
    finishes: List[Finish] = field(default_factory=list)
    reseeds: Dict[str, int] = field(default_factory=dict)  #: vLLM id -> sampler draws to replay


@dataclass
class WorkerNews:
    """Worker to scheduler, each step, each keyed by the ranks it holds for: ``durable`` maps a
    chain key to the ranks that made their shard of it durable, ``started`` a vLLM request id to
    the ranks whose START of it is durable, ``loaded`` a vLLM request id to the tokens each rank
    loaded for it. A block, a START or a load counts only once every rank has reported it (the
    scheduler accumulates across steps: ranks report in different steps); ``aggregate`` (vLLM's,
    over the workers of one step) is the union."""

    durable: Dict[str, List[int]] = field(default_factory=dict)
    lost: List[str] = field(default_factory=list)  #: chain keys that failed to load (on any rank)
    started: Dict[str, List[int]] = field(default_factory=dict)  #: vLLM id -> ranks with its START durable
    loaded: Dict[str, Dict[int, int]] = field(default_factory=dict)  #: vLLM id -> rank -> tokens loaded

    def merge(self, other: "WorkerNews") -> None:
        for chain, ranks in other.durable.items():
            self.durable[chain] = sorted(set(self.durable.get(chain, [])) | set(ranks))
        self.lost += [c for c in other.lost if c not in self.lost]
        for rid, ranks in other.started.items():
            self.started[rid] = sorted(set(self.started.get(rid, [])) | set(ranks))
        for rid, by_rank in other.loaded.items():
            mine = self.loaded.setdefault(rid, {})
            for rank, n in by_rank.items():
                mine[rank] = mine.get(rank, 0) + n

    def __bool__(self) -> bool:
        return bool(self.durable or self.lost or self.started or self.loaded)


# ---------------------------------------------------------------------------- helpers


class CountingFS(FS):
    """The real file layer, counting fsyncs (``kvj bench vllm`` reports them per step)."""

    def __init__(self) -> None:
        self.fsyncs = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.fsyncs += 1

    def fsync(self, fd: int) -> None:
        self._count()
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self._count()
        super().fdatasync(fd)

    def fsync_dir(self, path: Any) -> None:
        self._count()
        super().fsync_dir(path)


def when_all(futures: Sequence["Future[Any]"]) -> "Future[None]":
    """A future done once all of ``futures`` are; it fails with the first of their errors."""
    done: "Future[None]" = Future()
    left = [len(futures)]
    lock = threading.Lock()
    errors: List[BaseException] = []

    def one(f: "Future[Any]") -> None:
        if f.exception() is not None:
            errors.append(f.exception())  # type: ignore[arg-type]
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done.set_exception(errors[0]) if errors else done.set_result(None)

    if not futures:
        done.set_result(None)
    for f in futures:
        f.add_done_callback(one)
    return done


def durable_blocks(state: "kvj.JournalState", seed: str) -> Dict[str, Dict[str, Any]]:
    """chain key -> {"key", "layout"} of every KV block segment of this chain seed in the journal
    (its requests', and its prefix cache's: blocks of requests that ended, ``JournalState.cache``)."""
    found: Dict[str, Dict[str, Any]] = {}
    refs = [ref for req in state.requests.values() for ref in req.segments.values()] + list(state.cache.values())
    for ref in refs:
        lay = ref.layout or {}
        if ref.key and lay.get("seed") == seed and lay.get("chain") and lay.get("format") == kvblock.FORMAT:
            found[lay["chain"]] = {"key": ref.key, "layout": lay}
    return found


#: A load chunk's states: waiting for a staging slot, its blocks being read, read and checked
#: (waiting for a ring slot), copying into the cache, done (its slot given back).
QUEUED, READING, READ, COPYING, DONE = range(5)


@dataclass(eq=False)
class _Chunk:
    start: int  #: its blocks are the load's [start, end)
    end: int
    state: int = QUEUED
    slot: Optional[torch.Tensor] = None
    reads: List["Future[SegmentInfo]"] = field(default_factory=list)
    good: int = 0  #: blocks of it to copy in (once READ)
    copy: Optional[device.Transfer] = None


@dataclass(eq=False)
class _Loading:
    load: Load
    chunks: List[_Chunk]
    failed: Optional[int] = None  #: the first block not loaded (it and all after it are errors)


# ---------------------------------------------------------------------------- the worker journal


class WorkerJournal:
    """One worker's journal: carries out the connector's step plans (module docstring)."""

    def __init__(self, path: str, layout: KVBlockLayout, *, codec: str = "auto", threads: Optional[int] = None,
                 load_threads: Optional[int] = None, gather_bytes: int = GATHER_BYTES,
                 staging_bytes: int = STAGING_BYTES, max_store_bytes: Optional[int] = None,
                 budget_every: float = BUDGET_EVERY, sources: Sequence[str] = ()):
        cpus = os.cpu_count() or 1
        self.layout = layout
        self.seed = layout.seed()
        self.fs = CountingFS()
        #: other engines' journals' stores, read-only: blocks of theirs this worker may load (a handoff)
        self._sources: List[SegmentStore] = []
        self._durable: Dict[str, Dict[str, Any]] = {}
        for source in sources:
            found = durable_blocks(kvj.replay(source), self.seed) if os.path.isdir(source) else {}
            if found:
                ro = SegmentStore(default_store_path(source), threads=1)
                self._sources.append(ro)
                self._durable.update({chain: {**entry, "store": ro} for chain, entry in found.items()})
        state = kvj.replay(path) if os.path.isdir(path) else kvj.JournalState()
        self._durable.update(durable_blocks(state, self.seed))
        # loads are counted (kvj status: the hit rate) and every load or reference is a use (the budget's LRU)
        store = SegmentStore(default_store_path(path), fs=self.fs, threads=threads or cpus, count_loads=True)
        self.journal = kvj.Journal.open(path, store=store, fs=self.fs)
        # More flush workers than cores: a worker waiting for its fsync uses no CPU (see Flusher).
        self._flusher = Flusher(store, workers=max(4, 2 * (threads or cpus)), codec=codec,
                                staging_bytes=staging_bytes)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvj-save")
        self._loader = ThreadPoolExecutor(max_workers=load_threads or min(8, cpus), thread_name_prefix="kvj-load")
        self._path = path
        self._gather_bytes, self._staging_bytes = int(gather_bytes), int(staging_bytes)
        self._per_round = 1  #: blocks one gather (or load chunk) takes (set by ``register``)
        self._ring_slots = 1
        #: host staging for saves and for loads, made by ``register`` (None: the host had no room)
        self._save_slots: Optional[SlotPool] = None
        self._load_slots: Optional[SlotPool] = None
        self._ids_host: Optional[torch.Tensor] = None  #: the ring's block ids on the host
        self._ring: Optional[device.BlockRing] = None  #: buffers on the caches' device, made on first use
        self._no_room_at: Optional[float] = None  #: when the last try to make them failed
        self._gaps: Dict[str, int] = {}  #: journal id -> its first block not journaled (kvj was behind)
        self._skip_warned = 0.0
        self._caches: List[torch.Tensor] = []
        self._on_device = False
        self._spare: Set[int] = set()  #: CPUs for kvj's threads (see _place_threads)
        self._placed: Set[int] = set()
        self._threads = 0
        #: (chain, next token) -> a durable segment holding that block: journaled again by reference
        self._known: Dict[Tuple[str, int], SegmentInfo] = {}
        self._pending: Dict[str, List["Future[Any]"]] = {}  #: journal id -> its saves not yet recorded
        self._ending: Set["Future[Any]"] = set()
        self._starts: List[Tuple[str, Union[int, "Future[int]"]]] = []
        self._loading: List[_Loading] = []
        self._load_errors: Set[int] = set()
        self._sent: Set[str] = set()  #: finished requests whose blocks vLLM may free
        self._news = WorkerNews()
        self._lock = threading.Lock()
        self._failed: Optional[BaseException] = None
        self._closed = False
        #: what the last step before closing must journal, when someone else holds it (see close)
        self.last_plan: Optional[Callable[[], Optional[StepPlan]]] = None
        self.stats = {"steps": 0, "blocks_saved": 0, "blocks_referenced": 0, "blocks_skipped": 0,
                      "blocks_loaded": 0, "blocks_failed": 0, "bytes_raw": 0, "bytes_stored": 0, "tokens": 0,
                      "rounds": 0, "segments_collected": 0, "steps_skipping": 0}
        self._rounds: Set["Future[None]"] = set()  #: jobs on kvj's save thread not yet done
        #: (LSN or its future, tokens, blocks) of records not yet known durable: ``progress``
        self._marks: Deque[Tuple[Union[int, "Future[int]"], int, int]] = deque()
        self._durable_tokens = self._durable_blocks = self._gathered = 0
        # Drained at interpreter exit before the thread pools stop taking work (threading's
        # exit hooks run before atexit's, newest first: after concurrent.futures' own).
        threading._register_atexit(_close_at_exit, weakref.ref(self))  # type: ignore[attr-defined]
        self._stop = threading.Event()
        self._budget: Optional[threading.Thread] = None
        if max_store_bytes is not None:
            self._budget = threading.Thread(target=self._keep_budget, args=(path, max_store_bytes, budget_every),
                                            name="kvj-budget", daemon=True)
            self._budget.start()
        self._reporter = threading.Thread(target=self._report_every, name="kvj-stats", daemon=True)
        self._reporter.start()

    def _keep_budget(self, path: str, max_store_bytes: int, every: float) -> None:
        """At start and every ``every`` seconds, compact the journal and evict what the store holds
        beyond ``max_store_bytes`` (``kvj compact --max-store-bytes``; nothing in flight is evicted).
        A compaction already running (cron) is left to finish; another failure is logged once."""
        from kvj.errors import JournalLocked
        from kvj.ops.compact import compact

        warned = False
        while not self._stop.is_set():
            try:
                result = compact(path, self.journal.store, max_store_bytes=max_store_bytes)
                self.stats["segments_collected"] += len(result.segments_removed) + len(result.segments_evicted)
            except JournalLocked:
                pass
            except (KvjError, OSError) as exc:
                if not warned:
                    log.warning("kvj: keeping the store within %d bytes failed (serving goes on): %s",
                                max_store_bytes, exc)
                    warned = True
            self._stop.wait(every)

    def _report_every(self) -> None:
        """Every ``STATS_EVERY`` seconds, the counters to ``JOURNAL/connector.json`` (``kvj status``)."""
        while not self._stop.wait(STATS_EVERY):
            self._report()

    def _report(self) -> None:
        """Write the counters (``counters()``) with the time, atomically; a failure is only logged
        (they are statistics, not the journal)."""
        try:
            doc = {"time": time.time(), "pid": os.getpid(), "rank": self.layout.rank, **self.counters()}
            atomic_write(os.path.join(self._path, CONNECTOR_STATS), json.dumps(doc, sort_keys=True).encode())
        except (OSError, KvjError) as exc:
            log.debug("kvj: the connector's counters were not written: %s", exc)

    # ------------------------------------------------------------------ caches

    def register(self, caches: Sequence[torch.Tensor]) -> None:
        """The per-layer paged caches, in layer order; refused unless they fit the block layout.
        Allocates the host staging (pinned for a device cache) now, never during a step."""
        self.layout.check_caches(caches)
        self._caches = list(caches)
        self._on_device = device.CUDA.is_device_tensor(self._caches[0])
        self._spare = spare_cpus()
        self._threads = 0
        self._place_threads()
        nbytes = self.layout.nbytes
        ring = RING_SLOTS if self._on_device else 1  # on the CPU a gather is done when it returns
        self._per_round = max(1, min(self._gather_bytes // ring, self._staging_bytes) // nbytes)
        slots = max(1, self._staging_bytes // (self._per_round * nbytes))
        try:
            self._save_slots = SlotPool(self._per_round * nbytes, slots, pinned=self._on_device)
            self._load_slots = SlotPool(self._per_round * nbytes, slots, pinned=self._on_device)
            if self._on_device:
                self._ids_host = device.CUDA.pinned(ring * self._per_round * 8).view(torch.long)
        except DeviceOutOfMemory as exc:
            self._save_slots = self._load_slots = None
            log.warning("kvj: %s: nothing is journaled nor loaded (serving goes on); lower staging_bytes", exc)
        self._ring_slots = ring

    # ------------------------------------------------------------------ each step, before the forward

    def step(self, plan: StepPlan) -> None:
        """Journal the plan's starts, tokens, saves and finishes (module docstring)."""
        self.stats["steps"] += 1
        if self._failed is None:
            try:
                for s in plan.starts:
                    self._starts.append((s.vllm_id, self.journal.start(s.jid, None, s.tokens, s.meta)))
                    self._pending.setdefault(s.jid, [])
                for jid, at, ids in plan.tokens:
                    lsn = self.journal.tokens(jid, at, ids)
                    self.stats["tokens"] += len(ids)
                    with self._lock:
                        self._marks.append((lsn, len(ids), 0))
                self._save(plan.saves)
            except (KvjError, OSError) as exc:
                self._fail(exc)
        for fin in plan.finishes:  # released even when journaling has stopped
            self._finish(fin)
        self._place_threads()

    def _place_threads(self) -> None:
        """Run kvj's threads on the CPUs the engine's compute threads are not bound to (vLLM's
        CPU backend binds its worker to some cores and reserves the others for helpers such
        as a KV connector; its threads would otherwise inherit the compute cores). Threads
        are made as work comes: checked every step, cheaply."""
        if not self._spare or threading.active_count() == self._threads:
            return
        self._threads = threading.active_count()
        for t in threading.enumerate():
            if t.name.startswith("kvj-") and t.native_id is not None and t.native_id not in self._placed:
                try:
                    os.sched_setaffinity(t.native_id, self._spare)
                except OSError:  # gone, or those CPUs are not ours after all
                    pass
                self._placed.add(t.native_id)

    def _save(self, saves: Sequence[Save]) -> None:
        """Gather the blocks not yet durable in rounds, as long as a ring slot and staging are
        free; then journal the durable ones by reference. Every block at or after a request's
        first skipped one is skipped too: its journaled blocks stay a prefix."""
        copies: List[Save] = []
        refs: List[Tuple[Save, SegmentInfo]] = []
        skipped = 0
        for save in saves:
            known = self._known.get((save.chain, save.token_ids[-1]))
            if known is not None:
                refs.append((save, known))
            elif self._gapped(save):
                skipped += self._skip(save)
            else:
                copies.append(save)
        for i in range(0, len(copies), self._per_round):
            if not self._gather_round(copies[i:i + self._per_round]):
                for save in copies[i:]:
                    skipped += self._skip(save)
                break
        for save, known in refs:
            if self._gapped(save):
                skipped += self._skip(save)
                continue
            self._pending.setdefault(save.jid, []).append(self._writer.submit(self._reference, save, known))
            self.stats["blocks_referenced"] += 1
            with self._lock:  # its segment is durable: this rank holds it (again, after a loss elsewhere)
                self._durable[save.chain] = {"key": known.key, "layout": known.layout}
                self._news.durable[save.chain] = [self.layout.rank]
        if skipped:
            self.stats["steps_skipping"] += 1
            now = time.monotonic()
            if now - self._skip_warned >= STATS_EVERY:
                self._skip_warned = now
                log.warning("kvj: behind the engine, %d block(s) of this step not journaled (%d in all); those "
                            "requests stay durable up to their last journaled block", skipped,
                            self.stats["blocks_skipped"])

    def _gapped(self, save: Save) -> bool:
        """Whether ``save`` comes at or after a block of its request that was not journaled."""
        gap = self._gaps.get(save.jid)
        return gap is not None and save.block >= gap

    def _skip(self, save: Save) -> int:
        """Count ``save`` not journaled; no later block of its request will be. Returns 1."""
        self._gaps[save.jid] = min(save.block, self._gaps.get(save.jid, save.block))
        self.stats["blocks_skipped"] += 1
        return 1

    def _take_ring(self) -> Union[device.BlockBuffers, None, bool]:
        """A free slot of the device buffers, made on first use; None when every slot is busy
        (a poll: never waits); False when the device has no room for them (vLLM may have taken
        it all: warned, and tried again after ``ROOM_RETRY`` seconds)."""
        if self._ring is None:
            now = time.monotonic()
            if self._no_room_at is not None and now - self._no_room_at < ROOM_RETRY:
                return False
            try:
                self._ring = device.BlockRing(self._caches, self._per_round, self._ring_slots, self._ids_host)
            except DeviceOutOfMemory as exc:
                if self._no_room_at is None:
                    log.warning("kvj: %s: blocks of steps are not journaled (nor loaded) until there is room; "
                                "lower gpu_memory_utilization or gather_bytes", exc)
                self._no_room_at = now
                return False
            self._no_room_at = None
        return self._ring.take()

    def _gather_round(self, saves: Sequence[Save]) -> bool:
        """One gather of ``saves``' blocks, and one job for kvj's thread to write them; False
        (nothing done) when no staging slot or ring slot is free: kvj is behind."""
        n, lay = len(saves), self.layout
        slot = self._save_slots.take() if self._save_slots is not None else None
        if slot is None:
            return False
        bufs = self._take_ring()
        if not bufs:
            self._save_slots.give(slot)  # type: ignore[union-attr]
            return False
        host = slot[:n * lay.nbytes].view(lay.torch_dtype).view(n, *lay.shape)
        try:
            moved = device.gather_blocks(self._caches, [s.block_id for s in saves], host, bufs)
        except BaseException:
            self._save_slots.give(slot)  # type: ignore[union-attr]  # raises only once nothing writes it
            raise
        done: "Future[None]" = Future()
        for s in saves:
            self._pending.setdefault(s.jid, []).append(done)
        self.stats["rounds"] += 1
        self._gathered += n
        job = self._writer.submit(self._write_round, slot, host, moved, list(saves), done)
        with self._lock:
            self._rounds.add(job)
        job.add_done_callback(self._round_done)
        return True

    def _round_done(self, job: "Future[None]") -> None:
        with self._lock:
            self._rounds.discard(job)

    def _write_round(self, slot: torch.Tensor, host: torch.Tensor, moved: device.Transfer, saves: List[Save],
                     done: "Future[None]") -> None:
        """On kvj's thread: wait for the round's copy, hand the blocks to the flusher where they
        are (one pack); the staging slot is free again once the flusher is done with them."""
        pool = self._save_slots
        assert pool is not None
        landed = False
        try:
            moved.wait()
            landed = True
            layouts = [self.layout.segment_layout(save.token_ids, save.chain) for save in saves]
            # one pack: one fdatasync makes the step's blocks durable together, each its own segment
            written = self._flusher.submit_many(host, layouts, lambda infos: self._saved_many(saves, infos))
        except BaseException as exc:
            pool.give(slot, reuse=landed)
            self._fail(exc)
            done.set_exception(exc)
            return
        self.stats["blocks_saved"] += len(saves)

        def written_out(f: "Future[Any]") -> None:
            pool.give(slot)
            _settle(done, f)
        written.add_done_callback(written_out)

    def _reference(self, save: Save, known: SegmentInfo) -> None:
        """On kvj's thread: claim ``known``'s segment (a use: compaction now keeps it through its
        grace period) and journal the block by reference; a segment gone meanwhile is not journaled
        (the block is recomputed after a crash)."""
        if not self.journal.store.claim_existing(known.key):  # the journal gives the claim back once recorded
            with self._lock:
                self._known.pop((save.chain, save.token_ids[-1]), None)
            self.stats["blocks_skipped"] += 1
            return
        self.journal.store.note_use(known.key)
        start = save.block * self.layout.block_size
        self.journal.flush(save.jid, save.block, token_range=(start, start + self.layout.block_size), info=known)

    def _saved_many(self, saves: List[Save], infos: List[SegmentInfo]) -> None:
        for save, info in zip(saves, infos):
            self._saved(save, info)

    def _saved(self, save: Save, info: SegmentInfo) -> None:
        """On a flusher thread, once the block's segment is durable: its record, and tell the scheduler."""
        start = save.block * self.layout.block_size
        lsn = self.journal.flush(save.jid, save.block, token_range=(start, start + self.layout.block_size), info=info)
        with self._lock:
            self._marks.append((lsn, 0, 1))
            self._known[(save.chain, save.token_ids[-1])] = info
            self._durable[save.chain] = {"key": info.key, "layout": info.layout}
            self._news.durable[save.chain] = [self.layout.rank]
            self.stats["bytes_raw"] += info.raw_size
            self.stats["bytes_stored"] += info.stored_size

    def _finish(self, fin: Finish) -> None:
        """END once the request's segments are recorded; its blocks may go back to vLLM now."""
        self._sent.add(fin.vllm_id)
        self._gaps.pop(fin.jid, None)
        pending = self._pending.pop(fin.jid, [])
        if self._failed is not None:
            return
        ending = when_all(pending)
        with self._lock:
            self._ending.add(ending)
        ending.add_done_callback(lambda f: self._end(fin, f))

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
        """What this worker did so far: steps, blocks saved, referenced, skipped (not journaled:
        kvj was behind) and the steps that skipped some, blocks loaded and failed, bytes raw and
        stored, tokens journaled, gather rounds, fsyncs (store and journal)."""
        return {**self.stats, "fsyncs": self.fs.fsyncs}

    # ------------------------------------------------------------------ loads

    def start_loads(self, plan: StepPlan) -> None:
        """Queue the plan's loads, in chunks of a ring slot's blocks; their reads start as
        staging slots are free (never waiting for one)."""
        for load in plan.loads:
            n, per = len(load.blocks), self._per_round
            ld = _Loading(load, [_Chunk(i, min(n, i + per)) for i in range(0, n, per)])
            if self._load_slots is None:  # no staging: vLLM computes them all
                self._fail_load(ld, 0, None)
            self._loading.append(ld)
        self._start_reads()

    def _start_reads(self) -> None:
        """Start the reads of queued chunks, in arrival order, while staging slots are free."""
        pool, lay = self._load_slots, self.layout
        for ld in self._loading:
            for ch in ld.chunks:
                if ch.state != QUEUED or ld.failed is not None:
                    continue
                slot = pool.take() if pool is not None else None
                if slot is None:
                    return  # started once earlier chunks give their slots back
                ch.slot, ch.state = slot, READING
                read = self._read_block if self._on_device else self._read_into_cache
                ch.reads = [self._loader.submit(read, chain, slot[k * lay.nbytes:(k + 1) * lay.nbytes], block_id)
                            for k, (block_id, chain) in enumerate(ld.load.blocks[ch.start:ch.end])]

    def _read_into_cache(self, chain: str, out: torch.Tensor, block_id: int) -> SegmentInfo:
        """On a loader thread, for caches on the CPU: ``_read_block``, then the block into its
        slot of every layer, here (vLLM touches none of a loading request's blocks before the
        load is reported finished; a block after a failed one is written but reported an error,
        and computed again)."""
        info = self._read_block(chain, out)
        block = out.view(self.layout.torch_dtype).view(self.layout.shape)
        torch._foreach_copy_([cache[block_id] for cache in self._caches], list(block.unbind(0)))  # one dispatch
        return info

    def _read_block(self, chain: str, out: torch.Tensor, block_id: int = -1) -> SegmentInfo:
        """On a loader thread: read, verify (chunk CRCs, digest, layout) and decode one block into ``out``."""
        with self._lock:
            entry = self._durable.get(chain)
        if entry is None:
            raise SegmentCorrupt(chain, None, "no durable block of this chain")
        key, layout = entry["key"], entry["layout"]
        self.layout.check(layout, f"segment {key}")
        store = entry.get("store") or self.journal.store  # another engine's, read-only: never touched
        with store.counted_load(key), store.backend.open(key) as src:  # read by chunk straight into ``out``
            header = segfile.read_header(src, key=key)
            if header.layout != layout or tuple(header.shape) != self.layout.shape or header.dtype != self.layout.dtype:
                raise LayoutMismatch(f"segment {src.name} holds {header.dtype} {header.shape} {header.layout}, "
                                     f"the journal says {self.layout.shape} {layout}")
            seg.decode_into(src, out, name=src.name, max_raw=store.max_segment_bytes, header=header)
        return SegmentInfo.from_header(header)

    def poll(self) -> Tuple[Set[str], Set[str]]:
        """Finished sends (blocks vLLM may free) and finished loads, for vLLM's ``get_finished``:
        a load is finished once the copies of all its chunks into the cache are done (polled,
        never waited for)."""
        recving: Set[str] = set()
        still: List[_Loading] = []
        for ld in self._loading:
            if not self._advance(ld):
                still.append(ld)
                continue
            recving.add(ld.load.vllm_id)
            good = len(ld.load.blocks) if ld.failed is None else ld.failed
            with self._lock:
                by_rank = self._news.loaded.setdefault(ld.load.vllm_id, {})
                by_rank[self.layout.rank] = by_rank.get(self.layout.rank, 0) + good * self.layout.block_size
        self._loading = still
        self._start_reads()
        sending, self._sent = self._sent, set()
        return sending, recving

    def _advance(self, ld: _Loading) -> bool:
        """Move ``ld``'s chunks on as far as they go without waiting; True once all are done.
        Chunks are checked in order (the first failed block ends what is loaded); any chunk
        read and checked is copied in as soon as a ring slot is free."""
        in_order = True  # every earlier chunk has been checked
        for ch in ld.chunks:
            if ch.state == READING and all(f.done() for f in ch.reads):
                if ld.failed is not None:  # after a failed block: read, but not used
                    self._forget_lost(ld, ch)
                    self._give_chunk(ch)
                elif in_order:
                    self._check_chunk(ld, ch)
            if ch.state == READ:
                if ld.failed is not None:
                    ch.good = max(0, min(ch.good, ld.failed - ch.start))
                bufs = self._take_ring() if ch.good and self._on_device else None
                if bufs is False:  # no room on the device: vLLM computes this chunk and the rest
                    self._fail_load(ld, ch.start, None)
                    ch.good = 0
                if not ch.good:
                    self._give_chunk(ch)
                elif not self._on_device:  # the loader threads put the blocks in already
                    self.stats["blocks_loaded"] += ch.good
                    self._give_chunk(ch)
                elif bufs:
                    ids = [b for b, _ in ld.load.blocks[ch.start:ch.start + ch.good]]
                    host = ch.slot[:ch.good * self.layout.nbytes].view(self.layout.torch_dtype)  # type: ignore[index]
                    ch.copy = device.scatter_blocks(self._caches, ids, host.view(ch.good, *self.layout.shape), bufs)
                    ch.state = COPYING
                    self.stats["blocks_loaded"] += ch.good
            if ch.state == COPYING and ch.copy is not None and ch.copy.done():  # later work on any stream sees it
                self._give_chunk(ch)
            in_order = in_order and ch.state not in (QUEUED, READING)
        return all(ch.state == DONE for ch in ld.chunks)

    def _check_chunk(self, ld: _Loading, ch: _Chunk) -> None:
        """A chunk's reads are done: its blocks up to the load's first failed one are to be copied."""
        for k, read in enumerate(ch.reads):
            exc = read.exception()
            if exc is not None:
                chain = ld.load.blocks[ch.start + k][1]
                log.warning("kvj: block %s not loaded (%s); vLLM recomputes it and what follows", chain[:16], exc)
                self._fail_load(ld, ch.start + k, ch)
                break
            chain = ld.load.blocks[ch.start + k][1]
            info = read.result()
            with self._lock:
                if "store" not in self._durable.get(chain, {}):  # a source's block is saved here anew
                    self._known[(chain, int(info.layout["token_ids"][-1]))] = info
            ch.good = k + 1
        ch.state = READ

    def _fail_load(self, ld: _Loading, first: int, ch: Optional[_Chunk]) -> None:
        """Block ``first`` of the load and all after it are not loaded: load errors (vLLM
        recomputes them); chunks not started never are. ``ch``: the chunk whose read failed."""
        ld.failed = first
        ids = [b for b, _ in ld.load.blocks[first:]]
        self._load_errors.update(ids)
        self.stats["blocks_failed"] += len(ids)
        if ch is not None:
            self._forget_lost(ld, ch)
        for other in ld.chunks:
            if other.state == QUEUED:
                other.state = DONE

    def _forget_lost(self, ld: _Loading, ch: _Chunk) -> None:
        """The blocks of ``ch`` whose read failed are no longer durable here (news: lost)."""
        for k, read in enumerate(ch.reads):
            if read.done() and read.exception() is not None:
                chain = ld.load.blocks[ch.start + k][1]
                with self._lock:
                    self._durable.pop(chain, None)
                    if chain not in self._news.lost:
                        self._news.lost.append(chain)

    def _give_chunk(self, ch: _Chunk) -> None:
        """``ch`` is done: nothing reads or writes its slot any more."""
        if ch.slot is not None and self._load_slots is not None:
            self._load_slots.give(ch.slot)
        ch.slot, ch.state = None, DONE

    def load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ to the scheduler

    def news(self) -> Optional[WorkerNews]:
        """What happened since the last call: blocks now durable or lost, STARTs durable, loads done."""
        durable_lsn = self.journal.durable_lsn
        started, waiting = [], []
        for vllm_id, lsn in self._starts:
            if isinstance(lsn, Future):
                lsn = lsn.result() if lsn.done() and lsn.exception() is None else lsn
            (started if isinstance(lsn, int) and lsn <= durable_lsn else waiting).append((vllm_id, lsn))
        self._starts = waiting
        with self._lock:
            news, self._news = self._news, WorkerNews()
        news.started = {vllm_id: [self.layout.rank] for vllm_id, _ in started}
        return news if news else None

    def progress(self) -> Dict[str, int]:
        """How far durability has come (``kvj bench vllm``): tokens journaled and durable, blocks
        gathered and durable (segment and record), and the backlog in between."""
        durable_lsn = self.journal.durable_lsn
        with self._lock:
            while self._marks:
                lsn, tokens, blocks = self._marks[0]
                if isinstance(lsn, Future):
                    if not lsn.done() or lsn.exception() is not None:
                        break
                    lsn = lsn.result()
                if lsn > durable_lsn:
                    break
                self._marks.popleft()
                self._durable_tokens += tokens
                self._durable_blocks += blocks
            return {"tokens": self.stats["tokens"], "tokens_durable": self._durable_tokens,
                    "blocks_gathered": self._gathered, "blocks_durable": self._durable_blocks,
                    "backlog_blocks": self._gathered - self._durable_blocks}

    # ------------------------------------------------------------------ end

    def drain(self) -> None:
        """Wait until everything queued so far is durable: segments, their records, ENDs."""
        with self._lock:
            rounds = list(self._rounds)
        wait(rounds)  # every round handed to the flusher
        try:
            self._flusher.drain()
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
            self._stop.set()
            self._reporter.join()
            if self._budget is not None:
                self._budget.join()
            self._writer.shutdown(wait=True)
            self._loader.shutdown(wait=True)
            self._flusher.close()
            try:
                self.journal.close()
            except (KvjError, OSError) as exc:
                self._fail(exc)
            finally:
                self.journal.store.close()
                for ro in self._sources:
                    ro.close()
                self._report()


def spare_cpus() -> Set[int]:
    """The CPUs this process may run on that the calling thread is not bound to: empty unless
    the caller is bound to some (as vLLM's CPU worker binds its compute threads)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    mine = os.sched_getaffinity(0)
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective", encoding="ascii") as f:
            allowed = _cpu_list(f.read())
    except (OSError, ValueError):
        allowed = set(range(os.cpu_count() or 1))
    return allowed - mine if mine < allowed else set()


def _cpu_list(text: str) -> Set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set."""
    cpus: Set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _settle(done: "Future[None]", f: "Future[Any]") -> None:
    exc = f.exception()
    done.set_exception(exc) if exc is not None else done.set_result(None)


def _close_at_exit(ref: Callable[[], Optional[WorkerJournal]]) -> None:
    """At exit: an engine process that exits without vLLM's shutdown still drains what it queued."""
    worker = ref()
    if worker is not None:
        worker.close()
