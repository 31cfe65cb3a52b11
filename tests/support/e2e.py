"""Shared pieces of the end-to-end tests: seeded kill points and workload-like torch settings.

Kill points are random; the seed is printed (and taken from KVJ_E2E_SEED when set) so a
failure can be replayed exactly. Reference runs happen in the test process with the same
thread count as the workload processes (``--threads 1``), so they agree bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from kvj.demo.workload import GenerationWorkload


def rng(name: str) -> random.Random:
    seed = int(os.environ.get("KVJ_E2E_SEED", time.time_ns() % 1_000_000))
    print(f"{name}: KVJ_E2E_SEED={seed}")
    return random.Random(seed)


@contextlib.contextmanager
def workload_threads(deterministic: bool = False) -> Iterator[None]:
    """Run torch in this process as the workload processes do: one thread, and for
    training, deterministic algorithms."""
    threads, was = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(deterministic or was)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was)


def reference_generation(work, backend: str, device: str = "cpu"):
    """``crashrun.uninterrupted_generation`` with the workload processes' torch settings."""
    from kvj.demo import crashrun

    with workload_threads():
        return crashrun.uninterrupted_generation(work, backend, device)


def check_cycles(cycles, work: "GenerationWorkload") -> int:
    """Assertions shared by the generation kill tests; returns the positions restored in total."""
    bs, restored_total = work.block_size, 0
    for cycle in cycles:
        planned = {r["id"]: r for r in cycle["manifest"]["requests"]}
        assert set(cycle["resumed"]) <= set(planned)
        for rid, req in planned.items():
            pos = req["resume_position"]
            assert pos % bs == 0
            if rid not in cycle["resumed"]:
                continue  # its output was delivered before the kill; only its end record was lost
            assert pos <= cycle["progress"].get(rid, 0), "recovery claims KV the process never computed"
            assert cycle["resumed"][rid]["position"] == pos
            if rid in cycle["first_start"]:
                assert cycle["first_start"][rid] == pos, "recomputed tokens before the last durable segment"
            restored_total += pos
        if cycle["summary"] is not None:
            for rid, entry in cycle["summary"].items():
                if rid in planned:
                    assert entry["restored"] == planned[rid]["resume_position"]
                    assert entry["first_position"] in (None, entry["restored"])
                else:
                    assert entry["restored"] == 0 and entry["first_position"] == 0
    return restored_total
