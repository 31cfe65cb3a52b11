"""A vLLM engine in a child process, for the connector's end-to-end tests and its benchmark.

Run as ``python -m support.vllm_engine SPEC.json`` (``tests`` on ``PYTHONPATH``). The spec
names the model, the connector (``kvj`` through ``support.vllm_record``, ``example`` for
vLLM's in-tree ExampleConnector, or none), the engine settings (``"tp": N`` for tensor
parallelism: N worker processes, one core each), and a list of jobs:

* ``{"generate": [[ids...], ...], "max_tokens": N}``: one ``LLM.generate`` call, greedy, or
  with ``"sampling": [{"temperature": T, "seed": S} or null, ...]`` per prompt; every request
  generates N tokens (EOS is ignored);
* ``{"resume": MANIFEST}``: ``kvj.integrations.vllm.resuming``;
* ``{"drain": [[ids...], ...], "late": [ids...], "at": N, "after": K, "to": NAME, "max_tokens": M}``:
  the prompts (greedy, or per ``"sampling"``) are added to the engine and stepped until one
  has generated ``at`` tokens; then ``late`` is added, K more steps run, and
  ``kvj.integrations.vllm.drain`` hands everything off to NAME (result: the manifest's path
  and each request's tokens so far).

``"sources"`` in the spec names journals the connector may load blocks from (a handoff's).

Each job's result (tokens, the sampled tokens' logprobs, cached-token counts) is appended
to ``SPEC["out"]`` as one JSON line as soon as the job is done, so a parent that SIGKILLs
the engine mid-job still has the jobs before it. Line ``{"ready": true}`` comes first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional


def _write(path: str, obj: Dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _request(out: Any) -> Dict[str, Any]:
    comp = out.outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(comp.logprobs or [], comp.token_ids)]
    return {"prompt_len": len(out.prompt_token_ids), "token_ids": list(comp.token_ids), "logprobs": logprobs,
            "cached": out.num_cached_tokens or 0}


def _params(SamplingParams: Any, sampling: List[Optional[Dict[str, Any]]], max_tokens: int) -> List[Any]:
    """Each prompt's sampling (greedy unless given), running to ``max_tokens`` whatever it samples:
    the random-weight models sample their EOS (token 2) now and then, and a request that stopped
    early would not be in flight when a test kills or drains the engine (seed 743069's P0 did, 4
    tokens in). A resume keeps ``ignore_eos``: it is journaled with the rest of the sampling."""
    return [SamplingParams(**(s or {"temperature": 0}), max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                           logprobs=1) for s in sampling]


def _drain(llm: Any, job: Dict[str, Any], SamplingParams: Any, TokensPrompt: Any, drain: Any) -> Dict[str, Any]:
    engine = llm.llm_engine
    prompts = job["drain"] + [job["late"]]
    sampling = job.get("sampling") or [None] * len(prompts)
    params = _params(SamplingParams, sampling, job["max_tokens"])
    got: Dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            got[out.request_id] = len(out.outputs[0].token_ids)

    for i, prompt in enumerate(job["drain"]):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params[i])
    while max(got.values(), default=0) < job["at"]:
        step()
    engine.add_request(str(len(prompts) - 1), TokensPrompt(prompt_token_ids=job["late"]), params[-1])
    for _ in range(job["after"]):
        step()
    return {"manifest": drain(llm, job["to"]), "seen": got}


def main(spec_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    # vLLM's CPU backend reserves one more core when a KV connector is configured (for NIXL);
    # on a 2-core machine that leaves the engine's scheduler process none and decoding crawls.
    tp = int(spec.get("tp", 1))
    if tp > 1:  # one core per rank (the CPU backend's default binding wants a NUMA node per rank)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    if spec.get("in_process"):  # the engine core and its worker in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvj.integrations.vllm import drain, resume

    transfer = None
    if spec.get("connector") == "kvj":
        transfer = KVTransferConfig(kv_connector="RecordingKvjConnector", kv_connector_module_path="support.vllm_record",
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"journal": spec["journal"],
                                                               "record": spec.get("record"),
                                                               "pace": spec.get("pace"),
                                                               "drop": spec.get("drop"),
                                                               "sources": spec.get("sources")})
    elif spec.get("connector") == "example":
        transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"shared_storage_path": spec["journal"]})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"),
              max_model_len=spec.get("max_model_len", 512), enforce_eager=True, seed=0,
              block_size=spec.get("block_size", 32), max_num_batched_tokens=spec.get("max_num_batched_tokens"),
              enable_prefix_caching=spec.get("prefix_caching", True), kv_transfer_config=transfer,
              kv_cache_memory_bytes=1 << 30,  # no start-up check against the memory others use
              **({"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}))
    _write(spec["out"], {"ready": True})
    for job in spec["jobs"]:
        t0 = time.perf_counter()
        if "drain" in job:
            result = _drain(llm, job, SamplingParams, TokensPrompt, drain)
        elif "generate" in job:
            sampling = job.get("sampling") or [None] * len(job["generate"])
            params = _params(SamplingParams, sampling, job["max_tokens"])
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["generate"]], params, use_tqdm=False)
            result = {"requests": [_request(o) for o in outs]}
        else:
            resumed = resume(llm, job["resume"])
            result = {"requests": [{**(_request(r.output) if r.output else {}), "id": r.request_id,
                                    "prompt": r.plan.prompt, "resumed_at": len(r.plan.generated),
                                    "durable_tokens": r.plan.durable_tokens, "all_token_ids": r.token_ids,
                                    "restored": r.restored_tokens, "reused": r.reused_tokens,
                                    "recomputed": r.recomputed_tokens}
                                   for r in resumed]}
        _write(spec["out"], {**result, "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main(sys.argv[1])
