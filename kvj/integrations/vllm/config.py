"""The connector's configuration: ``kv_connector_extra_config`` checked, and what it refuses to journal."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE as _STR_DTYPES

from kvj.errors import InvalidArgument, KvjError
from kvj.integrations.vllm.buffers import GATHER_BYTES, STAGING_BYTES
from kvj.integrations.vllm.layout import FP8

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

ADMISSIONS = ("arrival", "durable")


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
        if extra.get("admission", "arrival") not in ADMISSIONS:
            raise InvalidArgument(f"kv_connector_extra_config['admission'] must be one of {ADMISSIONS}")
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
