"""``kvj bench serve``: kvj serve against plain ``vllm serve``, side by side, and after a ``kill -9``.

``kvj bench serve [--dir DIR] [--rounds N] [--clients N] [--tokens N]`` makes a small random-weight
Llama and a BPE tokenizer with a chat template (offline) and runs, on vLLM's CPU backend (or
whatever vLLM runs on here):

* **throughput and TTFT**: plain ``vllm serve`` (through the ``vllm`` metadata shim), ``kvj serve``
  and ``kvj serve --admission durable`` stay up side by side and take turns, round after round
  (the order rotating; the others stopped with SIGSTOP meanwhile: vLLM's idle CPU workers poll,
  a core each), on the same prompts (new ones each round, so no prefix cache answers):
  ``--clients`` concurrent streaming chat completions of ``--tokens`` tokens each. Per system,
  the median over rounds of time to first token (p50 and p95 over the clients), of the
  aggregate tokens/s (with its range over the rounds: on a shared machine the neighbours' load
  moves it) and of the CPU time all the server's processes used per token (what the load costs
  the machine, much less moved by the neighbours); the ratio to plain vLLM (goal: at least 0.9x);
* **restart**: long conversations (about 2,048-token prompts) streamed by ``kvj serve``, its whole process
  group killed mid-decode, ``kvj serve`` started again on the same journal: seconds from the exec
  to ``/health`` (engine start), then from ``/health`` to each re-attached client's first resumed
  token (generated after the restart: its KV loaded from the store), against a cold re-prefill of
  the same conversations (prompt + the tokens generated so far) on the plain server.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

#: vLLM's CPU backend on few cores: float32 is batch-invariant there; a step budget that takes a
#: whole prompt avoids chunked prefill, on which 0.32's CPU worker fails for seeded requests.
ENGINE = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "4096", "--enforce-eager",
          "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(1 << 30), "--max-num-batched-tokens", "4096"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("harbour boat gull tide rope sail quay net fish storm lamp dock wave salt crane mast deck anchor "
         "keel buoy chart wind cloud rain").split()


def make_model(out: str, seed: int = 0) -> str:
    """A tiny random-weight Llama (float32, weights x4: outputs depend on context) and a byte-level
    BPE tokenizer with a chat template, trained on this Python's standard library (nothing is
    downloaded), saved together in ``out``."""
    import glob

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from kvj.demo.vllm_engine import save_random_model

    os.makedirs(out, exist_ok=True)
    root = os.path.dirname(json.__file__).rsplit("/", 1)[0]

    def corpus() -> Iterator[str]:
        for path in sorted(glob.glob(os.path.join(root, "*.py")))[:200]:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    save_random_model(out, LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                                       eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                                       pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
                                       torch_dtype="float32"), seed)
    return out


class ServerProcess:
    """A ``kvj serve`` or ``vllm serve`` in a process group of its own: started, waited for
    (``/health``), killed as a crash (``kill -9`` of the group), or stopped (SIGTERM)."""

    def __init__(self, argv: List[str], port: int, log: str, env: Optional[Dict[str, str]] = None):
        self.port, self.url, self.log = port, f"http://127.0.0.1:{port}", log
        self.started = time.monotonic()
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **(env or {})})
        self.pgid = self.proc.pid

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = 600.0) -> float:
        """Seconds from the start to ``/health`` answering; RuntimeError if it exits or times out."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: see {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout:.0f} s: see {self.log}")
            time.sleep(0.1)
        return time.monotonic() - self.started

    def group_alive(self) -> bool:
        """Whether any process of its group is left."""
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False

    def kill(self) -> None:
        """``kill -9`` of the whole group: the server and every engine process."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) its group's processes have used so far: robust to the neighbours'
        load that makes wall-clock rates on a shared machine noisy."""
        total = 0
        for pid in (int(n) for n in os.listdir("/proc") if n.isdigit()):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.pgid:  # pgrp
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")

    def pause(self) -> None:
        """SIGSTOP its group between its turns: vLLM's idle CPU workers poll (a core each), which would
        weigh on the system whose turn it is."""
        os.killpg(self.pgid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT its group, then wait for ``/health``."""
        os.killpg(self.pgid, signal.SIGCONT)
        self.wait_healthy(timeout=120)

    def close(self, grace: float = 30.0) -> None:
        """Whatever happened: nothing of it is left running. SIGTERM first (vLLM then removes the
        ``/dev/shm`` files its processes made), the whole group killed if it is not gone in ``grace``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGCONT)  # a paused one
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        if self.proc.poll() is None or self.group_alive():
            self.kill()


def sse(method: str, url: str, body: Optional[Dict[str, Any]] = None, headers: Optional[Dict[str, str]] = None,
        limit: Optional[int] = None, timeout: float = 600.0) -> Tuple[int, List[Dict[str, Any]]]:
    """(status, events: ``id``, ``event``, ``data`` and ``t``, seconds since the request) of an SSE
    stream; stops reading (the client goes away) after ``limit`` events."""
    import httpx

    t0 = time.monotonic()
    events: List[Dict[str, Any]] = []
    current: Dict[str, Any] = {}
    with httpx.stream(method, url, json=body, headers=headers or {}, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [{"data": r.text, "t": time.monotonic() - t0}]
        for line in r.iter_lines():
            if line.startswith("id: "):
                current["id"] = int(line[4:])
            elif line.startswith("event: "):
                current["event"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = line[6:]
            elif line == "" and current:
                current["t"] = time.monotonic() - t0
                events.append(current)
                current = {}
                if limit is not None and len(events) >= limit:
                    break
    return 200, events


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(rng: random.Random, words: int) -> List[Dict[str, str]]:
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))}]


def _load(url: str, model: str, prompts: List[List[Dict[str, str]]], tokens: int) -> Dict[str, Any]:
    """``len(prompts)`` concurrent streaming chats of ``tokens`` tokens: TTFTs and aggregate tokens/s."""
    ttft: List[float] = []
    errors: List[str] = []

    def one(messages: List[Dict[str, str]]) -> None:
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        status, events = sse("POST", f"{url}/v1/chat/completions", body)
        usage = [json.loads(e["data"]).get("usage") for e in events if e.get("data", "").startswith("{")]
        if status != 200 or not usage or (usage[-1] or {}).get("completion_tokens") != tokens:
            errors.append(f"{status}: {events[-2:]}")
        else:
            ttft.append(events[0]["t"])

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed against {url}: {errors[0]}")
    ttft.sort()
    return {"ttft_p50": statistics.median(ttft), "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "tokens_per_s": len(prompts) * tokens / wall}


def run(directory: Optional[str] = None, rounds: int = 6, clients: int = 8, tokens: int = 256,
        conversations: int = 4) -> Dict[str, Any]:
    """Both measures (module docstring); work files under ``directory`` or a temporary directory (removed)."""
    work = tempfile.mkdtemp(prefix="kvj-bench-serve-", dir=directory)
    servers: List[ServerProcess] = []
    try:
        return _bench(work, servers, rounds, clients, tokens, conversations)
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(work, ignore_errors=True)


def _bench(work: str, servers: List[ServerProcess], rounds: int, clients: int, tokens: int,
           conversations: int) -> Dict[str, Any]:
    from kvj.serve.vllm_dist import write

    model = make_model(os.path.join(work, "model"))
    shim = os.path.join(work, "shim")
    write(shim)  # plain vllm serve finds itself (as after ./quickstart)
    env = {"PYTHONPATH": os.pathsep.join([shim, *filter(None, [os.environ.get("PYTHONPATH")])])}
    kvj = [os.path.join(os.path.dirname(sys.executable), "kvj"), "serve"]
    vllm = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    systems = {"vllm serve": vllm + [model],
               "kvj serve": kvj + [model, "--journal", os.path.join(work, "j-arrival")],
               "kvj serve, durable": kvj + [model, "--journal", os.path.join(work, "j-durable"),
                                            "--admission", "durable"]}
    up: Dict[str, ServerProcess] = {}
    for name, argv in systems.items():  # one after another: each start has the cores to itself
        port = _free_port()
        up[name] = ServerProcess(argv + ["--port", str(port), *ENGINE], port, os.path.join(work, f"{name}.log"), env)
        servers.append(up[name])
        up[name].wait_healthy()
        up[name].pause()
    names = list(systems)
    results: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        rng = random.Random(r)
        prompts = [_prompt(rng, 48) for _ in range(clients)]
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            up[name].resume()  # one system up at a time: the others' idle pollers stopped
            cpu = up[name].cpu_seconds()
            load = _load(up[name].url, model, prompts, tokens)
            load["cpu_ms_per_token"] = (up[name].cpu_seconds() - cpu) * 1000 / (len(prompts) * tokens)
            results[name].append(load)
            up[name].pause()
    rows = []
    for name in names:
        row = {"system": name, **{k: statistics.median(x[k] for x in results[name])
                                  for k in ("ttft_p50", "ttft_p95", "tokens_per_s", "cpu_ms_per_token")},
               "tokens_per_s_range": [min(x["tokens_per_s"] for x in results[name]),
                                      max(x["tokens_per_s"] for x in results[name])]}
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["tokens_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["ttft_ratio"] = row["ttft_p50"] / base["ttft_p50"]
        row["cpu_ratio"] = row["cpu_ms_per_token"] / base["cpu_ms_per_token"]
    for name in names[1:]:  # the restart uses the cores alone; plain vLLM resumes for the cold re-prefill
        up[name].kill()
    restart = _restart(work, servers, kvj + [model], up["vllm serve"], model, conversations, env)
    return {"rounds": rounds, "clients": clients, "tokens": tokens, "rows": rows, "restart": restart}


def _restart(work: str, servers: List[ServerProcess], kvj: List[str], plain: ServerProcess, model: str,
             conversations: int, env: Dict[str, str]) -> Dict[str, Any]:
    """kill -9 during long conversations, restart, first resumed token; a cold re-prefill to compare."""
    import httpx

    import kvj as lib
    from kvj.serve.paths import replies_dir

    journal = os.path.join(work, "j-restart")
    port = _free_port()
    argv = kvj + ["--journal", journal, "--port", str(port), *ENGINE]
    server = ServerProcess(argv, port, os.path.join(work, "restart-1.log"), env)
    servers.append(server)
    server.wait_healthy()
    rng = random.Random(99)
    seen: Dict[str, int] = {}

    def client(k: int) -> None:
        body = {"model": model, "messages": _prompt(rng, 780), "stream": True, "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True}
        _status, events = sse("POST", f"{server.url}/v1/chat/completions", body, {"X-Request-Id": f"conv-{k}"},
                              limit=64)
        seen[f"chatcmpl-conv-{k}"] = events[-1]["id"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    server.kill()
    known = {key: len(req.output) for key, req in lib.replay(replies_dir(journal)).requests.items() if key in seen}
    engine = lib.replay(journal)
    prompts = {}
    for req in engine.requests.values():
        client_key = (req.meta or {}).get("client")
        if client_key in known:
            prompts[client_key] = list(req.tokens or [])[:int(req.meta["prompt_len"])]
    again = ServerProcess(argv, port, os.path.join(work, "restart-2.log"), env)
    servers.append(again)
    healthy = again.wait_healthy()
    up_at = again.started + healthy
    firsts: List[float] = []

    def reattach(key: str) -> None:
        asked = time.monotonic()
        _status, events = sse("GET", f"{again.url}/v1/chat/completions/{key}?stream=true",
                              headers={"Last-Event-ID": str(seen[key])})
        # event i carries token i (event 0: the role): the first one the engine made after the restart
        resumed = [e["t"] for e in events if e.get("id", -1) > known[key]]
        if resumed:
            firsts.append(asked + resumed[0] - up_at)

    threads = [threading.Thread(target=reattach, args=(key,)) for key in known]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    replies = lib.replay(replies_dir(journal))
    again.pause()
    plain.resume()
    cold = []
    for key, prompt in prompts.items():
        ids = prompt + replies.requests[key].output[:known[key]]
        t = time.monotonic()
        httpx.post(f"{plain.url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1},
                   timeout=600).raise_for_status()
        cold.append(time.monotonic() - t)
    loaded = [(replies.requests[key].reply or {}).get("cached_tokens", 0) for key in known]
    return {"conversations": len(known), "prompt_tokens": statistics.median(len(p) for p in prompts.values()),
            "known_tokens": statistics.median(known.values()), "engine_start_s": healthy,
            "first_resumed_s": sorted(firsts), "cold_prefill_s": sorted(cold),
            "kv_loaded_tokens": statistics.median(loaded) if loaded else 0}


def format_table(result: Dict[str, Any]) -> str:
    """The table ``kvj bench serve`` prints."""
    head = (f"{result['clients']} concurrent streaming chats x {result['tokens']} tokens, median of "
            f"{result['rounds']} rounds (systems take turns on the same prompts)")
    header = ["system", "TTFT p50", "TTFT p95", "tokens/s", "(rounds' range)", "tokens/s vs vllm", "TTFT vs vllm",
              "CPU ms/token", "CPU vs vllm"]
    cells = [[r["system"], f"{r['ttft_p50'] * 1000:,.0f} ms", f"{r['ttft_p95'] * 1000:,.0f} ms",
              f"{r['tokens_per_s']:,.0f}", "({:,.0f}-{:,.0f})".format(*r["tokens_per_s_range"]),
              f"{r['tokens_ratio']:.2f}x", f"{r['ttft_ratio']:.2f}x", f"{r['cpu_ms_per_token']:.2f}",
              f"{r['cpu_ratio']:.2f}x"] for r in result["rows"]]
    widths = [max(len(row[i]) for row in cells + [header]) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    lines = [head, fmt(header), "-" * (sum(widths) + 2 * (len(widths) - 1)), *(fmt(r) for r in cells)]
    s = result["restart"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    lines += ["", f"after kill -9: {s['conversations']} conversations of {s['prompt_tokens']:.0f} prompt tokens, "
                  f"{s['known_tokens']:.0f} tokens generated before the kill, KV of {s['kv_loaded_tokens']:.0f} "
                  "tokens loaded from the store (median)",
              f"  restart to /health (engine start, recovery)    {s['engine_start_s']:7.1f} s",
              f"  /health to first resumed token, median (max)   {med(s['first_resumed_s']) * 1000:7,.0f} ms "
              f"({max(s['first_resumed_s'], default=float('nan')) * 1000:,.0f} ms)",
              f"  cold re-prefill of the same conversation      {med(s['cold_prefill_s']) * 1000:7,.0f} ms "
              f"({max(s['cold_prefill_s'], default=float('nan')) * 1000:,.0f} ms) (vllm serve, prompt + tokens so far)"]
    return "\n".join(lines)
