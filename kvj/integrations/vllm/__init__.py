"""kvj's vLLM KV connector: ``kv_connector_module_path="kvj.integrations.vllm"`` loads ``KvjConnector``.

``connector`` is the connector (scheduler and worker sides; it imports vLLM), ``worker`` carries
each step's plan out on a worker (without vLLM), ``layout`` names the model and its KV blocks,
``compat`` holds what differs between vLLM releases, ``resume`` continues the requests in flight
after ``kvj recover`` and ``handoff`` moves live requests to another engine (both import without
vLLM). The names of ``resume`` and ``handoff`` are imported with the package (they need no
vLLM; ``resume`` is the function, not its module, however the module was imported first); those
of ``connector`` and ``compat`` on first use.
"""

import importlib
from typing import Any

from kvj.integrations.vllm.handoff import drain
from kvj.integrations.vllm.resume import START_FORMAT, Resumed, ResumePlan, resume, resume_plans

_LAZY = {
    "KvjConnector": "connector", "KvjConnectorMetadata": "connector", "KvjWorkerMetadata": "connector",
    "SUPPORTED_VLLM": "compat",
}

__all__ = sorted([*_LAZY, "START_FORMAT", "ResumePlan", "Resumed", "resume", "resume_plans", "drain"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
