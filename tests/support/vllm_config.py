"""vLLM's real configuration and scheduler objects for KvjConnector's tests without an engine:
a tiny random-weight Llama, an engine config with the connector, a scheduler-side connector,
empty and scheduling ``SchedulerOutput``s. They work with every vLLM release kvj supports
(``tests/e2e/vllm/test_vllm_releases.py`` runs the tests that use them against each)."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

BLOCK = 32


def tiny_model(path: str) -> str:
    """A random-weight Llama small enough for a config (256 tokens, 2 layers, 2 KV heads of 16) at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    return path


def engine_config(model: str, journal: str, **extra: Any) -> Any:
    """vLLM's engine config of ``model`` with KvjConnector journaling into ``journal``."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"journal": journal, **extra})
    return EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=512, enforce_eager=True,
                      block_size=BLOCK, kv_transfer_config=transfer).create_engine_config()


def scheduler(model: str, journal: str, **extra: Any) -> Any:
    """A scheduler-side KvjConnector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvj.integrations.vllm import KvjConnector

    return KvjConnector(engine_config(model, journal, **extra), KVConnectorRole.SCHEDULER, None)


def no_step() -> Any:
    """A scheduler output that schedules nothing."""
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def scheduled(plan_ids: Dict[str, List[int]], tokens: Dict[str, int], preempted: Any = ()) -> Any:
    """A scheduler output scheduling ``tokens`` (request id -> tokens), blocks from ``plan_ids``."""
    from vllm.v1.core.sched.output import KVConnectorBlockState

    out = no_step()
    out.num_scheduled_tokens = dict(tokens)
    out.total_num_scheduled_tokens = sum(tokens.values())
    out.preempted_req_ids = set(preempted)
    out.kv_connector_block_state = KVConnectorBlockState(set(tokens), lambda rid: (plan_ids[rid],), {})
    return out
