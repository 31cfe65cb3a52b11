"""The connector's scheduler side: tracks each request and plans each step's work for the workers.

Each step's ``StepPlan``: the START of every request that arrived (scheduled yet or not), the tokens
each generated since, the blocks whose KV was computed by the end of the previous step and whose
next token is known (a preempted request's in the step that preempts it), the loads, and the
requests that finished (their blocks kept until that step gathered them). A block counts durable
once every rank reported it. ``admission="durable"``: no request is scheduled before its START is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from kvj.errors import KvjError
from kvj.integrations.vllm.compat import token_ids
from kvj.integrations.vllm.config import KvjConfig
from kvj.integrations.vllm.durable import durable_on_all_ranks, source_chains
from kvj.integrations.vllm.layout import journal_id
from kvj.integrations.vllm.plan import PARKED, Finish, Load, Save, Start, StepPlan, WorkerNews
from kvj.integrations.vllm.resuming import RESTORED, REUSED, SAMPLING, START_FORMAT
from kvj.ops.armed import armed_target
from kvj.segments.kvblock import KVBlockLayout, chain_keys
from kvj.serve.paths import cancel_marker

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvj.vllm")


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


class Scheduler:
    """Scheduler-side state of one engine: its requests, and the blocks durable on every rank."""

    def __init__(self, config: KvjConfig, layout: KVBlockLayout, tp: int, pp: int):
        self.config = config
        self._block_size = layout.block_size
        self._seed = layout.seed()
        self._ranks = set(range(layout.world))  #: the ranks that must report a block (a START, a load)
        path = config.journal
        self._durable_chains: Set[str] = durable_on_all_ranks(path, self._seed, tp, pp)
        for source in config.sources:
            self._durable_chains |= source_chains(source, self._seed, tp, pp)
        target = armed_target(path)
        if target is not None:
            log.warning("kvj: a handoff to %s is armed on %s (handoff.json, left by a drain that did not finish): "
                        "requests vLLM aborts are handed off; kvj handoff -j %s --to %s finishes it",
                        target, path, path, target)
        self._partly: Dict[str, Set[int]] = {}  #: chain -> ranks that reported it, until all have
        self._engine = os.urandom(4).hex()  #: prefixes this engine's journal ids
        self._requests: Dict[str, _Tracked] = {}
        self._arrived: List[Start] = []
        self._finishing: List[Finish] = []
        self._leftover = StepPlan()  #: saves and tokens of requests that finished

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

    def held(self) -> StepPlan:
        """What the workers' next step must journal whatever it computes: the requests that arrived
        or finished since the last step, the finished ones' last blocks, and new tokens."""
        plan = StepPlan(starts=self._arrived, finishes=self._finishing, saves=self._leftover.saves,
                                    tokens=self._leftover.tokens)
        self._arrived, self._finishing, self._leftover = [], [], StepPlan()
        for tracked in self._requests.values():
            self._tokens(tracked, plan)
        return plan

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> StepPlan:
        plan = self.held()
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
        """Learn the workers' news; blocks that failed to load are recomputed by vLLM: save them again."""
        news = connector_output.kv_connector_worker_meta
        if isinstance(news, WorkerNews):
            self.learn(news)
        invalid = connector_output.invalid_block_ids or set()
        for tracked in self._requests.values() if invalid else ():
            failed = [b for block_id, b in tracked.loaded.items() if block_id in invalid]
            if failed:
                tracked.next_save = min(tracked.next_save, min(failed))

    def learn(self, news: WorkerNews) -> None:
        """Accumulate the ranks' reports: a block or START counts once every rank reported it, a
        load by the tokens every rank loaded; a block lost on any rank is dropped for all."""
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

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Its last blocks, tokens and finish go out at the next step, which gathers its blocks before
        vLLM frees them. Reports the tokens the connector loaded, and those vLLM's prefix cache held."""
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
        restored = min(tracked.restored.get(rank, 0) for rank in self._ranks)  # every rank loaded
        return True, {RESTORED: restored, REUSED: tracked.local_hit}


def _served_abort(journal: str, client: str) -> str:
    """How a kvj serve request that vLLM aborted ends: "cancelled" when kvj serve cancelled it (its
    cancel marker, removed here), else parked: it stays in flight and the next kvj serve continues it."""
    try:
        os.unlink(cancel_marker(journal, client))
        return "cancelled"
    except FileNotFoundError:
        return PARKED
    except (OSError, KvjError):
        log.warning("kvj: the cancel marker of %r cannot be read: its request is parked", client)
        return PARKED
