"""kvj's vLLM KV connector: ``kv_connector_module_path="kvj.integrations.vllm"`` loads ``KvjConnector``.

Names are imported on first use, so ``resume`` and ``drain`` need no vLLM.
"""

import importlib
from typing import Any

_LAZY = {
    "KvjConnector": "connector", "KvjConnectorMetadata": "connector", "KvjWorkerMetadata": "connector",
    "SUPPORTED_VLLM": "compat", "START_FORMAT": "resuming", "ResumePlan": "resuming", "Resumed": "resuming",
    "resume": "resuming", "resume_plans": "resuming", "drain": "handoff",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
