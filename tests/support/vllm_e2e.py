"""Shared pieces of the vLLM end-to-end tests (``tests/e2e/vllm``): the tiny random-weight
model, an engine in a child process (``support.vllm_engine``) and its results, the comparison
of tokens and logprobs, the kvj CLI in a subprocess, and a scheduler-side connector with no
engine. Engine settings the tests share (``ENGINE``, ``PACE``, ``SEEDED``) are explained here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

import kvj
from support.wait import wait_for

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, for support.*
BLOCK = 32  # the CPU attention backend takes multiples of 32
LOGPROB_TOL = 5e-5  # float32 on the CPU backend: a resumed request batched otherwise differed by up to 1.14e-5 once (tokens identical)

#: Seconds added to each step of an engine the test kills once the journal shows progress: on a
#: loaded machine the test's polling (a replay of the journal each time) is slow, and without it
#: the batch could finish before the kill (it did, at load 10).
PACE = 0.05
#: A 64-token step budget: the short requests, first in line, decode (and journal blocks holding
#: generated tokens) while the long one, last, is still in prefill.
#: float32: vLLM's CPU bfloat16 kernels are not batch-invariant (a resumed request, batched
#: differently from the uninterrupted run, got logprobs up to 0.06 apart with the same tokens),
#: and its bfloat16 attention kernel dies of SIGILL after some resumes on this machine's CPU.
ENGINE = {"max_num_batched_tokens": 64, "dtype": "float32"}

#: The seeded request's sampling. vLLM 0.32's CPU worker fails on a seeded request whose prompt
#: is computed in chunks (it rewinds a CPU generator's offset, which CPU generators do not have):
#: S0 comes first, so its 8-token prompt is computed in the batch's first step and, when
#: resumed (no longer than 72 tokens), in the resumed engine's.
SEEDED = {"temperature": 1.0, "seed": 1234}


def make_model(path: str, seed: int) -> str:
    """Save a tiny random-weight Llama (seeded, weights scaled up so outputs depend on context) at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # random weights at init scale barely depend on context
    model.save_pretrained(path)
    return path


def start_engine(tmp: str, name: str, model: str, jobs: List[Dict[str, Any]], journal: str,
                 **settings: Any) -> subprocess.Popen:
    """Start engine ``name`` running ``jobs`` through KvjConnector on ``journal``; its results go to TMP/NAME.jsonl."""
    record = os.path.join(tmp, f"{name}-rec")
    os.makedirs(record, exist_ok=True)
    spec = {"model": model, "connector": "kvj", "journal": journal, "record": record,
            "out": os.path.join(tmp, f"{name}.jsonl"), "jobs": jobs, **ENGINE, **settings}
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen([sys.executable, "-m", "support.vllm_engine", path], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def lines(tmp: str, name: str) -> List[Dict[str, Any]]:
    """The complete result lines engine ``name`` has written so far."""
    path = os.path.join(tmp, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_engine(tmp: str, name: str, model: str, jobs: List[Dict[str, Any]], journal: str,
               **settings: Any) -> List[Dict[str, Any]]:
    """Run engine ``name`` to completion (it must exit 0) and return its job results."""
    proc = start_engine(tmp, name, model, jobs, journal, **settings)
    try:
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with open(os.path.join(tmp, f"{name}.log")) as f:
        assert rc == 0, f"engine {name} exited {rc}:\n{f.read()[-6000:]}"
    return lines(tmp, name)[1:]


def same(got: Dict[str, Any], want: Dict[str, Any], what: str, offset: int = 0) -> None:
    """``got`` has ``want``'s tokens from ``offset`` on, and its logprobs within ``LOGPROB_TOL``."""
    assert got["token_ids"] == want["token_ids"][offset:], f"{what}: tokens differ"
    np.testing.assert_allclose(got["logprobs"], want["logprobs"][offset:], rtol=0, atol=LOGPROB_TOL,
                               err_msg=f"{what}: logprobs differ")


def journal_state(journal: str) -> Optional["kvj.JournalState"]:
    """The journal's replayed state, or None while it cannot be read yet."""
    try:
        return kvj.replay(journal)
    except kvj.KvjError:
        return None  # caught mid-creation; ask again


def kvj_cli(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run the kvj CLI of this checkout in a subprocess."""
    return subprocess.run([sys.executable, "-m", "kvj.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], what: str) -> None:
    """SIGKILL ``proc``'s process group once ``ready()`` (or once it exits by itself)."""
    try:
        wait_for(lambda: proc.poll() is not None or ready(), what, timeout=900, interval=0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def scheduler_connector(model: str, journal: str, dtype: str = "float32") -> Any:
    """The scheduler-side KvjConnector an engine for ``model`` would build (no engine started)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvj.integrations.vllm import KvjConnector

    transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"journal": journal})
    config = EngineArgs(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=512, enforce_eager=True,
                        block_size=BLOCK, kv_transfer_config=transfer).create_engine_config()
    return KvjConnector(config, KVConnectorRole.SCHEDULER, None)


def matched_tokens(connector: Any, tokens: List[int]) -> int:
    """How many of ``tokens`` the scheduler-side ``connector`` would load from its journal."""
    request = types.SimpleNamespace(request_id="q", all_token_ids=tokens, prompt_token_ids=tokens,
                                    num_tokens=len(tokens), sampling_params=None)
    connector.on_new_request(request)
    return connector.get_num_new_matched_tokens(request, 0)[0]
