"""The worker's bounded memory, made once: host staging for saves and for loads (pinned for a device
cache) when the caches are registered, and a small ring of device buffers on first use."""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence, Union

import torch

from kvj.errors import DeviceOutOfMemory
from kvj.segments import device
from kvj.segments.staging import SlotPool

log = logging.getLogger("kvj.vllm")

#: Default bounds: the device buffers (a ring of ``RING_SLOTS``) and each host staging pool, in bytes.
GATHER_BYTES = 64 << 20
STAGING_BYTES = 512 << 20
RING_SLOTS = 4
#: Seconds between tries to make the device buffers once the device had no room for them (a
#: failed device allocation makes torch free its cache, which synchronizes the device).
ROOM_RETRY = 60.0


class Buffers:
    """Staging slots of ``per_round`` blocks each (``saves``, ``loads``: None when the host had no
    room) and the device ring (``take_ring``); nothing is allocated during a step."""

    def __init__(self, gather_bytes: int = GATHER_BYTES, staging_bytes: int = STAGING_BYTES):
        self.gather_bytes, self.staging_bytes = int(gather_bytes), int(staging_bytes)
        self.caches: List[torch.Tensor] = []
        self.on_device = False
        self.per_round = 1  #: blocks one gather (or load chunk) takes
        self.saves: Optional[SlotPool] = None
        self.loads: Optional[SlotPool] = None
        self._slots = 1
        self._ids_host: Optional[torch.Tensor] = None  #: the ring's block ids on the host
        self._ring: Optional[device.BlockRing] = None
        self._no_room_at: Optional[float] = None  #: when the last try to make the ring failed

    def register(self, caches: Sequence[torch.Tensor], block_bytes: int) -> None:
        """Size the rounds for these caches and allocate the host staging now."""
        self.caches = list(caches)
        self.on_device = device.CUDA.is_device_tensor(self.caches[0])
        ring = RING_SLOTS if self.on_device else 1  # on the CPU a gather is done when it returns
        self.per_round = max(1, min(self.gather_bytes // ring, self.staging_bytes) // block_bytes)
        slots = max(1, self.staging_bytes // (self.per_round * block_bytes))
        try:
            self.saves = SlotPool(self.per_round * block_bytes, slots, pinned=self.on_device)
            self.loads = SlotPool(self.per_round * block_bytes, slots, pinned=self.on_device)
            if self.on_device:
                self._ids_host = device.CUDA.pinned(ring * self.per_round * 8).view(torch.long)
        except DeviceOutOfMemory as exc:
            self.saves = self.loads = None
            log.warning("kvj: %s: nothing is journaled nor loaded (serving goes on); lower staging_bytes", exc)
        self._slots = ring

    def take_ring(self) -> Union[device.BlockBuffers, None, bool]:
        """A free slot of the device buffers, made on first use; None when every slot is busy
        (a poll: never waits); False when the device has no room for them (vLLM may have taken
        it all: warned, and tried again after ``ROOM_RETRY`` seconds)."""
        if self._ring is None:
            now = time.monotonic()
            if self._no_room_at is not None and now - self._no_room_at < ROOM_RETRY:
                return False
            try:
                self._ring = device.BlockRing(self.caches, self.per_round, self._slots, self._ids_host)
            except DeviceOutOfMemory as exc:
                if self._no_room_at is None:
                    log.warning("kvj: %s: blocks of steps are not journaled (nor loaded) until there is room; "
                                "lower gpu_memory_utilization or gather_bytes", exc)
                self._no_room_at = now
                return False
            self._no_room_at = None
        return self._ring.take()
