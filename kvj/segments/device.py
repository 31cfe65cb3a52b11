"""Copies between host and CUDA memory: the one module that touches streams, events and pinned memory.

The flush and restore paths reach the GPU only through :data:`CUDA`, so the CPU test suite
runs the very same paths with a stand-in that models asynchronous copies
(``tests/support/fakecuda.py``). The rules, from torch's semantics:

- ``copy_(..., non_blocking=True)`` from or into pinned memory returns before the copy is
  done: the host may touch or reuse that memory only after waiting on an event recorded
  after the copy;
- events are created with ``blocking=True``, so waiting sleeps in the driver instead of
  spinning a core the compressors need; the host waits on such an event, never on a whole
  stream (that would also wait for the caller's unrelated compute);
- copies run on kvj's own side streams; the caller's stream waits for them on the GPU
  (``wait_event``), and tensors crossing streams are ``record_stream``-ed so the caching
  allocator does not hand their memory out early;
- a bare ``"cuda"`` is the caller's current device, resolved in the caller's thread (worker
  threads start on device 0).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Tuple, Union

import torch

Device = Union[str, torch.device]


class Cuda:
    """The CUDA operations kvj's copy paths use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: Dict[Tuple[torch.device, str], Any] = {}

    # -- what is where ---------------------------------------------------------------------

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device

    def resolve(self, device: Device) -> torch.device:
        """``device`` as a torch.device; a bare ``"cuda"`` becomes the caller's current device."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return dev

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # -- memory ----------------------------------------------------------------------------

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 host buffer (asynchronous copies need one)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    # -- streams and events ----------------------------------------------------------------

    def side_stream(self, device: torch.device, purpose: str) -> Any:
        """kvj's stream for ``purpose`` (``"d2h"`` or ``"h2d"``) on ``device``, made once."""
        with self._lock:
            stream = self._streams.get((device, purpose))
            if stream is None:
                stream = self._streams[(device, purpose)] = torch.cuda.Stream(device=device)
            return stream

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    @contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` on the current stream (asynchronous for pinned memory)."""
        dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        """An event that completes when ``stream``'s work so far has (blocking: waits sleep)."""
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` completes."""
        event.synchronize()

    def gpu_wait(self, stream: Any, event: Any) -> None:
        """Make ``stream``'s later work wait for ``event``, on the GPU (the host goes on)."""
        stream.wait_event(event)

    def gpu_wait_stream(self, stream: Any, other: Any) -> None:
        """Make ``stream``'s later work wait for all of ``other``'s work so far, on the GPU."""
        stream.wait_stream(other)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor`` (no early reuse)."""
        tensor.record_stream(stream)

    @contextmanager
    def enqueue_on(self, stream: Any) -> Iterator[None]:
        """Enqueue the enclosed work on ``stream``; if enqueuing fails midway, wait for the
        stream before the error goes up, so buffers its copies touch are free again."""
        with self.use(stream):
            try:
                yield
            except BaseException:
                self.settle(stream)
                raise

    def finish(self, event: Any, stream: Any) -> None:
        """:meth:`wait` for ``event``, recorded on ``stream``; if waiting fails, settle the stream
        before raising, so buffers its copies touch are free again either way."""
        try:
            self.wait(event)
        except BaseException:
            self.settle(stream)
            raise

    def settle(self, stream: Any) -> bool:
        """After an error: wait until ``stream``'s copies are done; False if even that fails
        (then buffers they touch must never be reused)."""
        try:
            stream.synchronize()
            return True
        except Exception:
            return False

    # -- the two copies kvj makes ----------------------------------------------------------

    def upload(self, host: torch.Tensor, device: torch.device) -> Tuple[torch.Tensor, Any]:
        """Start copying ``host`` onto ``device``; returns the device tensor and the copy's event.

        The copy runs on kvj's h2d stream into memory allocated there; the caller's current
        stream waits for it on the GPU, so later work sees the data. The host must
        :meth:`wait` on the event before it reuses ``host``. If anything fails once the copy
        is enqueued, this waits for the stream before raising, so ``host`` is free again.
        """
        side = self.side_stream(device, "h2d")
        with self.enqueue_on(side):
            out = self.empty(tuple(host.shape), host.dtype, device)
            self.copy(out, host)
            event = self.record(side)
        current = self.current_stream(device)
        self.gpu_wait(current, event)
        self.keep_alive(out, current)
        return out, event

    def download(self, tensor: torch.Tensor, dest: torch.Tensor) -> Any:
        """Start copying device ``tensor`` into pinned ``dest``; returns the copy's event.

        The copy runs on kvj's d2h stream after the caller's queued work (which produced the
        data); the caller's later work (say, overwriting the block) waits for the copy on
        the GPU, without blocking the host. Wait on the event before reading ``dest``.
        """
        device = self.device_of(tensor)
        side = self.side_stream(device, "d2h")
        current = self.current_stream(device)
        self.gpu_wait_stream(side, current)
        with self.enqueue_on(side):
            self.copy(dest, tensor)
            event = self.record(side)
        self.keep_alive(tensor, side)
        self.gpu_wait(current, event)
        return event


#: The process-wide instance every copy path uses (tests swap in a CPU stand-in).
CUDA = Cuda()
