"""The old, lenient CPU stand-in for ``kvj.segments.device.Cuda`` (ops never check devices, GPU-side
waits are no-ops), kept only until the training snapshot's tests move to the strict one in
``tests/support/fakecuda.py``; do not use it in new tests.

It models asynchronous copies.

Swap it in (``monkeypatch.setattr(device, "CUDA", FakeCuda())``) and the flush and restore
paths run their CUDA branches on CPU, through the same ``upload``/``download`` logic as on a
GPU. "Device" tensors are CPU tensors the fake made or adopted. What it models:

- a copy is *in flight* from the moment it is enqueued until the host waits on an event
  recorded after it on the same stream (or the stream is settled);
- an upload (host to device) copies at once, so kernels enqueued after it see the data, but
  if its host bytes change before it completes, that is recorded in ``violations`` (the
  real DMA would have read the new bytes);
- a download (device to host) fills the pinned destination with poison (0xA5) and delivers
  the data only when it completes, so a host that reads before waiting sees poison.

It also counts what the host waits for: ``event_waits``, ``stream_waits`` (settles), the
``blocking`` flag of every event it hands out is True like the real one's, and
``pinned_allocs``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from kvj.segments.device import Cuda, Device

POISON = 0xA5


@dataclass
class FakeStream:
    device: torch.device
    name: str
    log: List["Copy"] = field(default_factory=list)


@dataclass
class FakeEvent:
    stream: FakeStream
    upto: int
    blocking: bool = True


@dataclass
class Copy:
    stream: FakeStream
    host: torch.Tensor  # the host side: source of an upload, destination of a download
    kind: str  # "h2d" or "d2h"
    payload: torch.Tensor  # h2d: the host bytes at enqueue; d2h: the device data to deliver
    done: bool = False


def _span(t: torch.Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class FakeCuda(Cuda):
    def __init__(self, devices: int = 2):
        super().__init__()
        self.n_devices = devices
        self._devices: Dict[int, Tuple[int, torch.Tensor]] = {}  # storage ptr -> (index, storage owner)
        self._pinned: Dict[int, torch.Tensor] = {}
        self._local = threading.local()
        self._streams_by_key: Dict[Tuple[torch.device, str], FakeStream] = {}
        self._defaults: Dict[torch.device, FakeStream] = {}
        self.copies: List[Copy] = []
        self.events: List[FakeEvent] = []
        self.violations: List[str] = []
        self.event_waits = 0
        self.stream_waits = 0
        self.pinned_allocs = 0
        self.fail_next: Optional[str] = None  # "record" or "wait": raise once there
        self.lock = threading.RLock()

    # -- registry ----------------------------------------------------------------------------

    def adopt(self, tensor: torch.Tensor, index: int = 0) -> torch.Tensor:
        """Treat CPU ``tensor`` as living on cuda:``index``."""
        self._devices[tensor.untyped_storage().data_ptr()] = (index, tensor)
        return tensor

    def set_device(self, index: int) -> None:
        """torch.cuda.set_device for the calling thread."""
        self._local.device = index

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._devices

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return torch.device("cuda", self._devices[tensor.untyped_storage().data_ptr()][0])

    def resolve(self, device: Device) -> torch.device:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            return torch.device("cuda", getattr(self._local, "device", 0))
        return dev

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pinned

    def pinned(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self._pinned[buf.untyped_storage().data_ptr()] = buf
            self.pinned_allocs += 1
        return buf

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        assert device.type == "cuda" and device.index is not None and device.index < self.n_devices, device
        return self.adopt(torch.empty(shape, dtype=dtype), device.index)

    # -- streams -----------------------------------------------------------------------------

    def side_stream(self, device: torch.device, purpose: str) -> FakeStream:
        with self.lock:
            return self._streams_by_key.setdefault((device, purpose), FakeStream(device, purpose))

    def current_stream(self, device: torch.device) -> FakeStream:
        current = getattr(self._local, "streams", {}).get(device)
        if current is not None:
            return current
        with self.lock:
            return self._defaults.setdefault(device, FakeStream(device, "default"))

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        streams = self._local.__dict__.setdefault("streams", {})
        before = streams.get(stream.device)
        streams[stream.device] = stream
        try:
            yield
        finally:
            if before is None:
                del streams[stream.device]
            else:
                streams[stream.device] = before

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        src_dev, dst_dev = self.is_device_tensor(src), self.is_device_tensor(dst)
        if src_dev == dst_dev:  # a host-to-host or device-to-device copy: nothing to model
            dst.copy_(src)
            return
        device = self.device_of(src if src_dev else dst)
        stream = self.current_stream(device)
        with self.lock:
            if dst_dev:
                dst.copy_(src)
                op = Copy(stream, src, "h2d", src.detach().clone())
            else:
                op = Copy(stream, dst, "d2h", src.detach().clone())
                (dst.view(1) if dst.dim() == 0 else dst).view(torch.uint8).fill_(POISON)  # 0-dim: view needs a dim
            stream.log.append(op)
            self.copies.append(op)

    def record(self, stream: FakeStream) -> FakeEvent:
        with self.lock:
            if self.fail_next == "record":
                self.fail_next = None
                raise RuntimeError("injected: cudaEventRecord failed")
            event = FakeEvent(stream, len(stream.log))
            self.events.append(event)
            return event

    def _complete(self, ops: List[Copy]) -> None:
        for op in ops:
            if op.done:
                continue
            op.done = True
            if op.kind == "h2d":
                if not torch.equal(op.host, op.payload):
                    self.violations.append("a host buffer changed while its upload was in flight")
            else:
                op.host.copy_(op.payload)

    def wait(self, event: FakeEvent) -> None:
        with self.lock:
            if self.fail_next == "wait":
                self.fail_next = None
                raise RuntimeError("injected: cudaEventSynchronize failed")
            self.event_waits += 1
            self._complete(event.stream.log[:event.upto])

    def gpu_wait(self, stream: FakeStream, event: FakeEvent) -> None:
        pass  # copies already ran on the "GPU"; only the host's view is modelled

    def gpu_wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        pass

    def keep_alive(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        pass

    def settle(self, stream: FakeStream) -> bool:
        with self.lock:
            self.stream_waits += 1
            self._complete(stream.log)
        return True

    # -- what tests look at ------------------------------------------------------------------

    def in_flight(self, host: torch.Tensor) -> bool:
        """Whether a copy that is not done reads or writes any byte of ``host``."""
        lo, hi = _span(host)
        with self.lock:
            for op in self.copies:
                a, b = _span(op.host)
                if not op.done and a < hi and lo < b:
                    return True
        return False

    def finish_all(self) -> None:
        """Let every copy complete (as the GPU eventually would)."""
        with self.lock:
            self._complete(self.copies)


def any_in_flight(fake: FakeCuda, pool: Any) -> bool:
    """Whether any buffer cached in StagingPool ``pool`` (ready to be handed out) is in flight."""
    return any(fake.in_flight(buf) for bufs in pool._cached.values() for buf in bufs)
