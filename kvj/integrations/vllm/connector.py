"""A vLLM KV connector that journals every request, generated token and filled KV block through kvj.

Load it out of tree with a journal directory (docs/vllm.md has the whole story)::

    KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"journal": "/var/lib/kvj/serve"})

vLLM makes one per role: the scheduler side (``scheduler``) plans each step; each worker
(``worker``) carries the plan out from ``handle_preemptions``, which vLLM (0.32 to 0.34) calls at
the start of every step before the forward pass. Under tensor or pipeline parallelism each rank
journals its own shard in ``JOURNAL/rank-T-P/``. What it refuses is in ``config.refusal``; what
differs between vLLM releases, in ``compat``.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform

from kvj.errors import KvjError
from kvj.integrations.vllm.compat import SLEEP_MODE, Runner, check_version, find_runner
from kvj.integrations.vllm.config import KvjConfig, refusal
from kvj.integrations.vllm.layout import block_layout, model_identity, worker_ranks
from kvj.integrations.vllm.plan import StepPlan, WorkerNews
from kvj.integrations.vllm.scheduler import Scheduler
from kvj.integrations.vllm.worker import WorkerJournal
from kvj.journal import ranks as rank_journals

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvjConnector", "KvjConnectorMetadata", "KvjWorkerMetadata"]

logger = init_logger(__name__)

#: Scheduler sides of this process, by journal: where the scheduler and the worker share a process
#: (an in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM shuts the worker down first,
#: and it takes over what the scheduler still holds for a step that will not come.
_SCHEDULERS: "weakref.WeakValueDictionary[str, Scheduler]" = weakref.WeakValueDictionary()


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


class KvjConnector(KVConnectorBase_V1):
    """Journal vLLM's requests, tokens and KV blocks through kvj; load them back (module docstring).
    By role it holds a ``scheduler`` (``scheduler.Scheduler``) or a ``worker`` (``worker.WorkerJournal``)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_version()
        self.config = c = KvjConfig.from_extra(self._extra_config())
        why = refusal(vllm_config, kv_cache_config)
        if why is not None:
            raise KvjError(why)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kvj: kv_load_failure_policy is %r; with 'recompute' a block that fails "
                           "verification is recomputed instead of failing its request",
                           self._kv_transfer_config.kv_load_failure_policy)
        pc = vllm_config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        why = rank_journals.refusal(c.journal, tp, pp)
        if why is not None:
            raise KvjError(f"kvj: {why}")
        rank_journals.claim(c.journal, tp, pp)  # before any rank journal exists
        tp_rank, pp_rank = worker_ranks(tp, pp) if role == KVConnectorRole.WORKER else (0, 0)
        self.layout = block_layout(vllm_config, model_identity(vllm_config, c), tp_rank, pp_rank)
        if role == KVConnectorRole.SCHEDULER:
            if current_platform.is_cpu() and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
                logger.warning("kvj: vLLM's CPU backend reserves one more core for a KV connector; with few "
                               "cores that leaves its scheduler none: set VLLM_CPU_NUM_OF_RESERVED_CPU=1")
            self.scheduler = _SCHEDULERS[c.journal] = Scheduler(c, self.layout, tp, pp)
        else:
            mine = [rank_journals.rank_journal(d, tp_rank, pp_rank, tp, pp) for d in (c.journal, *c.sources)]
            self.worker = WorkerJournal(mine[0], self.layout, codec=c.codec, threads=c.threads,
                                        load_threads=c.load_threads, gather_bytes=c.gather_bytes,
                                        staging_bytes=c.staging_bytes, max_store_bytes=c.max_store_bytes,
                                        sources=mine[1:])
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

    def on_new_request(self, request: "Request") -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvjConnectorMetadata:
        return KvjConnectorMetadata(**vars(self.scheduler.build_connector_meta(scheduler_output)))

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self.scheduler.request_finished(request, block_ids)


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
        """Loads started in ``handle_preemptions``; here, once vLLM made this step's samplers, resumed
        seeded requests' are brought to where they stopped (``compat.Runner.advance``)."""
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
        """In an in-process engine, what its scheduler side still holds: no step will carry it."""
        scheduler = _SCHEDULERS.get(self.config.journal)
        return scheduler.held() if scheduler is not None else None

    def shutdown(self) -> None:
        """The worker journals what is still held for it and drains everything queued."""
        if self._role == KVConnectorRole.WORKER:
            self.worker.close()
