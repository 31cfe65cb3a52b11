"""Run a journaled workload process, SIGKILL it at a chosen moment, and call the real CLI.

Shared by the demo and the end-to-end tests: ``start`` launches ``python -m
kvj.integrations ...``, ``kill_when`` reads its JSON-lines progress until a predicate says
"now", sends SIGKILL and collects every line the process wrote before it died;
``finish`` runs one to completion; ``kvj`` runs the installed ``kvj`` console script (or
its entry point when no script is on disk), exactly as an operator would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

Event = Dict[str, Any]


def worker(command: str, *args: str) -> List[str]:
    """The argv of a workload process (``generate`` or ``train``)."""
    return [sys.executable, "-m", "kvj.integrations", command, *args]


def kvj_argv() -> List[str]:
    """The ``kvj`` console script next to this interpreter, or its entry point."""
    script = shutil.which("kvj", path=os.path.dirname(sys.executable))
    if script is not None:
        return [script]
    return [sys.executable, "-c", "from kvj.cli.main import main; main()"]


def kvj(*args: str, check_codes: Sequence[int] = (0,), timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``kvj ARGS``; raise with its stderr unless its exit status is in ``check_codes``."""
    proc = subprocess.run(kvj_argv() + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "NO_COLOR": "1"})
    if proc.returncode not in check_codes:
        raise RuntimeError(f"kvj {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout[-2000:]}")
    return proc


@dataclass
class Killed:
    """What a killed process reported before it died."""

    events: List[Event] = field(default_factory=list)
    finished: bool = False  #: it ran to the end before the kill came
    returncode: Optional[int] = None

    def last(self, event: str) -> List[Event]:
        return [e for e in self.events if e.get("event") == event]

    def progress(self) -> Dict[str, int]:
        """Generation: positions each request had computed when it died."""
        out: Dict[str, int] = {}
        for e in self.last("step"):
            out[e["id"]] = max(out.get(e["id"], 0), e["computed"])
        return out


def start(argv: List[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)


def kill_when(proc: subprocess.Popen, now: Callable[[Event], bool], timeout: float = 300) -> Killed:
    """Read ``proc``'s events until ``now(event)``; SIGKILL it; return all it wrote.

    The kill lands while the process is mid-flight: it keeps computing while we read, so
    it dies a little after the event that triggered it, wherever it is then.
    """
    killed = Killed()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            event = json.loads(line)
            killed.events.append(event)
            if now(event):
                proc.send_signal(signal.SIGKILL)
                break
        for line in proc.stdout:  # what it wrote before the signal landed
            killed.events.append(json.loads(line))
        killed.returncode = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    killed.finished = killed.returncode == 0
    if killed.returncode not in (0, -signal.SIGKILL):
        stderr = proc.stderr.read() if proc.stderr is not None else ""
        raise RuntimeError(f"workload exited {killed.returncode} before the kill: {stderr[-3000:]}")
    if proc.stderr is not None:
        proc.stderr.close()
    return killed


def finish(argv: List[str], timeout: float = 600) -> List[Event]:
    """Run a workload process to the end; its events (raises with stderr on failure)."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:])} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def recover(journal: str) -> Dict[str, Any]:
    """``kvj fsck`` (repairing nothing) then ``kvj recover --json``: the manifest and its path."""
    kvj("fsck", "--journal", journal, check_codes=(0, 1))
    doc = json.loads(kvj("recover", "--journal", journal, "--json").stdout)
    return doc
