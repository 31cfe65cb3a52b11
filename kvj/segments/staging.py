"""Bounded staging memory for copies between devices and the store (pinned for CUDA)."""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

import numpy as np
import torch

from kvj.segments import device


class StagingPool:
    """Bounded staging memory: reusable uint8 buffers, power-of-two size classes.

    ``acquire`` blocks while the bytes in use plus the request would exceed ``capacity``; a
    single request larger than ``capacity`` is served once nothing else is in use, so it
    cannot deadlock. Freed buffers are kept for reuse (pinned ones are costly to allocate) and
    evicted when a new size class needs the room.
    """

    def __init__(self, capacity: int, pinned: bool = False):
        self.capacity = int(capacity)
        self.pinned = pinned
        self._cond = threading.Condition()
        self._in_use = 0
        #: Free buffers by (size class, pinned): a pageable request never takes (and drops) a
        #: pinned buffer, so mixed CPU and CUDA flushes do not thrash pinned allocations.
        self._cached: Dict[Tuple[int, bool], List[torch.Tensor]] = {}
        self._cached_bytes = 0
        self.peak_in_use = 0

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return 1 << max(12, (max(nbytes, 1) - 1).bit_length())

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._in_use

    def acquire(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        size = self._size_class(nbytes)
        with self._cond:
            while self._in_use and self._in_use + size > self.capacity:
                self._cond.wait()
            self._in_use += size
            self.peak_in_use = max(self.peak_in_use, self._in_use)
            free = self._cached.get((size, pinned))
            if free:
                self._cached_bytes -= size
                return free.pop()
            while self._cached_bytes and self._cached_bytes + self._in_use > self.capacity:
                self._evict_one()
        try:
            if pinned:
                return device.CUDA.pinned(size)
            # numpy asks the kernel for huge pages for large arrays: first touches fault a
            # 2 MiB page at a time, not 4 KiB (a fresh 64 MiB buffer cost ~40 ms of faults here)
            return torch.from_numpy(np.empty(size, np.uint8))
        except BaseException:
            self.release_size(size)
            raise

    def _evict_one(self) -> None:
        for (cls, _pinned), bufs in self._cached.items():
            if bufs:
                bufs.pop()
                self._cached_bytes -= cls
                return

    def release(self, buf: torch.Tensor, reuse: bool = True) -> None:
        """Return ``buf``; ``reuse=False`` when a copy may still touch it (it is never handed
        out again, only its bytes stop counting)."""
        size = buf.numel()
        pinned = device.CUDA.is_pinned(buf)
        with self._cond:
            self._in_use -= size
            if reuse and self._cached_bytes + self._in_use + size <= self.capacity:
                self._cached.setdefault((size, pinned), []).append(buf)
                self._cached_bytes += size
            self._cond.notify_all()

    def release_size(self, size: int) -> None:
        with self._cond:
            self._in_use -= size
            self._cond.notify_all()
