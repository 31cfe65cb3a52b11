"""A vLLM KV connector that journals every request, generated token and filled KV block through kvj.

Load it out of tree (``kv_connector_module_path``) with a journal directory::

    KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"journal": "/var/lib/kvj/serve"})

After a crash, ``kvj recover`` and :func:`resume` (``kvj.integrations.vllm.resuming``, which
imports without vLLM) continue every request that was in flight. Without a crash, :func:`drain`
(``kvj.integrations.vllm.handoff``) hands live requests to another engine, whose
``"sources": [JOURNAL]`` lets it load this one's blocks read-only.

**Scheduler side** (one per engine) plans each step (``build_connector_meta``, a
:class:`~kvj.integrations.vllm.worker.StepPlan`): the START of every request that arrived
since the last step (on arrival, scheduled yet or not: ``on_new_request``), the tokens each
request generated since (so tokens are durable within the journal's commit window, whatever
the KV), the blocks to save, the blocks to load and the requests that finished. A block is
saved once its KV was computed by the end of the previous step (``num_computed_tokens`` when
the step is planned, before vLLM adds the step's own tokens) and its next token is known; a
preempted request's blocks computed but not yet saved go out in the step that preempts it,
before anything overwrites them. A finished request keeps its blocks for one more step
(``request_finished`` returns True): the step that gathers its last blocks reports it
``finished_sending`` and vLLM frees them; its END is journaled after its segments, on kvj's
threads. ``admission="durable"`` makes vLLM wait to schedule a request until the worker
reports its START durable (``get_num_new_matched_tokens`` answers None until then).

**Worker side** (one per worker process) carries the plan out through
:class:`~kvj.integrations.vllm.worker.WorkerJournal`, from ``handle_preemptions``, which vLLM
(0.32 to 0.34, either model runner) calls at the start of every ``execute_model`` (zero-token
steps included), before the forward pass: a step's saves are one gather on the compute stream,
one copy to pinned staging on a side stream the compute stream never waits for, one job for
kvj's flusher.
Loads are asynchronous across steps (``load_async``); the worker verifies every block and
reports failures through ``get_block_ids_with_load_errors`` (with ``recompute`` vLLM
recomputes them). A resumed seeded request's sampler continues where it stopped: the connector
finds the model runner once (a caller of ``register_kv_caches``: ``compat.find_runner``). Under
Model Runner V1 it advances the request's ``torch.Generator`` by the draws it had made, with the
very draw vLLM's sampler makes per token (vLLM offers no hook to set it); Model Runner V2 keys
its noise on the seed and the token's absolute position, which a resumed request keeps, so
there is nothing to do. A runner it cannot recognise is named in one warning.

**Keys.** Block ``b`` is named by ``chain[b] = BLAKE3(chain[b-1] || its token ids)``, from a
seed that is the block layout's rank-free identity (model weights, dtype, KV cache dtype,
geometry, block size, tensor- and pipeline-parallel sizes: ``kvj.segments.kvblock``), so a
block only ever loads into the model and layout it came from. The weights' digest is computed once and kept
beside the journal (``vllm-model-digests.json``, keyed by each file's size, mtime and inode);
a hub id is named with its resolved revision.

**Tensor and pipeline parallelism.** vLLM builds one worker connector per rank; each journals
its own shard of every block (its rank and pipeline stage are in each segment's layout and
checked on load) in a journal of its own, ``JOURNAL/rank-T-P/`` (``kvj.journal.ranks``: ranks
are separate processes and a journal has one writer). The scheduler names blocks for all ranks
(the chain seed is rank-free) and counts a block durable only once every rank has reported
its shard durable (reports accumulate across steps: ranks report in different steps); at
start-up, only blocks durable in every rank's journal. A lost block on any rank drops it for
all, and vLLM recomputes it on all. Every rank journals every request's START, TOKENS and END
(its END after its own segments). ``kvj recover -j JOURNAL`` recovers every rank's journal
and writes one manifest whose resume position per request is the minimum over the ranks.

**Refused at start-up**, with one line naming what: data parallel size other than 1 (each
data-parallel engine needs a journal of its own: give each engine its own), a journal of
another parallel layout, several KV cache groups (hybrid attention), MLA, speculative
decoding, and KV cache dtypes other than the model's and fp8. Sleep mode (vLLM 0.33 and
later) is refused through ``supports_sleep_mode`` (``compat.SLEEP_MODE``). What differs
between the vLLM releases supported lives in ``compat``.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE as _STR_DTYPES

import kvj
from kvj.errors import InvalidArgument, KvjError
from kvj.journal import ranks as rank_journals
from kvj.segments import kvblock
from kvj.segments.kvblock import chain_keys
from kvj.integrations.vllm.compat import SLEEP_MODE, SUPPORTED_VLLM, Runner, check_version, find_runner, token_ids
from kvj.serve.paths import cancel_marker
from kvj.integrations.vllm.handoff import armed_target, drain
from kvj.integrations.vllm.layout import FP8, block_layout, journal_id, model_identity, worker_ranks
from kvj.integrations.vllm.resuming import RESTORED, REUSED, SAMPLING, START_FORMAT, Resumed, ResumePlan, resume, resume_plans
from kvj.integrations.vllm.worker import (
    GATHER_BYTES,
    STAGING_BYTES,
    Finish,
    Load,
    Save,
    Start,
    StepPlan,
    WorkerJournal,
    WorkerNews,
    durable_blocks,
)

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvjConnector", "KvjConnectorMetadata", "KvjWorkerMetadata", "ResumePlan", "Resumed", "resume", "drain",
           "resume_plans", "SUPPORTED_VLLM", "START_FORMAT"]

logger = init_logger(__name__)

_ADMISSIONS = ("arrival", "durable")
#: Scheduler-side connectors of this process, by journal: where the scheduler and the worker share
#: a process (an in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM shuts the worker
#: down first, and it takes over what the scheduler still holds for a step that will not come.
_SCHEDULERS: "weakref.WeakValueDictionary[str, KvjConnector]" = weakref.WeakValueDictionary()


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class KvjConfig:
    """``kv_connector_extra_config``, checked."""

    journal: str
    model_id: Optional[str] = None  #: names the weights instead of their digest
    codec: str = "auto"
    threads: Optional[int] = None  #: compression threads (default: the host's cores)
    load_threads: Optional[int] = None
    gather_bytes: int = GATHER_BYTES  #: device buffer a step's blocks are gathered into
    staging_bytes: int = STAGING_BYTES  #: host staging for saves, and for loads
    admission: str = "arrival"  #: "durable": no request starts before its START is durable
    max_store_bytes: Optional[int] = None  #: the store's byte budget (each worker keeps its store within it)
    #: other engines' journals whose durable blocks this one may load, read-only (a handoff's source)
    sources: Tuple[str, ...] = ()

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "KvjConfig":
        if not extra.get("journal"):
            raise KvjError('KvjConnector needs kv_connector_extra_config={"journal": DIR}')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(f"kv_connector_extra_config: unknown key {unknown[0]!r} "
                                  f"(known: {', '.join(sorted(known))})")
        for name in ("threads", "load_threads", "gather_bytes", "staging_bytes"):
            value = extra.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgument(f"kv_connector_extra_config[{name!r}] must be a positive integer, not {value!r}")
        budget = extra.get("max_store_bytes")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise InvalidArgument(f"kv_connector_extra_config['max_store_bytes'] must be a non-negative integer, "
                                  f"not {budget!r}")
        if extra.get("admission", "arrival") not in _ADMISSIONS:
            raise InvalidArgument(f"kv_connector_extra_config['admission'] must be one of {_ADMISSIONS}")
        journal = os.path.abspath(str(extra["journal"]))
        sources = extra.get("sources") or ()
        if isinstance(sources, str) or not all(isinstance(d, (str, os.PathLike)) for d in sources):
            raise InvalidArgument("kv_connector_extra_config['sources'] must be a list of journal directories")
        sources = tuple(os.path.abspath(os.fspath(d)) for d in sources)
        if journal in sources:
            raise InvalidArgument(f"kv_connector_extra_config['sources'] names the engine's own journal {journal}")
        return cls(**{**{k: v for k, v in extra.items() if v is not None}, "journal": journal, "sources": sources})


def refusal(vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> Optional[str]:
    """Why the connector cannot journal this engine's KV, in one line; None when it can."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    unsupported = []
    if pc.data_parallel_size != 1:
        unsupported.append(f"data parallel size {pc.data_parallel_size} (only 1: run each engine with a journal "
                           "of its own)")
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
        unsupported.append(f"{len(kv_cache_config.kv_cache_groups)} KV cache groups (hybrid attention)")
    if getattr(mc, "use_mla", False):
        unsupported.append("MLA attention")
    if vllm_config.speculative_config is not None:
        unsupported.append("speculative decoding")
    if cc.cache_dtype not in ("auto", *FP8) and _STR_DTYPES.get(cc.cache_dtype) != mc.dtype:
        unsupported.append(f"KV cache dtype {cc.cache_dtype!r} (only the model's, or {', '.join(FP8)})")
    if not unsupported:
        return None
    return "kvj's vLLM connector does not support " + "; ".join(unsupported)


# ---------------------------------------------------------------------------- metadata


@dataclass
class KvjConnectorMetadata(StepPlan, KVConnectorMetadata):
    """One step's work for the workers (see ``StepPlan``)."""


@dataclass
class KvjWorkerMetadata(WorkerNews, KVConnectorWorkerMetadata):
    """Worker to scheduler, each step (see ``WorkerNews``)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvjWorkerMetadata":
        assert isinstance(other, KvjWorkerMetadata)
        out = KvjWorkerMetadata()
        out.merge(self)
        out.merge(other)
        return out


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    request: "Request"
    jid: str
    start_durable: bool = False
    start_ranks: Set[int] = field(default_factory=set)  #: ranks whose START of it is durable
    journaled: int = 0  #: its tokens carried by its START and TOKENS records
    next_save: int = 0  #: blocks below this have been sent to the worker to save
    computed: int = 0  #: tokens computed by the end of the last step it was scheduled in
    block_ids: List[int] = field(default_factory=list)  #: as of that step
    chains: List[str] = field(default_factory=list)
    load: Optional[Load] = None  #: planned, for the next step
    loaded: Dict[int, int] = field(default_factory=dict)  #: block id -> block index, of its last load
    local_hit: int = 0  #: vLLM's own prefix-cache hit, block-aligned, when last asked
    restored: Dict[int, int] = field(default_factory=dict)  #: rank -> tokens it loaded for it


# ---------------------------------------------------------------------------- the connector


class KvjConnector(KVConnectorBase_V1):
    """Journal vLLM's requests, tokens and KV blocks through kvj; load them back (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_version()
        self.config = KvjConfig.from_extra(self._extra_config())
        why = refusal(vllm_config, kv_cache_config)
        if why is not None:
            raise KvjError(why)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kvj: kv_load_failure_policy is %r; with 'recompute' a block that fails "
                           "verification is recomputed instead of failing its request",
                           self._kv_transfer_config.kv_load_failure_policy)
        self._block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        why = rank_journals.refusal(self.config.journal, tp, pp)
        if why is not None:
            raise KvjError(f"kvj: {why}")
        rank_journals.claim(self.config.journal, tp, pp)  # before any rank journal exists
        tp_rank, pp_rank = worker_ranks(tp, pp) if role == KVConnectorRole.WORKER else (0, 0)
        self.layout = block_layout(vllm_config, model_identity(vllm_config, self.config), tp_rank, pp_rank)
        self._seed = self.layout.seed()
        #: the ranks that must report a block (a START, a load) before it counts
        self._ranks = set(range(self.layout.world))
        if role == KVConnectorRole.SCHEDULER:
            if current_platform.is_cpu() and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
                logger.warning("kvj: vLLM's CPU backend reserves one more core for a KV connector; with few "
                               "cores that leaves its scheduler none: set VLLM_CPU_NUM_OF_RESERVED_CPU=1")
            path = self.config.journal
            self._durable_chains: Set[str] = durable_on_all_ranks(path, self._seed, tp, pp)
            for source in self.config.sources:
                self._durable_chains |= source_chains(source, self._seed, tp, pp)
            target = armed_target(path)
            if target is not None:
                logger.warning("kvj: a handoff to %s is armed on %s (handoff.json, left by a drain that did not "
                               "finish): requests vLLM aborts are handed off; kvj handoff -j %s --to %s finishes it",
                               target, path, path, target)
            self._partly: Dict[str, Set[int]] = {}  #: chain -> ranks that reported it, until all have
            self._engine = os.urandom(4).hex()  #: prefixes this engine's journal ids
            self._requests: Dict[str, _Tracked] = {}
            self._arrived: List[Start] = []
            self._finishing: List[Finish] = []
            self._leftover = StepPlan()  #: saves and tokens of requests that finished
            _SCHEDULERS[path] = self
        else:
            c = self.config
            self.worker = WorkerJournal(rank_journals.rank_journal(c.journal, tp_rank, pp_rank, tp, pp), self.layout,
                                        codec=c.codec, threads=c.threads,
                                        load_threads=c.load_threads, gather_bytes=c.gather_bytes,
                                        staging_bytes=c.staging_bytes, max_store_bytes=c.max_store_bytes,
                                        sources=[rank_journals.rank_journal(d, tp_rank, pp_rank, tp, pp)
                                                 for d in c.sources])
            self.worker.last_plan = self._last_plan
            self._finished_seen: Set[str] = set()
            self._unreported: Set[str] = set()
            self._runner: Optional[Runner] = None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        """No: vLLM (0.33 and later) then refuses sleep mode, which remaps the KV cache under kvj's views."""
        return SLEEP_MODE

    def _extra_config(self) -> Mapping[str, Any]:
        """``kv_connector_extra_config`` (a subclass may keep keys of its own out of it)."""
        return self._kv_transfer_config.kv_connector_extra_config

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: "Request") -> None:
        """Track it and journal its START at the next step, scheduled or not."""
        tracked = _Tracked(request, journal_id(request.request_id, self._engine))
        self._requests[request.request_id] = tracked
        start = self._start(tracked)
        self._arrived.append(start)
        tracked.journaled = len(start.tokens)

    def _start(self, tracked: _Tracked) -> Start:
        request = tracked.request
        params = request.sampling_params
        extra = (params.extra_args or {}) if params is not None else {}
        prompt = token_ids(request.prompt_token_ids)
        sampling = {k: getattr(params, k, None) for k in SAMPLING} if params is not None else {}
        # What vLLM stops on (check_stop): its EOS unless ignore_eos, and stop_token_ids.
        # all_stop_token_ids also holds the EOS of a request that ignores it.
        stops = set(params.stop_token_ids or ()) | {params.eos_token_id} if params is not None else set()
        meta = {"stop_ids": sorted(t for t in stops if t is not None), "format": START_FORMAT,
                "vllm_id": request.request_id, "seed": self._seed, "block_size": self._block_size,
                "sampling": sampling,
                "max_tokens": int(extra.get("kvj_max_tokens", params.max_tokens if params else 0) or 0),
                "prompt_len": int(extra.get("kvj_prompt_len", len(prompt))), "resumes": extra.get("kvj_resumes")}
        if extra.get("kvj_from"):  # handed off: the journal it continues from (its ``resumes`` are ids there)
            meta["from"] = str(extra["kvj_from"])
        if extra.get("kvj_client"):  # kvj serve's reply this request produces (kvj.serve)
            meta["client"] = str(extra["kvj_client"])
        return Start(request.request_id, tracked.jid, prompt, meta)

    def _chains(self, tracked: _Tracked) -> List[str]:
        tokens = tracked.request.all_token_ids
        if len(tracked.chains) < len(tokens) // self._block_size:
            tracked.chains = chain_keys(self._seed, tokens, self._block_size, tracked.chains)
        return tracked.chains

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """The longest prefix of whole blocks that are durable, loaded asynchronously. With
        ``admission="durable"``: None (ask again) until the request's START is durable."""
        tracked = self._requests[request.request_id]
        if self.config.admission == "durable" and not tracked.start_durable:
            return None, False
        usable = (request.num_tokens - 1) // self._block_size  # vLLM computes at least the last token
        tracked.local_hit = num_computed_tokens
        matched = 0
        for chain in self._chains(tracked)[:usable]:
            if chain not in self._durable_chains:
                break
            matched += 1
        external = max(0, matched * self._block_size - num_computed_tokens)
        return external, external > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        tracked = self._requests[request.request_id]
        (block_ids,) = blocks.get_block_ids()
        first = tracked.local_hit // self._block_size
        end = first + num_external_tokens // self._block_size
        chains = self._chains(tracked)
        tracked.load = Load(request.request_id, [(block_ids[b], chains[b]) for b in range(first, end)])
        tracked.loaded = {block_ids[b]: b for b in range(first, end)}

    def _held(self) -> KvjConnectorMetadata:
        """What the workers' next step must journal whatever it computes: the requests that arrived
        or finished since the last step, the finished ones' last blocks, and new tokens."""
        plan = KvjConnectorMetadata(starts=self._arrived, finishes=self._finishing, saves=self._leftover.saves,
                                    tokens=self._leftover.tokens)
        self._arrived, self._finishing, self._leftover = [], [], StepPlan()
        for tracked in self._requests.values():
            self._tokens(tracked, plan)
        return plan

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvjConnectorMetadata:
        plan = self._held()
        for tracked in self._requests.values():
            if tracked.load is not None:
                plan.loads.append(tracked.load)
                tracked.load = None
        for req_id in scheduler_output.preempted_req_ids or ():  # its blocks are free again: save them now
            tracked = self._requests.get(req_id)
            if tracked is not None:
                plan.saves += self._saves(tracked, tracked.block_ids, tracked.computed)
        new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        block_state = scheduler_output.kv_connector_block_state
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            (block_ids,) = block_state.resolve_block_ids(req_id)
            computed = tracked.request.num_computed_tokens  # by the end of the previous step
            plan.saves += self._saves(tracked, block_ids, computed)
            tracked.computed, tracked.block_ids = computed + scheduled, list(block_ids)
            params = tracked.request.sampling_params
            draws = ((params.extra_args or {}).get("kvj_draws") if params is not None else None) or 0
            if req_id in new and draws and params.seed is not None:
                plan.reseeds[req_id] = int(draws)
        return plan

    def _tokens(self, tracked: _Tracked, plan: StepPlan) -> None:
        """Its tokens not journaled yet (those it generated since the last step)."""
        tokens = tracked.request.all_token_ids
        if len(tokens) > tracked.journaled:
            plan.tokens.append((tracked.jid, tracked.journaled, token_ids(tokens[tracked.journaled:])))
            tracked.journaled = len(tokens)

    def _saves(self, tracked: _Tracked, block_ids: Sequence[int], computed: int) -> List[Save]:
        """Blocks whose KV is computed (``computed`` tokens) and whose next token is known."""
        tokens = tracked.request.all_token_ids
        bs = self._block_size
        saves = []
        chains = self._chains(tracked)
        while ((tracked.next_save + 1) * bs <= computed and len(tokens) > (tracked.next_save + 1) * bs
               and tracked.next_save < len(block_ids)):
            b = tracked.next_save
            saves.append(Save(tracked.jid, b, block_ids[b], chains[b], token_ids(tokens[b * bs:(b + 1) * bs + 1])))
            tracked.next_save += 1
        return saves

    def update_connector_output(self, connector_output: Any) -> None:
        """Learn the blocks that became durable (on every rank) or failed to load, the STARTs
        that are durable and the tokens loaded; blocks that failed to load are recomputed by
        vLLM: save them again once they are."""
        news = connector_output.kv_connector_worker_meta
        if isinstance(news, KvjWorkerMetadata):
            self.learn(news)
        invalid = connector_output.invalid_block_ids or set()
        for tracked in self._requests.values() if invalid else ():
            failed = [b for block_id, b in tracked.loaded.items() if block_id in invalid]
            if failed:
                tracked.next_save = min(tracked.next_save, min(failed))

    def learn(self, news: WorkerNews) -> None:
        """Accumulate the ranks' reports: a block or a START counts once every rank has reported
        it, a load by the tokens every rank loaded; a block lost on any rank is dropped for all."""
        for chain, ranks in news.durable.items():
            seen = self._partly.setdefault(chain, set())
            seen.update(ranks)
            if self._ranks <= seen:
                self._durable_chains.add(chain)
                del self._partly[chain]
        for chain in news.lost:
            self._durable_chains.discard(chain)
            self._partly.pop(chain, None)
        for req_id, ranks in news.started.items():
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.start_ranks.update(ranks)
                tracked.start_durable = self._ranks <= tracked.start_ranks
        for req_id, by_rank in news.loaded.items():
            tracked = self._requests.get(req_id)
            for rank, n in by_rank.items() if tracked is not None else ():
                tracked.restored[rank] = tracked.restored.get(rank, 0) + n

    def _restored(self, tracked: _Tracked) -> int:
        """Tokens whose KV every rank loaded for it."""
        return min(tracked.restored.get(rank, 0) for rank in self._ranks)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Its last blocks and tokens go out with its finish at the next step; its blocks are
        kept until that step has gathered them. Reports the tokens the connector loaded, and those
        vLLM's own prefix cache held."""
        tracked = self._requests.pop(request.request_id, None)
        if tracked is None:
            return False, None
        self._leftover.saves += self._saves(tracked, block_ids, request.num_computed_tokens)
        self._tokens(tracked, self._leftover)
        extra = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
        status = request.status.name.lower().replace("finished_", "")
        # what it resumes is ended here only if it was in flight here (not if another engine's)
        resumes = [r for r in str(extra.get("kvj_resumes") or "").split(",") if r] if not extra.get("kvj_from") else []
        target = armed_target(self.config.journal) if status == "aborted" else None  # one stat per abort
        if status == "aborted" and target is None and extra.get("kvj_client"):
            status = _served_abort(self.config.journal, str(extra["kvj_client"]))
        self._finishing.append(Finish(request.request_id, tracked.jid, "handoff" if target else status, resumes,
                                      target))
        return True, {RESTORED: self._restored(tracked), REUSED: tracked.local_hit}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Keep the per-layer caches (refusing a layout other than the keys'), and find the model
        runner whose sampler a resumed seeded request continues (one warning if it is not recognised)."""
        self.worker.register(list(kv_caches.values()))
        self._runner = find_runner()
        if self._runner.warning is not None:
            logger.warning_once(self._runner.warning)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """At the start of every step, before the forward: the step's journaling (WorkerJournal.step)."""
        assert isinstance(kv_connector_metadata, KvjConnectorMetadata)
        self.worker.step(kv_connector_metadata)
        self.worker.start_loads(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Loads run on kvj's threads (started in ``handle_preemptions``); here, after vLLM made
        this step's new requests' samplers, those of resumed seeded requests are brought to where
        they stopped (``compat.Runner.advance``)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvjConnectorMetadata)
        if meta.reseeds and self._runner is not None:
            self._runner.advance(meta.reseeds)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request is scheduled only once its blocks are in (load_async)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a step's blocks are gathered at the start of the next (handle_preemptions)

    def wait_for_save(self) -> None:
        return  # the compute stream never waits for kvj's copies

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        self._finished_seen |= finished_req_ids
        sending, recving = self.worker.poll()
        self._unreported |= sending
        done = self._unreported & self._finished_seen  # vLLM's rule: ids it told this worker about
        self._unreported -= done
        self._finished_seen -= done
        return (done or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self.worker.load_errors()

    def build_connector_worker_meta(self) -> Optional[KvjWorkerMetadata]:
        news = self.worker.news()
        if news is None:
            return None
        return KvjWorkerMetadata(news.durable, news.lost, news.started, news.loaded)

    def _last_plan(self) -> Optional[StepPlan]:
        """In an in-process engine, what its scheduler side still holds (the last finishes,
        their blocks and tokens): vLLM shuts the worker down first, and no step will carry it."""
        scheduler = _SCHEDULERS.get(self.config.journal)
        return scheduler._held() if scheduler is not None and scheduler is not self else None

    def shutdown(self) -> None:
        """The worker journals what is still held for it and drains everything queued."""
        if self._role == KVConnectorRole.WORKER:
            self.worker.close()


def _served_abort(journal: str, client: str) -> str:
    """How a kvj serve request that vLLM aborted ends: "cancelled" when kvj serve cancelled it
    (its cancel marker, removed here), else "parked": cut off by a shutdown or the engine's end,
    it stays in flight (no END) and the next ``kvj serve`` continues its reply."""
    try:
        os.unlink(cancel_marker(journal, client))
        return "cancelled"
    except FileNotFoundError:
        return "parked"
    except (OSError, KvjError):
        logger.warning("kvj: the cancel marker of %r cannot be read: its request is parked", client)
        return "parked"


def durable_on_all_ranks(path: str, seed: str, tp_size: int, pp_size: int) -> Set[str]:
    """Chain keys of this seed that every rank's journal holds a durable block of."""
    found: Optional[Set[str]] = None
    for p in range(pp_size):
        for t in range(tp_size):
            journal = rank_journals.rank_journal(path, t, p, tp_size, pp_size)
            state = kvj.replay(journal) if os.path.isdir(journal) else kvj.JournalState()
            mine = set(durable_blocks(state, seed))
            found = mine if found is None else found & mine
    return found or set()


def source_chains(source: str, seed: str, tp_size: int, pp_size: int) -> Set[str]:
    """Chain keys of this seed durable in another engine's journal (read, never written); when it
    holds blocks but none of this layout, say why in one line: nothing of it will load."""
    found = durable_on_all_ranks(source, seed, tp_size, pp_size)
    if not found:
        others = {lay.get("seed") for req in _source_states(source) for ref in req.segments.values()
                  for lay in [ref.layout or {}] if lay.get("format") == kvblock.FORMAT}
        if others:
            logger.warning("kvj: source %s holds KV blocks of another layout (model weights, dtype, block size or "
                           "parallel sizes differ: its layout seed %s, this engine's %s): none will load, its "
                           "requests are computed here", source, ",".join(sorted(map(str, others)))[:40], seed[:16])
    return found


def _source_states(source: str) -> List["kvj.RequestState"]:
    """Every request of every rank journal under ``source`` (for the one line above)."""
    journals = list(rank_journals.rank_journals(source).values()) or [source]
    return [req for j in journals if os.path.isdir(j) for req in kvj.replay(j).requests.values()]
