"""Shared pieces of the end-to-end tests: seeded kill points, reference runs, the kill cycle.

Kill points are random; the seed is printed (and taken from KVJ_E2E_SEED when set) so a
failure can be replayed exactly. Reference runs happen in the test process with the same
thread count as the workload processes (``--threads 1``), so they agree bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Any, Dict, Iterator, List, Tuple

import torch

from kvj.integrations import crashrun
from kvj.integrations.workload import GenerationWorkload


def rng(name: str) -> random.Random:
    seed = int(os.environ.get("KVJ_E2E_SEED", time.time_ns() % 1_000_000))
    print(f"{name}: KVJ_E2E_SEED={seed}")
    return random.Random(seed)


@contextlib.contextmanager
def workload_threads() -> Iterator[None]:
    """Run torch in this process as the workload processes do (one thread, deterministic)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def reference_generation(work: GenerationWorkload, backend: str, device: str = "cpu") -> Tuple[Dict[str, List[int]], int]:
    """The uninterrupted run's output per request, and how many forward passes it made."""
    from kvj.integrations.hf import HFBackend
    from kvj.integrations.paged import PagedBackend
    from kvj.integrations.serving import GenerationLoop

    with workload_threads():
        model = work.model.build(device)
        cls = HFBackend if backend == "hf" else PagedBackend
        loop = GenerationLoop(cls(model, work.block_size, work.model.model_id))
        for rid, prompt, max_new, _ in work.items():
            loop.submit(rid, prompt, max_new)
        out = loop.run()
    return out, sum(len(run.positions_run) for run in loop.finished.values())


def nth_step(n: int):
    """Kill predicate: the ``n``-th progress event."""
    seen = [0]

    def now(event: Dict[str, Any]) -> bool:
        if event.get("event") == "step":
            seen[0] += 1
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
        if k == kills:
            events = crashrun.finish(cmd)
            killed = None
        else:
            lo = max(1, remaining // 3)
            target = r.randint(lo, max(lo, remaining * 3 // 4))
            killed = crashrun.kill_when(crashrun.start(cmd), nth_step(target))
            events = killed.events
            remaining = max(3, remaining - len(killed.last("step")))
        if cycles:
            done = [e for e in events if e.get("event") == "done"]
            first_start: Dict[str, int] = {}
            for e in events:
                if e.get("event") == "step":
                    first_start.setdefault(e["id"], e["start"])
            cycles[-1]["resumed"] = {e["id"]: e for e in events if e.get("event") == "resumed"}
            cycles[-1]["first_start"] = first_start
            cycles[-1]["summary"] = done[0]["requests"] if done else None
        if killed is None or killed.finished:
            break
        doc = crashrun.recover(argv[argv.index("--journal") + 1])
        cycles.append({"progress": killed.progress(), "manifest": doc["manifest"]})
        resume = ["--resume", "--manifest", doc["manifest_path"]]
    return cycles
