"""``python -m kvj.demo.vllm_engine SPEC.json``: a vLLM engine journaling through ``KvjConnector``.

The demo runs it as a child process, SIGKILLs it mid-generation and starts another that
resumes (``kvj.integrations.vllm.resuming``) from ``kvj recover``'s manifest. ``SPEC`` names
the model directory, the journal, the output file and a list of jobs:

* ``{"serve": [[ids...], ...], "max_tokens": N, "pace": S}``: the prompts (greedy) added at
  once, the engine stepped until all are done, each step at least ``S`` seconds (as a larger
  model's step would last: the parent's kill then lands mid-decode on a loaded machine too);
  after every step, ``{"step": n, "generated": [tokens of each request]}`` is written as one
  line to file descriptor ``SPEC["events_fd"]`` when given, for a parent picking its moment;
* ``{"resume": MANIFEST}``: resume every request of a recovery (or handoff) manifest;
* ``{"handoff": [[ids...], ...], "max_tokens": N, "at": K, "to": NAME}``: the prompts added
  and stepped until one has generated ``K`` tokens, then ``kvj.integrations.vllm.drain``
  hands every request off to engine ``NAME`` (the result: the handoff manifest's path).

``SPEC["sources"]``: journals of other engines whose blocks the connector may load (a handoff's).

Each job's result (tokens, their logprobs; for a resume, KV restored / recomputed tokens) is
written to ``SPEC["out"]/job-N.json`` (durably, ``kvj.fileio.atomic_write``) once the job is
done, so a parent that kills the engine mid-job still has the jobs before it; ``ready.json``
comes first, when the engine has started. ``build_model`` writes the random-weight
Qwen2 the demo serves (``save_random_model``: any such model, as the vLLM benchmark's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Any, Dict, List, Optional

from kvj.fileio import atomic_write, makedirs_durable

BLOCK_SIZE = 32  #: vLLM's CPU attention backend takes multiples of 32


def save_random_model(path: str, cfg: Any, seed: int = 0) -> str:
    """A random-weight causal LM of config ``cfg`` saved at ``path`` (weights scaled up: at init
    scale a random model's next token barely depends on the context, and a resume that lost
    it would pass)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the demo's console shows its own progress
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    return path


def build_model(path: str, seed: int = 0) -> str:
    """The small random-weight Qwen2 the demo serves, saved at ``path``."""
    from transformers import Qwen2Config

    return save_random_model(path, Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=1024), seed)


def _write(out: str, name: str, obj: Dict[str, Any]) -> None:
    atomic_write(os.path.join(out, f"{name}.json"), json.dumps(obj).encode())


def _output(out: Any) -> Dict[str, Any]:
    comp = out.outputs[0]
    return {"token_ids": list(comp.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs or [], comp.token_ids)]}


def _serve(llm: Any, job: Dict[str, Any], events: Optional[IO[str]]) -> List[Dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], detokenize=False, logprobs=1)
    index = {}
    for i, prompt in enumerate(job["serve"]):
        index[engine.add_request(f"demo-{i}", TokensPrompt(prompt_token_ids=prompt), params)] = i
        index[f"demo-{i}"] = i
    done: Dict[int, Dict[str, Any]] = {}
    generated = [0] * len(job["serve"])
    step = 0
    while len(done) < len(job["serve"]):
        t0 = time.perf_counter()
        for out in engine.step():
            i = index[out.request_id]
            generated[i] = len(out.outputs[0].token_ids)
            if out.finished:
                done[i] = _output(out)
        step += 1
        if events is not None:
            events.write(json.dumps({"step": step, "generated": generated}) + "\n")
            events.flush()
        time.sleep(max(0.0, job.get("pace", 0.0) - (time.perf_counter() - t0)))
    return [done[i] for i in range(len(job["serve"]))]


def _handoff(llm: Any, job: Dict[str, Any]) -> Dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvj.integrations.vllm import drain

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], detokenize=False, logprobs=1)
    for i, prompt in enumerate(job["handoff"]):
        engine.add_request(f"live-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    generated: Dict[str, int] = {}
    while max(generated.values(), default=0) < job["at"]:
        for out in engine.step():
            if out.finished:  # nothing left to hand off: the engine ran ahead of this loop
                raise RuntimeError(f"request {out.request_id} finished before the handoff at {job['at']} tokens")
            generated[out.request_id] = len(out.outputs[0].token_ids)
    return {"manifest": drain(llm, job["to"]), "generated": sorted(generated.values())}


def main(spec_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    # The CPU backend reserves a core for NIXL when a KV connector is configured: on 2 cores that
    # would leave the engine's scheduler none.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    if spec.get("in_process"):  # the engine core in this process: it steps when ``serve`` steps it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvj.integrations.vllm import resume

    transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"journal": spec["journal"],
                                                           **({"sources": spec["sources"]} if spec.get("sources") else {})})
    # float32: vLLM's CPU bfloat16 kernels are not batch-invariant (a resumed request is batched
    # otherwise than in the uninterrupted run).
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              enforce_eager=True, seed=0, block_size=BLOCK_SIZE, max_num_batched_tokens=spec.get("step_tokens", 64),
              kv_transfer_config=transfer, kv_cache_memory_bytes=1 << 30)
    events = os.fdopen(spec["events_fd"], "w") if spec.get("events_fd") is not None else None
    makedirs_durable(spec["out"])
    _write(spec["out"], "ready", {"ready": True})
    for n, job in enumerate(spec["jobs"]):
        t0 = time.perf_counter()
        if "serve" in job:
            result: Dict[str, Any] = {"requests": _serve(llm, job, events)}
        elif "handoff" in job:
            result = _handoff(llm, job)
        else:
            result = {"requests": [{**(_output(r.output) if r.output else {}), "id": r.request_id,
                                    "prompt": r.plan.prompt, "resumed_at": len(r.plan.generated),
                                    "all_token_ids": r.token_ids, "restored": r.restored_tokens,
                                    "reused": r.reused_tokens, "recomputed": r.recomputed_tokens}
                                   for r in resume(llm, job["resume"])]}
        _write(spec["out"], f"job-{n}", {**result, "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main(sys.argv[1])
