"""``kvj serve`` in a process group of its own, for the tests in ``tests/serve``: start it, wait for
``/health`` (never a fixed sleep), kill the whole group (``kill -9`` of the server and its engine
processes, as a crash), stop it with SIGTERM; and an SSE client that reads a stream's events
(``id``, ``event``, ``data``), optionally going away after N of them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx

from support.wait import wait_for

WORKTREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVJ = os.path.join(os.path.dirname(sys.executable), "kvj")
#: vLLM's CPU backend on 2 shared cores (docs/serve.md, Tests): float32 is batch-invariant there; a
#: step budget that takes a whole prompt avoids chunked prefill, on which 0.32's CPU worker fails
#: for seeded requests.
ENGINE = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "4096", "--enforce-eager",
          "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(1 << 30), "--max-num-batched-tokens", "4096"]
START_TIMEOUT = 420.0  # a cold start took 40-57 s on the shared cores, 82 s under others' load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``kvj serve`` (or ``vllm serve``) process group."""

    def __init__(self, model: str, journal: Optional[str], log: str, *extra: str, port: Optional[int] = None,
                 command: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = (command or [KVJ, "serve"]) + [model] + (["--journal", journal] if journal else []) + \
            ["--port", str(self.port), *ENGINE, *extra]
        environ = {**os.environ, "PYTHONPATH": WORKTREE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **(env or {})}
        self.started = time.monotonic()
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environ,
                                         start_new_session=True)
        self.pgid = self.proc.pid

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds from the start to ``/health`` answering 200; fails (log tail included) if it dies."""
        def up() -> bool:
            assert self.proc.poll() is None, f"kvj serve exited with {self.proc.returncode}:\n{self.tail()}"
            return self.healthy()
        wait_for(up, "kvj serve's /health", timeout=timeout, interval=0.2)
        return time.monotonic() - self.started

    def tail(self, lines: int = 30) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def kill(self) -> None:
        """``kill -9`` of the whole process group: the server and every engine process."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        wait_for(lambda: not _group_alive(self.pgid), "the killed process group to be gone", timeout=60)

    def terminate(self, timeout: float = 60.0) -> float:
        """SIGTERM to the server, as systemd's KillMode=mixed sends it; seconds until it exited."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
        return time.monotonic() - t

    def close(self) -> None:
        """Whatever happened: nothing of it is left running."""
        if self.proc.poll() is None or _group_alive(self.pgid):
            self.kill()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextlib.contextmanager
def serving(*args: Any, **kwargs: Any) -> Iterator[Server]:
    """A started, healthy server, always cleaned up."""
    server = Server(*args, **kwargs)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.close()


Event = Dict[str, Any]


def sse(method: str, url: str, body: Optional[Dict[str, Any]] = None, headers: Optional[Dict[str, str]] = None,
        limit: Optional[int] = None, timeout: float = 600.0) -> Tuple[int, List[Event]]:
    """(status, events) of an SSE stream; stops reading (the client goes away) after ``limit`` events."""
    events: List[Event] = []
    current: Event = {}
    with httpx.stream(method, url, json=body, headers=headers or {}, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [{"data": r.text}]
        for line in r.iter_lines():
            if line.startswith("id: "):
                current["id"] = int(line[4:])
            elif line.startswith("event: "):
                current["event"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = line[6:]
            elif line == "" and current:
                events.append(current)
                current = {}
                if limit is not None and len(events) >= limit:
                    break
    return 200, events


def data(event: Event) -> Any:
    """An event's JSON (None for ``[DONE]``)."""
    return None if event["data"] == "[DONE]" else json.loads(event["data"])
