"""kvj's threads on the CPUs the engine's compute threads are not bound to: vLLM's CPU backend binds
its worker to some cores and reserves the others for helpers such as a KV connector (threads made by
the bound thread would otherwise share its cores)."""

from __future__ import annotations

import os
import threading
from typing import Set


def spare_cpus() -> Set[int]:
    """The CPUs this process may run on that the calling thread is not bound to: empty unless
    the caller is bound to some (as vLLM's CPU worker binds its compute threads)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    mine = os.sched_getaffinity(0)
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective", encoding="ascii") as f:
            allowed = _cpu_list(f.read())
    except (OSError, ValueError):
        allowed = set(range(os.cpu_count() or 1))
    return allowed - mine if mine < allowed else set()


def _cpu_list(text: str) -> Set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set."""
    cpus: Set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


class Placement:
    """Moves kvj's threads (named ``kvj-*``) onto the spare CPUs of the thread that made it; threads
    are made as work comes, so ``place`` runs every step, cheaply."""

    def __init__(self) -> None:
        self.spare = spare_cpus()
        self._placed: Set[int] = set()
        self._threads = 0

    def place(self) -> None:
        if not self.spare or threading.active_count() == self._threads:
            return
        self._threads = threading.active_count()
        for t in threading.enumerate():
            if t.name.startswith("kvj-") and t.native_id is not None and t.native_id not in self._placed:
                try:
                    os.sched_setaffinity(t.native_id, self.spare)
                except OSError:  # gone, or those CPUs are not ours after all
                    pass
                self._placed.add(t.native_id)
