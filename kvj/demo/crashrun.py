"""Crash experiments: run a journaled workload process, SIGKILL it, recover, compare.

Shared by the demo, the end-to-end tests and ``scripts/gpu_check.py``: ``start`` launches
a workload process (``python -m kvj.demo.worker ...``), ``kill_when`` reads its JSON-lines
progress until a predicate says "now", sends SIGKILL and collects every line the process
wrote before it died; ``finish`` runs one to completion; ``kvj`` runs the installed ``kvj``
console script (or its entry point when no script is on disk), exactly as an operator would;
``generation_kill_cycles`` chains kills and recoveries; ``uninterrupted_generation`` and
``uninterrupted_training`` compute what a run without a crash produces, for comparison.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from kvj.demo.training import TrainSpec
    from kvj.demo.workload import GenerationWorkload

Event = Dict[str, Any]


def worker(command: str, *args: str) -> List[str]:
    """The argv of a workload process (``generate`` or ``train``)."""
    return [sys.executable, "-m", "kvj.demo.worker", command, *args]


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
        """Generation: positions each request had KV for when it died (computed, or restored
        by a resumed process that had not computed more yet)."""
        out: Dict[str, int] = {}
        for e in self.events:
            if e.get("event") in ("step", "resumed"):
                out[e["id"]] = max(out.get(e["id"], 0), e["computed"] if e["event"] == "step" else e["position"])
        return out


def start(argv: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """Launch a workload process (``env``: variables to add to ours); its stderr goes to a
    temporary file (a pipe nobody reads while we follow stdout could fill up and stall it)."""
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                            env={**os.environ, **env} if env else None)
    proc.kvj_stderr = err  # type: ignore[attr-defined]
    return proc


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
        raise RuntimeError(f"workload exited {killed.returncode} before the kill: {_stderr(proc)[-3000:]}")
    return killed


def _stderr(proc: subprocess.Popen) -> str:
    err: Any = proc.kvj_stderr  # type: ignore[attr-defined]
    err.seek(0)
    return err.read().decode(errors="replace")


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


def nth_step(n: int) -> Callable[[Event], bool]:
    """Kill predicate: the ``n``-th progress event."""
    return nth_event("step", n)


def nth_event(name: str, n: int) -> Callable[[Event], bool]:
    """Kill predicate: the ``n``-th event named ``name``."""
    seen = [0]

    def now(event: Event) -> bool:
        seen[0] += event.get("event") == name
        return seen[0] >= n
    return now


def generation_kill_cycles(argv: List[str], kills: int, total_steps: int, r: random.Random) -> List[Dict[str, Any]]:
    """Run a generation workload, SIGKILL it ``kills`` times at random points (each restart
    resumes from ``kvj recover``'s manifest), then let it finish.

    Returns one entry per resumed run: the progress at the kill that preceded it, the
    manifest it resumed from, its ``resumed`` events, the first position each request
    ran through the model (``first_start``) and, for the run that finished, its summary.
    """
    cycles: List[Dict[str, Any]] = []
    resume: List[str] = []
    remaining = total_steps
    for k in range(kills + 1):
        cmd = argv + resume
        killed: Optional[Killed] = None
        if k == kills:
            events = finish(cmd)
        else:
            lo = max(1, remaining // 3)
            killed = kill_when(start(cmd), nth_step(r.randint(lo, max(lo, remaining * 3 // 4))))
            events = killed.events
            remaining = max(3, remaining - len(killed.last("step")))
        if cycles:
            first_start: Dict[str, int] = {}
            for e in events:
                if e.get("event") == "step":
                    first_start.setdefault(e["id"], e["start"])
            done = [e for e in events if e.get("event") == "done"]
            cycles[-1].update(resumed={e["id"]: e for e in events if e.get("event") == "resumed"},
                              first_start=first_start, summary=done[0]["requests"] if done else None)
        if killed is None or killed.finished:
            break
        doc = recover(argv[argv.index("--journal") + 1])
        cycles.append({"progress": killed.progress(), "manifest": doc["manifest"]})
        resume = ["--resume", "--manifest", doc["manifest_path"]]
    return cycles


def uninterrupted_generation(work: "GenerationWorkload", backend: str = "hf",
                             device: str = "cpu") -> Tuple[Dict[str, List[int]], int]:
    """Each request's output from a run without a crash, and the forward passes it took.
    Runs in this process: set torch's thread count as the workload processes do first."""
    from kvj.demo.generation import GenerationLoop
    from kvj.demo.backends import HFBackend, PagedBackend

    model = work.model.build(device)
    cls = HFBackend if backend == "hf" else PagedBackend
    loop = GenerationLoop(cls(model, work.block_size, work.model.model_id))
    for rid, prompt, max_new, _ in work.items():
        loop.submit(rid, prompt, max_new)
    out = loop.run()
    return out, sum(len(run.positions_run) for run in loop.finished.values())


def state_digests(tensors: Dict[str, List[Any]]) -> Tuple[str, str]:
    """SHA-256 of the parameters, and of parameters plus optimizer state (``Trainer.tensors()``)."""
    params = b"".join(t.cpu().numpy().tobytes() for t in tensors["params"])
    return (hashlib.sha256(params).hexdigest(),
            hashlib.sha256(params + b"".join(t.cpu().numpy().tobytes() for t in tensors["optimizer"])).hexdigest())


def uninterrupted_training(spec: "TrainSpec", device: str = "cpu") -> Tuple[str, str]:
    """``state_digests`` of a fine-tuning run without a crash (in this process; set torch's
    threads and deterministic mode as the workload processes do first)."""
    from kvj.demo.training import train

    trainer, _ = train(spec, device=device)
    return state_digests(trainer.tensors())
