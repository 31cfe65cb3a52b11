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
from typing import Iterator

import torch


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
    from kvj.integrations import crashrun

    with workload_threads():
        return crashrun.uninterrupted_generation(work, backend, device)
