"""A vLLM KV connector that journals every filled KV block through kvj, and resumes after a crash.

Load it out of tree (``kv_connector_module_path``) with a journal directory::

    KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"journal": "/var/lib/kvj/serve"})

**Save.** The scheduler-side connector decides, step by step, which blocks of each request are
full and whose next token is known; the worker-side connector (which owns the journal)
journals the request's START (prompt token ids and sampling settings), copies each such
block of every layer out of the paged cache after the forward pass and hands it to
``Journal.flush``, which compresses and writes it on background threads and journals its
SEGMENT record once it is durable. A finished request keeps its blocks
(``request_finished`` returns ``True``) until its segments and their records are durable;
then END is appended and the blocks are released.

**Keys.** Block ``b`` is named by ``chain[b] = BLAKE3(chain[b-1] || token ids of block b)``,
``chain[-1]`` being a fingerprint of the weights, dtype, KV cache dtype, block size,
tensor-parallel rank and KV layout, so a block only ever loads into the model and layout it
came from. Each segment's layout records the chain, the block's token ids and the one after
it (the token sampled from the block's last position: tokens the engine generated are
durable with the blocks that hold them) and the layout identity, checked again on load.

**Load.** ``get_num_new_matched_tokens`` answers the longest prefix of whole blocks that are
durable (the journal's, from ``kvj.replay`` at start-up, and those the worker reports durable
since, through vLLM's worker metadata); ``start_load_kv`` reads and verifies the step's blocks
in parallel (CRC of every chunk, the BLAKE3 digest, the layout) and copies them into the
blocks vLLM allocated, one pass per layer. A block already durable is journaled for another
request by reference, without a second copy. A block that fails is reported by ``get_block_ids_with_load_errors`` and, with
``kv_load_failure_policy="recompute"``, vLLM recomputes it; it is never used.

**Resume.** After ``kvj recover``, :func:`resume` resubmits every request that was in flight
as its prompt plus the tokens its durable blocks hold, with the rest of its token budget.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import blake3
import numpy as np
import torch
from vllm import __version__ as VLLM_VERSION
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform

import kvj
from kvj.errors import InvalidArgument, InvalidName, KvjError, LayoutMismatch, SegmentCorrupt
from kvj.journal.journal import default_store_path
from kvj.names import check_request_id
from kvj.segments import tensors as seg
from kvj.segments.flusher import Flusher
from kvj.segments.store import SegmentInfo, SegmentStore

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

#: The vLLM minor release this connector is written against (pyproject's "vllm" extra pins it).
SUPPORTED_VLLM = (0, 32)
#: Layout ``format`` of a block segment: all layers of one block in vLLM's standardized
#: per-layer view ``[num_kv_heads, block_size, 2 * head_size]`` (K and V side by side).
BLOCK_FORMAT = "kvj-vllm-block/1"
#: Start-record meta tag of requests journaled by this connector.
START_FORMAT = "kvj-vllm-request/1"
#: Sampling settings journaled with each request and restored by :func:`resume`.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "stop_token_ids", "ignore_eos",
             "detokenize")
#: Weight files whose bytes identify a local model directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _check_version() -> None:
    major_minor = tuple(int(p) for p in VLLM_VERSION.split(".")[:2] if p.isdigit())
    if major_minor != SUPPORTED_VLLM:
        raise KvjError(f"kvj's vLLM connector supports vLLM {SUPPORTED_VLLM[0]}.{SUPPORTED_VLLM[1]}.x, "
                       f"this is vLLM {VLLM_VERSION}")


def _model_identity(vllm_config: "VllmConfig", extra: Mapping[str, Any]) -> str:
    """``model_id`` from the extra config, or a BLAKE3 digest of a local model's weight files."""
    if extra.get("model_id"):
        return str(extra["model_id"])
    model = vllm_config.model_config.model
    if not os.path.isdir(model):
        return f"{model}@{vllm_config.model_config.revision or 'default'}"
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in sorted(os.listdir(model)):
        if name.endswith(_WEIGHT_SUFFIXES) or name == "config.json":
            h.update(name.encode() + b"\0")
            h.update_mmap(os.path.join(model, name))
    return "blake3:" + h.hexdigest()


def kv_identity(vllm_config: "VllmConfig", extra: Mapping[str, Any], rank: int = 0) -> Dict[str, Any]:
    """What a block's KV depends on besides its tokens; both connector roles compute the same."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = str(mc.dtype).replace("torch.", "")
    head = mc.get_head_size()
    return {"format": BLOCK_FORMAT, "model": _model_identity(vllm_config, extra), "dtype": dtype,
            "kv_dtype": dtype if cc.cache_dtype == "auto" else str(cc.cache_dtype),
            "block_size": cc.block_size, "tp_size": pc.tensor_parallel_size, "tp_rank": rank,
            "layers": mc.get_num_layers(pc),
            "block_shape": [mc.get_num_kv_heads(pc), cc.block_size, 2 * head], "view": "HNC, K|V in C"}


def fingerprint(identity: Mapping[str, Any]) -> str:
    return blake3.blake3(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def chain_keys(fp: str, token_ids: Sequence[int], block_size: int, start: Sequence[str] = ()) -> List[str]:
    """Chained block keys over the whole blocks of ``token_ids``; ``start`` continues a prefix."""
    keys = list(start)
    prev = bytes.fromhex(keys[-1] if keys else fp)
    for b in range(len(keys), len(token_ids) // block_size):
        ids = np.asarray(token_ids[b * block_size:(b + 1) * block_size], dtype="<i8")
        prev = blake3.blake3(prev + ids.tobytes()).digest()
        keys.append(prev.hex())
    return keys


def journal_id(vllm_request_id: str) -> str:
    """The journal's id for a vLLM request: the same when it is a valid kvj id, else a digest."""
    try:
        return check_request_id(vllm_request_id)
    except InvalidName:
        return "vllm-" + blake3.blake3(vllm_request_id.encode()).hexdigest()[:32]


def _durable_blocks(state: "kvj.JournalState", fp: str) -> Dict[str, Dict[str, Any]]:
    """chain key -> {"key", "layout"} of every block segment of this fingerprint in the journal."""
    found: Dict[str, Dict[str, Any]] = {}
    for req in state.requests.values():
        for ref in req.segments.values():
            lay = ref.layout or {}
            if ref.key and lay.get("format") == BLOCK_FORMAT and lay.get("fingerprint") == fp:
                found[lay["chain"]] = {"key": ref.key, "layout": lay}
    return found


def _count(extra: Mapping[str, Any], name: str, default: int) -> int:
    """A positive thread count from the extra config."""
    value = extra.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"kv_connector_extra_config[{name!r}] must be a positive integer, not {value!r}")
    return value


def _replay(path: str) -> "kvj.JournalState":
    return kvj.replay(path) if os.path.isdir(path) else kvj.JournalState()


# ---------------------------------------------------------------------------- metadata


@dataclass
class _Start:
    jid: str
    tokens: List[int]
    meta: Dict[str, Any]


@dataclass
class _Save:
    jid: str
    block: int  #: index of the block in the request
    block_id: int  #: where it sits in the paged cache
    chain: str
    token_ids: List[int]  #: the block's tokens and the next one


@dataclass
class _Finish:
    vllm_id: str
    jid: str
    status: str
    resumes: Optional[str]


@dataclass
class KvjConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: starts, block loads, block saves, finished requests."""

    starts: List[_Start] = field(default_factory=list)
    loads: List[Tuple[str, List[Tuple[int, str]]]] = field(default_factory=list)  #: (vllm id, [(block id, chain)])
    saves: List[_Save] = field(default_factory=list)
    finishes: List[_Finish] = field(default_factory=list)


@dataclass
class KvjWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker to scheduler, each step: blocks that became durable, and blocks that failed to load."""

    durable: List[str] = field(default_factory=list)  #: chain keys
    lost: List[str] = field(default_factory=list)  #: chain keys

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvjWorkerMetadata":
        assert isinstance(other, KvjWorkerMetadata)
        return KvjWorkerMetadata(self.durable + other.durable, self.lost + other.lost)


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    request: "Request"
    jid: str
    started: bool = False
    next_save: int = 0  #: blocks below this have been sent to the worker to save
    chains: List[str] = field(default_factory=list)
    load: Optional[Tuple[int, int]] = None  #: (first block, end block) to load at the next step
    loaded: Dict[int, int] = field(default_factory=dict)  #: block id -> block index of the last load
    local_hit: int = 0  #: vLLM's own prefix-cache hit, block-aligned, when last asked


# ---------------------------------------------------------------------------- the connector


class KvjConnector(KVConnectorBase_V1):
    """Journal vLLM's KV blocks through kvj; load them back after a restart (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _check_version()
        extra = self._kv_transfer_config.kv_connector_extra_config
        if not extra.get("journal"):
            raise KvjError('KvjConnector needs kv_connector_extra_config={"journal": DIR}')
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size * pc.pipeline_parallel_size * pc.data_parallel_size != 1:
            raise KvjError("KvjConnector journals one worker's KV: tensor, pipeline and data parallel size 1")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kvj: kv_load_failure_policy is %r; with 'recompute' a block that fails "
                           "verification is recomputed instead of failing its request",
                           self._kv_transfer_config.kv_load_failure_policy)
        self._path = os.path.abspath(str(extra["journal"]))
        self._block_size = vllm_config.cache_config.block_size
        self._identity = kv_identity(vllm_config, extra)
        self._fp = fingerprint(self._identity)
        durable = _durable_blocks(_replay(self._path), self._fp)
        if role == KVConnectorRole.SCHEDULER:
            if current_platform.is_cpu() and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
                logger.warning("kvj: vLLM's CPU backend reserves one more core for a KV connector; with few "
                               "cores that leaves its scheduler none: set VLLM_CPU_NUM_OF_RESERVED_CPU=1")
            self._durable_chains: Set[str] = set(durable)
            self._requests: Dict[str, _Tracked] = {}
            self._finishing: List[_Finish] = []
            self._leftover_saves: List[_Save] = []
        else:
            threads = _count(extra, "threads", 1)
            store = SegmentStore(default_store_path(self._path), threads=threads)
            self._journal = kvj.Journal.open(self._path, store=store)
            self._flusher = Flusher(store, workers=threads, codec=extra.get("codec", "auto"))
            self._loader = ThreadPoolExecutor(max_workers=_count(extra, "load_threads", min(8, os.cpu_count() or 1)),
                                              thread_name_prefix="kvj-load")
            self._ender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvj-end")
            self._durable = durable
            #: (chain, next token) -> a durable segment holding that block: journaled again by reference
            self._known: Dict[Tuple[str, int], SegmentInfo] = {}
            self._news = KvjWorkerMetadata()  #: for the scheduler at the end of this step
            self._news_lock = threading.Lock()
            self._caches: Dict[str, torch.Tensor] = {}
            self._pending: Dict[str, List["Future[Any]"]] = {}
            self._load_errors: Set[int] = set()
            self._ended: Set[str] = set()
            self._finished_seen: Set[str] = set()
            self._failed: Optional[BaseException] = None
            self._failed_now: Set[int] = set()  #: blocks whose load failed in this step
            self.stats = {"blocks_saved": 0, "blocks_referenced": 0, "blocks_loaded": 0, "blocks_failed": 0}

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = _Tracked(request, journal_id(request.request_id))

    def _chains(self, tracked: _Tracked) -> List[str]:
        tokens = tracked.request.all_token_ids
        if len(tracked.chains) < len(tokens) // self._block_size:
            tracked.chains = chain_keys(self._fp, tokens, self._block_size, tracked.chains)
        return tracked.chains

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        tracked = self._requests[request.request_id]
        usable = (request.num_tokens - 1) // self._block_size  # vLLM computes at least the last token
        tracked.local_hit = num_computed_tokens
        matched = 0
        for chain in self._chains(tracked)[:usable]:
            if chain not in self._durable_chains:
                break
            matched += 1
        return max(0, matched * self._block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._requests[request.request_id]
        if num_external_tokens > 0:
            first = tracked.local_hit // self._block_size
            tracked.load = (first, first + num_external_tokens // self._block_size)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvjConnectorMetadata:
        meta = KvjConnectorMetadata(saves=self._leftover_saves, finishes=self._finishing)
        self._leftover_saves, self._finishing = [], []
        block_state = scheduler_output.kv_connector_block_state
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests[req_id]
            (block_ids,) = block_state.resolve_block_ids(req_id)
            if not tracked.started:
                meta.starts.append(self._start(tracked))
                tracked.started = True
            if tracked.load is not None:
                first, end = tracked.load
                chains = self._chains(tracked)
                meta.loads.append((req_id, [(block_ids[b], chains[b]) for b in range(first, end)]))
                tracked.loaded = {block_ids[b]: b for b in range(first, end)}
                tracked.load = None
            computed = tracked.request.num_computed_tokens + scheduled
            meta.saves += self._saves(tracked, block_ids, computed)
        return meta

    def _start(self, tracked: _Tracked) -> _Start:
        request = tracked.request
        params = request.sampling_params
        extra = (params.extra_args or {}) if params is not None else {}
        prompt = list(request.prompt_token_ids or [])
        sampling = {k: getattr(params, k, None) for k in _SAMPLING} if params is not None else {}
        # What vLLM stops on (check_stop): its EOS unless ignore_eos, and stop_token_ids.
        # all_stop_token_ids also holds the EOS of a request that ignores it.
        stops = set(params.stop_token_ids or ()) | {params.eos_token_id} if params is not None else set()
        stop_ids = sorted(t for t in stops if t is not None)
        meta = {"stop_ids": stop_ids, "format": START_FORMAT, "vllm_id": request.request_id, "fingerprint": self._fp,
                "block_size": self._block_size, "sampling": sampling,
                "max_tokens": int(extra.get("kvj_max_tokens", params.max_tokens if params else 0) or 0),
                "prompt_len": int(extra.get("kvj_prompt_len", len(prompt))),
                "resumes": extra.get("kvj_resumes")}
        return _Start(tracked.jid, prompt, meta)

    def _saves(self, tracked: _Tracked, block_ids: Sequence[int], computed: int) -> List[_Save]:
        """Blocks whose KV is computed (by the end of this step) and whose next token is known."""
        tokens = tracked.request.all_token_ids
        bs = self._block_size
        saves = []
        chains = self._chains(tracked)
        while (tracked.next_save + 1) * bs <= computed and len(tokens) > (tracked.next_save + 1) * bs:
            b = tracked.next_save
            saves.append(_Save(tracked.jid, b, block_ids[b], chains[b], list(tokens[b * bs:(b + 1) * bs + 1])))
            tracked.next_save += 1
        return saves

    def update_connector_output(self, connector_output: Any) -> None:
        """Learn the blocks that became durable (or failed to load); blocks that failed to load
        are recomputed by vLLM: save them again once they are."""
        news = connector_output.kv_connector_worker_meta
        if isinstance(news, KvjWorkerMetadata):
            self._durable_chains.update(news.durable)
            self._durable_chains.difference_update(news.lost)
        invalid = connector_output.invalid_block_ids or set()
        for tracked in self._requests.values() if invalid else ():
            failed = [b for block_id, b in tracked.loaded.items() if block_id in invalid]
            if failed:
                tracked.next_save = min(tracked.next_save, min(failed))

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        tracked = self._requests.pop(request.request_id, None)
        if tracked is None or not tracked.started:
            return False, None
        self._leftover_saves += self._saves(tracked, block_ids, request.num_computed_tokens)
        extra = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
        status = request.status.name.lower().replace("finished_", "")
        self._finishing.append(_Finish(request.request_id, tracked.jid, status, extra.get("kvj_resumes")))
        return True, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Keep the per-layer caches, refusing a layout other than the one recorded in the keys."""
        want = tuple(self._identity["block_shape"])
        for name, cache in kv_caches.items():
            if cache.dim() != 4 or tuple(cache.shape[1:]) != want or \
                    str(cache.dtype).replace("torch.", "") != self._identity["kv_dtype"]:
                raise LayoutMismatch(f"kvj: layer {name} has KV cache {tuple(cache.shape)} {cache.dtype}; this "
                                     f"connector handles [num_blocks, {', '.join(map(str, want))}] "
                                     f"{self._identity['kv_dtype']} (vLLM {SUPPORTED_VLLM[0]}.{SUPPORTED_VLLM[1]})")
        if len(kv_caches) != self._identity["layers"]:
            raise LayoutMismatch(f"kvj: {len(kv_caches)} KV cache layers, the model has {self._identity['layers']}")
        self._caches = dict(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Read and verify this step's blocks in parallel, then copy them in: one pass per layer."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvjConnectorMetadata)
        self._failed_now = set()
        jobs = [block for _, blocks in meta.loads for block in blocks]
        if not jobs:
            return
        caches = list(self._caches.values())
        rows = torch.empty((len(jobs), len(caches) * caches[0][0].nbytes), dtype=torch.uint8)
        futures = [self._loader.submit(self._read_block, chain, rows[i]) for i, (_, chain) in enumerate(jobs)]
        good: List[int] = []
        i = 0
        for _, blocks in meta.loads:
            failed = False
            for block_id, chain in blocks:
                try:
                    info = futures[i].result()
                except (KvjError, OSError, KeyError) as exc:
                    if not failed:  # this and every later block of the request are recomputed
                        logger.warning("kvj: block %s not loaded (%s); vLLM recomputes it", chain[:16], exc)
                    failed = True
                    self._lose(chain)
                else:
                    self._known[(chain, int(info.layout["token_ids"][-1]))] = info
                if failed:
                    self._load_errors.add(block_id)
                    self._failed_now.add(block_id)
                    self.stats["blocks_failed"] += 1
                else:
                    good.append(i)
                i += 1
        if good:
            data = rows[good].view(caches[0].dtype).view(len(good), len(caches), *caches[0].shape[1:])
            ids = torch.tensor([jobs[g][0] for g in good], dtype=torch.long)
            for layer, cache in enumerate(caches):
                cache.index_copy_(0, ids, data[:, layer])
            self.stats["blocks_loaded"] += len(good)

    def _read_block(self, chain: str, out: torch.Tensor) -> SegmentInfo:
        """On a loader thread: read, verify (chunk CRCs, digest, layout) and decode one block into ``out``."""
        entry = self._durable[chain]
        key, layout = entry["key"], entry["layout"]
        mine = {k: layout.get(k) for k in self._identity}
        if mine != self._identity:
            raise LayoutMismatch(f"segment {key} was journaled for {mine}, not {self._identity}")
        store = self._journal.store
        name = store.backend.describe(key)
        header, _ = seg.decode_into(store.read_stored(key), out, name=name, max_raw=store.max_segment_bytes)
        if header.digest.hex() != key:
            raise SegmentCorrupt(name, None, "segment digest does not match the key")
        shape = [self._identity["layers"], *self._identity["block_shape"]]
        if header.layout != layout or list(header.shape) != shape or header.dtype != self._identity["kv_dtype"]:
            raise LayoutMismatch(f"segment {name} holds {header.dtype} {header.shape} {header.layout}, "
                                 f"the journal says {shape} {layout}")
        store.backend.touch(key)  # claimed: collection keeps it while requests name it again
        return SegmentInfo.from_header(header)

    def _lose(self, chain: str) -> None:
        self._durable.pop(chain, None)
        with self._news_lock:
            self._news.lost.append(chain)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are copied once the step's forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        """Journal this step's starts and queue its blocks: a copy each, the rest on kvj's threads."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvjConnectorMetadata)
        try:
            for start in meta.starts if self._failed is None else ():
                self._journal.start(start.jid, None, start.tokens, start.meta)
                self._pending[start.jid] = []
            for save in meta.saves if self._failed is None else ():
                if save.block_id not in self._failed_now:  # recomputed by vLLM, saved again after
                    self._save(save)
        except (KvjError, OSError) as exc:
            self._fail(exc)
        for fin in meta.finishes:  # released even when journaling has stopped
            self._ender.submit(self._end, fin, self._pending.pop(fin.jid, []))

    def _save(self, save: _Save) -> None:
        start = save.block * self._block_size
        token_range = (start, start + self._block_size)
        known = self._known.get((save.chain, save.token_ids[-1]))
        if known is not None:  # a block already durable (loaded, or saved for another request)
            future: "Future[Any]" = self._journal.flush(save.jid, save.block, token_range=token_range,
                                                        layout=known.layout, info=known)
            self.stats["blocks_referenced"] += 1
        else:
            block = torch.stack([cache[save.block_id] for cache in self._caches.values()])
            layout = {**self._identity, "fingerprint": self._fp, "chain": save.chain, "token_ids": save.token_ids}
            future = self._flusher.submit(block, layout, lambda info: self._saved(save, token_range, info))
            self.stats["blocks_saved"] += 1
        self._pending.setdefault(save.jid, []).append(future)

    def _saved(self, save: _Save, token_range: Tuple[int, int], info: SegmentInfo) -> None:
        """On a flusher thread, once the block's segment is durable: its record, and tell the scheduler."""
        self._journal.flush(save.jid, save.block, token_range=token_range, layout=info.layout, info=info)
        self._known[(save.chain, save.token_ids[-1])] = info
        self._durable[save.chain] = {"key": info.key, "layout": info.layout}
        with self._news_lock:
            self._news.durable.append(save.chain)

    def build_connector_worker_meta(self) -> Optional[KvjWorkerMetadata]:
        with self._news_lock:
            news, self._news = self._news, KvjWorkerMetadata()
        return news if news.durable or news.lost else None

    def _end(self, fin: _Finish, futures: List["Future[Any]"]) -> None:
        """On the ender thread: the request's segments and their records durable, then END."""
        try:
            if self._failed is not None:
                return
            for future in futures:
                future.result()
            self._journal.sync()
            for earlier in (fin.resumes or "").split(","):  # the request it resumes, and any before that
                if earlier:
                    self._journal.end(earlier, "resumed")
            self._journal.end(fin.jid, fin.status)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._ended.add(fin.vllm_id)

    def _fail(self, exc: BaseException) -> None:
        """A failed write or fsync is final: log it once, stop journaling, keep serving."""
        if self._failed is None:
            self._failed = exc
            logger.error("kvj: journaling stopped, nothing after this is durable: %s", exc)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        self._finished_seen |= finished_req_ids
        done = self._ended & self._finished_seen
        self._ended -= done
        self._finished_seen -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._ender.shutdown(wait=True)
            self._loader.shutdown(wait=True)
            self._flusher.close()
            try:
                self._journal.close()
            finally:
                self._journal.store.close()


# ---------------------------------------------------------------------------- resume


@dataclass
class ResumePlan:
    """How one request that was in flight continues: its known tokens and its remaining budget."""

    request_id: str  #: the journal's id of the request that was in flight
    prompt: List[int]  #: the original prompt
    generated: List[int]  #: tokens it had generated that its durable blocks hold
    max_tokens: int  #: its original budget
    durable_tokens: int  #: tokens covered by its verified blocks (the recover manifest's resume position)
    sampling: Dict[str, Any]
    stop_ids: List[int]
    #: earlier incarnations still in flight that this one carries (killed while being resumed):
    #: the resumed request's END ends them too, so none is left in flight for a later recover
    superseded: List[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """It had produced its last token (its budget, or a stop token) before the crash."""
        return len(self.generated) >= self.max_tokens or any(t in self.stop_ids for t in self.generated)


@dataclass
class Resumed:
    """A resumed request's whole output: the tokens before the crash and those generated now."""

    plan: ResumePlan
    token_ids: List[int]  #: every generated token, as an uninterrupted run would have returned them
    output: Optional["RequestOutput"]  #: vLLM's output for the resubmitted part (None if complete)

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def restored_tokens(self) -> int:
        """Tokens of the resubmitted prompt that vLLM did not compute (loaded from kvj)."""
        return 0 if self.output is None else self.output.num_cached_tokens or 0

    @property
    def recomputed_tokens(self) -> int:
        """Tokens of the resubmitted prompt that vLLM computed again."""
        if self.output is None:
            return 0
        return len(self.output.prompt_token_ids or []) - self.restored_tokens


def _load_manifest(manifest: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> Mapping[str, Any]:
    if isinstance(manifest, Mapping):
        return manifest
    with open(manifest, encoding="utf-8") as f:
        return json.load(f)


def resume_plans(manifest: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> List[ResumePlan]:
    """The requests of a ``kvj recover`` manifest that this connector journaled, in start order.

    A request that a later resume already took over (it is in flight too, its start record
    naming the first) is left out: the later one carries all its tokens.
    """
    reqs = [r for r in _load_manifest(manifest)["requests"] if (r.get("meta") or {}).get("format") == START_FORMAT]
    by_id = {r["id"]: r for r in reqs}
    superseded = {rid for r in reqs for rid in _resumed_ids(r["meta"])}
    plans = []
    for r in sorted(reqs, key=lambda r: r["start_lsn"]):
        if r["id"] in superseded:
            continue
        chain, earlier = [], _resumed_ids(r["meta"])
        while earlier:  # the in-flight incarnations this one took over, newest first
            rid = earlier[0]
            if rid not in by_id or rid in chain:
                break
            chain.append(rid)
            earlier = _resumed_ids(by_id[rid]["meta"])
        meta = r["meta"]
        known = [int(t) for t in r.get("tokens") or []]
        for seg in sorted(r["segments"], key=lambda s: s["tokens"][0]):
            start, ids = seg["tokens"][0], [int(t) for t in seg["layout"]["token_ids"]]
            overlap = known[start:start + len(ids)]
            if ids[:len(overlap)] != overlap:
                raise kvj.FormatError(f"request {r['id']}: segment {seg['seg']} does not continue its tokens")
            known[start:start + len(ids)] = ids
        prompt_len = int(meta["prompt_len"])
        plans.append(ResumePlan(r["id"], known[:prompt_len], known[prompt_len:], int(meta["max_tokens"]),
                                int(r["resume_position"]), dict(meta.get("sampling") or {}),
                                [int(t) for t in meta.get("stop_ids") or []], chain))
    return plans


def _resumed_ids(meta: Mapping[str, Any]) -> List[str]:
    """The ids a request's START says it resumes (its ``resumes`` meta: ids joined by commas)."""
    return [rid for rid in str(meta.get("resumes") or "").split(",") if rid]


def resume(llm: "LLM", manifest: Union[str, "os.PathLike[str]", Mapping[str, Any]], *,
           use_tqdm: bool = False) -> List[Resumed]:
    """Resubmit every request that was in flight (``kvj recover``'s manifest) and finish it.

    Each continues as its prompt plus the tokens its durable blocks hold, with the rest of its
    token budget; ``llm``'s KvjConnector loads those blocks and vLLM computes only what follows
    the last one. Under greedy decoding the returned ``token_ids`` equal an uninterrupted
    run's. With a seeded sampler, the tokens up to the last durable block are the original
    ones, but the continuation is drawn from a generator seeded afresh, so it differs.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    plans = resume_plans(manifest)
    prompts, params = [], []
    for plan in plans:
        budget = plan.max_tokens - len(plan.generated)
        sampling = {k: v for k, v in plan.sampling.items() if k in _SAMPLING and v is not None}
        # A request already complete is still submitted, for one token, so that its
        # connector ends it in the journal; that token is not part of its output.
        params.append(SamplingParams(**{**sampling, "max_tokens": max(1, budget) if not plan.complete else 1,
                                        "extra_args": {"kvj_resumes": ",".join([plan.request_id,
                                                                                *plan.superseded]),
                                                       "kvj_prompt_len": len(plan.prompt),
                                                       "kvj_max_tokens": plan.max_tokens}}))
        prompts.append(TokensPrompt(prompt_token_ids=plan.prompt + plan.generated))
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm) if prompts else []
    results = []
    for plan, out in zip(plans, outputs):
        new = [] if plan.complete else list(out.outputs[0].token_ids)
        results.append(Resumed(plan, plan.generated + new, None if plan.complete else out))
    return results
