"""``kvj serve`` for the tests in ``tests/serve``: a server in a process group of its own
(``benchmarks.serve.ServerProcess``: waited for through ``/health``, never a fixed sleep, killed as
a crash with the whole group), always cleaned up; and the SSE client (``benchmarks.serve.sse``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, Iterator, List, Optional

from benchmarks.serve import ENGINE, ServerProcess, sse
from support.wait import wait_for

__all__ = ["KVJ", "WORKTREE", "Server", "ballast", "data", "kvj", "normal", "serving", "sse", "tokens_and_text"]

WORKTREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVJ = os.path.join(os.path.dirname(sys.executable), "kvj")
START_TIMEOUT = 420.0  # a cold start took 40-57 s on the shared cores, 82 s under others' load


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(ServerProcess):
    """``kvj serve MODEL --journal JOURNAL`` (or ``command``) with the test engine's settings."""

    def __init__(self, model: str, journal: Optional[str], log: str, *extra: str, port: Optional[int] = None,
                 command: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None):
        port = port or free_port()
        argv = (command or [KVJ, "serve"]) + [model] + (["--journal", journal] if journal else []) + \
            ["--port", str(port), *ENGINE, *extra]
        super().__init__(argv, port, log, {"PYTHONPATH": WORKTREE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                           **(env or {})})

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds from the start to ``/health``; fails, with the log's tail, if the server exits."""
        def up() -> bool:
            assert self.proc.poll() is None, f"kvj serve exited with {self.proc.returncode}:\n{self.tail()}"
            return self.healthy()
        wait_for(up, "kvj serve's /health", timeout=timeout, interval=0.2)
        return super().wait_healthy(timeout=1)

    def tail(self, lines: int = 30) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def terminate(self, timeout: float = 60.0) -> float:
        """SIGTERM to the server, as systemd's KillMode=mixed sends it; seconds until it exited."""
        import signal
        import time

        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
        return time.monotonic() - t


@contextlib.contextmanager
def serving(*args: Any, **kwargs: Any) -> Iterator[Server]:
    """A started, healthy server, always cleaned up."""
    server = Server(*args, **kwargs)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.close()


#: Settings for a test that runs its ``ballast`` beside its own requests.
ROOMY = ("--max-num-seqs", "16")


def ballast(server: Server, model: str, tag: str, count: int = 4, tokens: int = 3900) -> List[str]:
    """``count`` background replies of ``tokens`` tokens, started and generating, that keep every
    engine step at ``count`` rows or more while a test's own requests run beside them.

    Why: MKL's float32 GEMM computes a row with other bits when a matrix has 1 to 3 rows than when
    it has 4 or more (torch 2.13, MKL 2024.2: ``(x[:m] @ w)[0]`` differs from ``(x @ w)[0]`` for
    m <= 3 only), so on vLLM's CPU backend a greedy reply is the same from run to run only when
    every step it takes part in has 4 rows or more. The test's requests arrive one by one and end
    one by one; without ballast their first and last steps have fewer rows, and a near-tie in a
    random model's logits turns the other way (a chat reply once differed at its 172nd token)."""
    import httpx

    ids = [f"resp_ballast_{tag}_{i}" for i in range(count)]
    for rid in ids:
        created = httpx.post(server.url + "/v1/responses", timeout=120, json={
            "model": model, "input": f"Ballast {rid}: the tide tables of the harbour.", "background": True,
            "max_output_tokens": tokens, "temperature": 0, "ignore_eos": True, "request_id": rid}).json()
        assert created["status"] == "queued", created

    def generating(rid: str) -> bool:
        reply = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=60).json()
        text = "".join(c.get("text", "") for item in reply.get("output") or [] for c in item.get("content") or [])
        return reply["status"] == "in_progress" and text != ""
    wait_for(lambda: all(generating(rid) for rid in ids), "the ballast replies generating", timeout=300,
             interval=0.1)
    return ids


def data(event: Dict[str, Any]) -> Any:
    """An event's JSON (None for ``[DONE]``)."""
    return None if event["data"] == "[DONE]" else json.loads(event["data"])


def normal(events: List[Dict[str, Any]], k: str) -> List[str]:
    """Events without what a reply's key and the server's clock stamp on them."""
    out = []
    for e in events:
        text = e["data"].replace(k, "KEY")
        text = re.sub(r'"(created|created_at)":\d+', '"created":0', text)
        out.append(re.sub(r"\b(msg|resp)_[0-9a-f]{16}\b", r"\1_X", text))
    return out


def tokens_and_text(name: str, events: List[Dict[str, Any]]) -> Any:
    """The token ids (``return_token_ids``) and the text a stream's events carry."""
    toks, text = [], ""
    for e in events:
        d = data(e)
        if d is None:
            continue
        if name == "responses":
            text += d.get("delta", "") if d.get("type") == "response.output_text.delta" else ""
            continue
        for c in d.get("choices", []):
            toks += c.get("token_ids") or []
            text += (c.get("delta") or {}).get("content") or c.get("text") or ""
    return toks, text


def kvj(*args: str) -> subprocess.CompletedProcess:
    """The ``kvj`` command of this worktree."""
    env = {**os.environ, "PYTHONPATH": WORKTREE}
    return subprocess.run([KVJ, *args], capture_output=True, text=True, env=env, timeout=300)
