"""The flush path: snapshot a tensor quickly, compress and write it durably in the background.

``submit`` copies the tensor into bounded staging memory (pinned, on a side CUDA stream, for
device tensors; a plain CPU snapshot otherwise) and returns a future. Worker threads compress
and write the segment through :class:`~kvj.store.SegmentStore`; ``on_durable(info)`` runs only
after the segment file and its directory entry are fsynced, so a journal record appended there
never points at data that could vanish. When staging is full ``submit`` blocks (backpressure,
never out-of-memory); when work queues up the codec steps down to faster choices.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from kvj.errors import InvalidArgument, JournalClosed
from kvj.segments import device
from kvj.segments.codecs import Codec
from kvj.segments.codecs.auto import Backpressure
from kvj.segments.tensors import copy_into, dtype_name
from kvj.segments.staging import StagingPool
from kvj.segments.store import SegmentInfo, SegmentStore

OnDurable = Callable[[SegmentInfo], None]
OnDurableMany = Callable[[List[SegmentInfo]], None]
#: Blocks copied into one staging buffer start at multiples of this (any dtype may view them).
_ALIGN = 64


class Flusher:
    """Background, bounded, durable segment writer.

    ``workers`` threads each compress and write one segment at a time (chunks of a segment are
    further parallelised by the store's pool). There are more of them than cores by default:
    a worker waiting for its segment's fsync uses no CPU, and while several wait at once the
    file system commits their fsyncs together (ext4 and XFS batch concurrent fsyncs into one
    journal commit), so a stream of small blocks is not one fsync latency per block.
    ``staging_bytes`` bounds snapshot memory.
    """

    def __init__(self, store: SegmentStore, workers: int = 8, staging_bytes: int = 256 << 20,
                 codec: Union[str, Codec] = "auto"):
        self.store = store
        self.codec = codec
        self.workers = max(1, int(workers))
        #: Segments that can be compressing at once: the pressure thresholds count in these.
        self._slots = min(self.workers, os.cpu_count() or 1)
        self.staging = StagingPool(staging_bytes)
        self.pressure = Backpressure()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvj-flush")
        self._lock = threading.Lock()
        self._pending = 0
        #: Moving share of put time spent waiting for compression rather than the disk.
        self._cpu_share = 0.0
        self._futures: "set[Future[SegmentInfo]]" = set()
        self._error: Optional[BaseException] = None
        self._closed = False

    # ------------------------------------------------------------------ submit side

    def submit(self, tensor: torch.Tensor, layout: Optional[Dict[str, Any]] = None,
               on_durable: Optional[OnDurable] = None,
               codec: Optional[Union[str, Codec]] = None) -> "Future[SegmentInfo]":
        """Snapshot ``tensor`` and queue it; the caller may modify ``tensor`` once this returns.

        Blocks while staging memory is full. Raises the first earlier I/O error of a worker
        (sticky: a segment that could not be made durable); other errors fail only their future.
        """
        with self._lock:
            if self._closed:
                raise JournalClosed("submit() on a closed Flusher")
            if self._error is not None:
                raise self._error
        dtype_name(tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        is_cuda = device.CUDA.is_device_tensor(tensor)
        buf = self.staging.acquire(nbytes, pinned=is_cuda)
        try:
            event = self._copy_in(tensor, buf[:nbytes], is_cuda)
        except BaseException:
            self.staging.release(buf)  # a failed download has settled its stream first
            raise
        with self._lock:
            self._pending += 1
            self._update_pressure()
        meta = (tensor.dtype, tuple(tensor.shape), layout, codec or self.codec)
        future = self._pool.submit(self._work, buf, nbytes, event, meta, on_durable)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        return future

    def submit_many(self, blocks: Union[torch.Tensor, Sequence[torch.Tensor]],
                    layouts: Sequence[Optional[Dict[str, Any]]], on_durable: Optional[OnDurableMany] = None,
                    codec: Optional[Union[str, Codec]] = None,
                    ready: Optional[Any] = None) -> "Future[List[SegmentInfo]]":
        """Store several blocks as one job: one pack, so one fdatasync and one directory fsync
        cover them all (``SegmentStore.put_many``); ``on_durable(infos)`` runs once every one is
        durable, and the future gives the infos, in order.

        ``blocks`` is a sequence of tensors, each copied into staging as :meth:`submit` does
        (the caller may modify them once this returns), or one contiguous host tensor whose
        first dimension indexes the blocks (block ``i`` is ``blocks[i]``): a step's blocks
        brought to the host by one copy. That buffer is read where it is, by the worker, after
        ``ready`` (the event of the copy filling it) has completed when given: keep it
        unchanged until the future is done. ``layouts`` has one entry per block. Raises as
        :meth:`submit`.
        """
        with self._lock:
            if self._closed:
                raise JournalClosed("submit_many() on a closed Flusher")
            if self._error is not None:
                raise self._error
        buf: Optional[torch.Tensor] = None
        events: List[Any] = []
        if isinstance(blocks, torch.Tensor):
            if blocks.dim() == 0 or device.CUDA.is_device_tensor(blocks) or not blocks.is_contiguous():
                raise InvalidArgument("submit_many takes one contiguous host tensor of blocks, or a sequence "
                                      "of tensors")
            dtype_name(blocks.dtype)
            n, size = blocks.shape[0], blocks[0].numel() * blocks.element_size() if blocks.shape[0] else 0
            source = blocks.reshape(-1).view(torch.uint8) if blocks.numel() else torch.empty(0, dtype=torch.uint8)
            spans = [(i * size, size) for i in range(n)]
            kinds = [(blocks.dtype, tuple(blocks.shape[1:]))] * n
            events = [ready] if ready is not None else []
        else:
            tensors = list(blocks)
            if ready is not None:
                raise InvalidArgument("ready is the copy event of one host buffer of blocks")
            for t in tensors:
                dtype_name(t.dtype)
            spans, end = [], 0
            for t in tensors:
                spans.append((end, t.numel() * t.element_size()))
                end += -(-spans[-1][1] // _ALIGN) * _ALIGN  # every block starts aligned for its dtype
            kinds = [(t.dtype, tuple(t.shape)) for t in tensors]
            buf = source = self.staging.acquire(end, pinned=any(device.CUDA.is_device_tensor(t) for t in tensors))
            try:
                for t, (off, nbytes) in zip(tensors, spans):
                    event = self._copy_in(t, buf[off:off + nbytes], device.CUDA.is_device_tensor(t))
                    if event is not None:
                        events.append(event)
            except BaseException:
                self.staging.release(buf)  # a failed download has settled its stream first
                raise
        layouts = list(layouts)
        if len(layouts) != len(spans):
            if buf is not None:
                self.staging.release(buf, reuse=not events)
            raise InvalidArgument(f"{len(spans)} blocks but {len(layouts)} layouts")
        with self._lock:
            self._pending += 1
            self._update_pressure()
        job = (buf, source, spans, kinds, layouts, events, codec or self.codec)
        future = self._pool.submit(self._work_many, job, on_durable)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: "Future[SegmentInfo]") -> None:
        with self._lock:
            self._futures.discard(future)

    def _copy_in(self, tensor: torch.Tensor, dest: torch.Tensor, is_cuda: bool) -> Optional[Any]:
        """Copy ``tensor``'s bytes into ``dest``; for CUDA on a side stream, returning its event."""
        if tensor.numel() == 0:
            return None
        view = dest.view(tensor.dtype).view(tensor.shape)
        if not is_cuda:
            copy_into(view, tensor)  # one strided pass
            return None
        return device.CUDA.download(tensor.detach(), view)

    def _update_pressure(self) -> None:
        """Step the codec down only when the queue backs up *and* compression is the bottleneck.

        When the disk is what holds the queue up, compression is free (the CPU waits anyway)
        and writing fewer bytes drains the queue sooner, so the codec is left alone.
        """
        queued = self._pending - self._slots
        full = self.staging.in_use / max(1, self.staging.capacity)
        if self._cpu_share <= 0.5:
            level = Backpressure.NORMAL
        elif queued >= 4 * self._slots or full >= 0.9:
            level = Backpressure.SATURATED
        elif queued >= self._slots or full >= 0.5:
            level = Backpressure.BUSY
        else:
            level = Backpressure.NORMAL
        self.pressure.set(level)

    def _observe(self, timings: Dict[str, float]) -> None:
        cpu = timings.get("compression", 0.0)
        total = cpu + timings.get("io", 0.0)
        if total > 0:
            self._cpu_share += 0.25 * (cpu / total - self._cpu_share)

    # ------------------------------------------------------------------ worker side

    @contextmanager
    def _job(self, buf: Optional[torch.Tensor], landed: bool) -> Iterator[List[bool]]:
        """Run one job: a failed write or fsync is kept as the flusher's error (final; a refused
        input is not), and its staging buffer goes back at the end, reused only once the copy
        filling it has landed (the job sets ``landed[0]``: a copy that may still run keeps it)."""
        state = [landed]
        try:
            yield state
        except BaseException as exc:
            if isinstance(exc, OSError):
                with self._lock:
                    if self._error is None:
                        self._error = exc
            raise
        finally:
            if buf is not None:
                self.staging.release(buf, reuse=state[0])
            with self._lock:
                self._pending -= 1
                self._update_pressure()

    def _work(self, buf: torch.Tensor, nbytes: int, event: Optional[Any],
              meta: Tuple[torch.dtype, Tuple[int, ...], Optional[Dict[str, Any]], Union[str, Codec]],
              on_durable: Optional[OnDurable]) -> SegmentInfo:
        dtype, shape, layout, codec = meta
        with self._job(buf, event is None) as landed:
            if event is not None:
                device.CUDA.wait(event)
                landed[0] = True
            raw = memoryview(buf[:nbytes].numpy()).cast("B") if nbytes else memoryview(b"")
            timings: Dict[str, float] = {}
            info = self.store.put_bytes(raw, dtype=dtype, shape=shape, layout=layout,
                                        codec=codec, pressure=self.pressure.level, timings=timings)
            with self._lock:
                self._observe(timings)
            if on_durable is not None:
                on_durable(info)
            return info

    def _work_many(self, job: Tuple[Any, ...], on_durable: Optional[OnDurableMany]) -> List[SegmentInfo]:
        buf, source, spans, kinds, layouts, events, codec = job
        with self._job(buf, not events) as landed:
            for event in events:
                device.CUDA.wait(event)
            landed[0] = True
            items = [(memoryview(source[off:off + n].numpy()).cast("B") if n else memoryview(b""), dtype, shape, layout)
                     for (off, n), (dtype, shape), layout in zip(spans, kinds, layouts)]
            timings: Dict[str, float] = {}
            infos = self.store.put_many(items, codec=codec, pressure=self.pressure.level, timings=timings)
            with self._lock:
                self._observe(timings)
            if on_durable is not None:
                on_durable(infos)
            return infos

    # ------------------------------------------------------------------ lifecycle

    @property
    def error(self) -> Optional[BaseException]:
        """The first worker I/O error, if any (then every later submit raises it)."""
        return self._error

    def drain(self) -> None:
        """Wait until every segment submitted so far is durable and reported (or failed).

        Raises the sticky error if a worker failed to write a segment.
        """
        with self._lock:
            outstanding = list(self._futures)
        wait(outstanding)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Finish queued work and stop the workers (the store stays open)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "Flusher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
