"""``kvj serve`` for the tests in ``tests/serve``: a server in a process group of its own
(``kvj.bench.serve.ServerProcess``: waited for through ``/health``, never a fixed sleep, killed as
a crash with the whole group), always cleaned up; and the SSE client (``kvj.bench.serve.sse``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Dict, Iterator, List, Optional

from kvj.bench.serve import ENGINE, ServerProcess, sse
from support.wait import wait_for

__all__ = ["KVJ", "WORKTREE", "Server", "data", "serving", "sse"]

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


def data(event: Dict[str, Any]) -> Any:
    """An event's JSON (None for ``[DONE]``)."""
    return None if event["data"] == "[DONE]" else json.loads(event["data"])
