"""Bounded staging memory for copies between devices and the store (pinned for CUDA)."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from kvj.errors import DeviceOutOfMemory
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


class SlotPool:
    """Equal staging buffers allocated once, taken without waiting: the staging of a path that
    must never block its caller (the vLLM connector's serving thread).

    ``take`` returns a free buffer or None (the caller skips, or tries again later); a buffer
    a copy may still touch goes back with ``give(buf, reuse=False)`` and is never handed out
    again. The memory is one allocation (pinned for CUDA) made here: DeviceOutOfMemory, with
    nothing kept, when the host cannot give it.
    """

    def __init__(self, slot_bytes: int, count: int, pinned: bool = False):
        self.slot_bytes = int(slot_bytes)
        self.count = max(1, int(count))
        nbytes = self.slot_bytes * self.count
        try:
            whole = device.CUDA.pinned(nbytes) if pinned else torch.from_numpy(np.empty(nbytes, np.uint8))
        except (RuntimeError, MemoryError) as exc:  # pinned: a plain RuntimeError ("CUDA error: out of memory")
            if not isinstance(exc, MemoryError) and "out of memory" not in str(exc):
                raise
            raise DeviceOutOfMemory(f"no room for {nbytes} bytes of {'pinned ' if pinned else ''}staging: "
                                    f"{exc}") from None
        #: a stack: the buffer given back last is taken first, so a light load keeps reusing the
        #: same few (their pages mapped and in cache: first touches of fresh pages cost more than
        #: decoding into them)
        self._free: List[torch.Tensor] = [whole[i * self.slot_bytes:(i + 1) * self.slot_bytes]
                                          for i in reversed(range(self.count))]
        self._lock = threading.Lock()
        self.retired = 0

    def take(self) -> Optional[torch.Tensor]:
        """A free buffer of ``slot_bytes``, or None when all are in use (never waits)."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, buf: torch.Tensor, reuse: bool = True) -> None:
        """Return ``buf``; ``reuse=False`` when a copy may still touch it (it is retired)."""
        with self._lock:
            if reuse:
                self._free.append(buf)
            else:
                self.retired += 1

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)
