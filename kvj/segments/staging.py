"""Bounded staging memory for copies between devices and the store (pinned for CUDA)."""

from __future__ import annotations

import threading
from typing import Dict, List

import torch


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
        self._cached: Dict[int, List[torch.Tensor]] = {}
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
            free = self._cached.get(size)
            if free:
                self._cached_bytes -= size
                buf = free.pop()
                if buf.is_pinned() == pinned:
                    return buf
            while self._cached_bytes and self._cached_bytes + self._in_use > self.capacity:
                self._evict_one()
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        except BaseException:
            self.release_size(size)
            raise

    def _evict_one(self) -> None:
        for cls, bufs in self._cached.items():
            if bufs:
                bufs.pop()
                self._cached_bytes -= cls
                return

    def release(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        with self._cond:
            self._in_use -= size
            if self._cached_bytes + self._in_use + size <= self.capacity:
                self._cached.setdefault(size, []).append(buf)
                self._cached_bytes += size
            self._cond.notify_all()

    def release_size(self, size: int) -> None:
        with self._cond:
            self._in_use -= size
            self._cond.notify_all()
