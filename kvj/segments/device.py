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

It also moves paged KV blocks (``gather_blocks``/``scatter_blocks``): a step's blocks of every
layer in one indexed copy per layer (one in all, for caches in one allocation: ``fused_view``)
and one transfer, through buffers allocated once.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from kvj.errors import DeviceOutOfMemory, InvalidArgument

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
        """kvj's stream for ``purpose`` (``"d2h"`` or ``"h2d"``) on ``device``, made once, and
        never the caller's current stream: ``torch.cuda.Stream()`` hands out pooled streams
        round-robin, and the caller's (vLLM's compute stream) may be one of them. Should the
        stream kvj holds be the current one, it takes the pool's next."""
        current = self.current_stream(device)
        with self._lock:
            stream = self._streams.get((device, purpose))
            while stream is None or stream == current:
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

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (a poll: the host never blocks)."""
        return bool(event.query())

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

        The copy runs on kvj's h2d stream into memory allocated there, which the caller's
        current stream will use (``record_stream``). The host must :meth:`finish` the event
        before it uses the tensor or reuses ``host``; work it enqueues after that wait comes
        after the copy on every stream. If anything fails once the copy is enqueued, this
        waits for the stream before raising, so ``host`` is free again.
        """
        side = self.side_stream(device, "h2d")
        with self.enqueue_on(side):
            out = self.empty(tuple(host.shape), host.dtype, device)
            self.copy(out, host)
            event = self.record(side)
        self.keep_alive(out, self.current_stream(device))
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


#: The process-wide instance every copy path uses.
CUDA = Cuda()


# -- paged KV blocks -------------------------------------------------------------------------
#
# A cache is one tensor per layer whose first dimension is the block: ``cache[b]`` is block
# ``b`` of that layer, of any shape and strides (vLLM's FlashAttention layout is a permuted
# view, where ``cache[b]`` is not contiguous). Blocks travel as ``[n, layers, *block]``,
# contiguous: each block's bytes of all layers in one piece.


@dataclass(eq=False)
class Transfer:
    """A gather or scatter of blocks: done once ``event`` (recorded on kvj's ``stream``) is;
    both are None on the CPU, where the work is done when the call returns."""

    event: Optional[Any] = None
    stream: Optional[Any] = None

    def done(self) -> bool:
        """Whether it has completed; a poll that never blocks (for loads across steps)."""
        return self.event is None or CUDA.done(self.event)

    def wait(self) -> None:
        """Block the host until it has completed (a worker thread, not the serving loop)."""
        if self.event is not None:
            CUDA.finish(self.event, self.stream)

    def fence(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the caller's current one) wait for it on the GPU, before
        its later work reads what it brought; the host goes on."""
        if self.event is not None:
            waiter = stream if stream is not None else CUDA.current_stream(self.stream.device)
            CUDA.gpu_wait(waiter, self.event)


@dataclass(eq=False)
class BlockBuffers:
    """Staging to move up to ``max_blocks`` blocks, allocated once (no device allocation per
    step): the block ids on the host (``ids_host``, pinned for CUDA) and, for CUDA caches, on
    the device (``ids``) with the blocks themselves (``blocks``, ``[max_blocks, layers,
    *block]``). They are busy until ``transfer``, the last gather or scatter using them, is done."""

    max_blocks: int
    ids_host: torch.Tensor
    ids: Optional[torch.Tensor] = None
    blocks: Optional[torch.Tensor] = None
    transfer: Optional[Transfer] = None

    def busy(self) -> bool:
        return self.transfer is not None and not self.transfer.done()

    def began(self, transfer: Transfer) -> Transfer:
        """Mark these buffers in use by ``transfer`` (until it is done), and return it."""
        self.transfer = transfer
        return transfer


def _check_caches(caches: Sequence[torch.Tensor]) -> torch.Tensor:
    if not caches:
        raise InvalidArgument("no caches given")
    first = caches[0]
    for c in caches:
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise InvalidArgument("all layer caches must share shape, dtype and device")
    return first


#: An integer dtype of each element size: blocks move as bits, so no indexing kernel needs to
#: support the cache's dtype (fp8 among them).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same size (same shape and strides)."""
    return t.view(_BITS[t.element_size()])


def fused_view(caches: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """All layers' caches as one ``[num_blocks, layers, *block]`` view, when they are views of one
    allocation at evenly spaced offsets with the same strides (vLLM 0.33+ keeps every layer in
    one int8 allocation, strided per-layer views): a gather or scatter is then one indexed copy,
    not one per layer. None otherwise."""
    first = _check_caches(caches)
    if len(caches) < 2:
        return None
    ptr = first.untyped_storage().data_ptr()
    step = caches[1].storage_offset() - first.storage_offset()
    if step <= 0:
        return None
    for layer, cache in enumerate(caches):
        if (cache.untyped_storage().data_ptr() != ptr or cache.stride() != first.stride()
                or cache.storage_offset() != first.storage_offset() + layer * step):
            return None
    return first.as_strided((first.shape[0], len(caches)) + tuple(first.shape[1:]),
                            (first.stride(0), step) + tuple(first.stride()[1:]), first.storage_offset())


def _pairs(caches: Sequence[torch.Tensor], blocks: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(cache side, blocks side) of each indexed copy a gather or scatter makes, as bits: one
    pair for caches in one allocation (``fused_view``), else one per layer."""
    fused = fused_view(caches)
    if fused is not None:
        return [(_bits(fused), _bits(blocks))]
    return [(_bits(cache), _bits(blocks[:, layer])) for layer, cache in enumerate(caches)]


def blocks_shape(caches: Sequence[torch.Tensor], n: int) -> Tuple[int, ...]:
    """The shape of ``n`` blocks of ``caches`` as they travel: ``[n, layers, *block]``."""
    return (n, len(caches)) + tuple(_check_caches(caches).shape[1:])


def block_buffers(caches: Sequence[torch.Tensor], max_blocks: int,
                  ids_host: Optional[torch.Tensor] = None) -> BlockBuffers:
    """Staging for moving up to ``max_blocks`` blocks of ``caches`` (allocate it at start-up);
    ``ids_host``: int64 host memory for the ids (pinned for CUDA), allocated when not given.

    Raises DeviceOutOfMemory, with nothing kept, if the device or pinned memory has no room.
    """
    first = _check_caches(caches)
    if max_blocks < 1:
        raise InvalidArgument("max_blocks must be at least 1")
    if ids_host is not None and (ids_host.dtype != torch.long or ids_host.numel() < max_blocks):
        raise InvalidArgument(f"ids_host must hold {max_blocks} int64 values")
    if not CUDA.is_device_tensor(first):
        return BlockBuffers(max_blocks, torch.empty(max_blocks, dtype=torch.long) if ids_host is None else ids_host)
    dev = CUDA.device_of(first)
    try:
        if ids_host is None:
            ids_host = CUDA.pinned(max_blocks * 8).view(torch.long)
        ids = CUDA.empty((max_blocks,), torch.long, dev)
        blocks = CUDA.empty(blocks_shape(caches, max_blocks), first.dtype, dev)
    except (RuntimeError, MemoryError) as exc:  # OutOfMemoryError is a RuntimeError too
        # a failed pinned allocation is a plain RuntimeError ("CUDA error: out of memory")
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "out of memory" not in str(exc):
            raise
        raise DeviceOutOfMemory(f"no room on {dev} for {max_blocks} blocks of staging: {exc}") from None
    return BlockBuffers(max_blocks, ids_host, ids, blocks)


class BlockRing:
    """A few BlockBuffers used in turn, so a gather or scatter never waits for an earlier one:
    ``take`` returns one whose transfer is done (a poll, the host never blocks), or None when
    every one is still busy (``busy`` counts those: the caller skips or retries later)."""

    def __init__(self, caches: Sequence[torch.Tensor], max_blocks: int, slots: int = 2,
                 ids_host: Optional[torch.Tensor] = None):
        """``ids_host``: int64 host memory for every slot's ids (``slots * max_blocks``, pinned for
        CUDA) allocated earlier, so that making the ring allocates device memory only."""
        n = max(1, slots)
        parts = [None if ids_host is None else ids_host[i * max_blocks:(i + 1) * max_blocks] for i in range(n)]
        self.slots: List[BlockBuffers] = [block_buffers(caches, max_blocks, part) for part in parts]
        self._next = 0
        self.busy = 0

    def take(self) -> Optional[BlockBuffers]:
        n = len(self.slots)
        for k in range(n):
            bufs = self.slots[(self._next + k) % n]
            if not bufs.busy():
                self._next = (self._next + k + 1) % n
                return bufs
        self.busy += 1
        return None


def _begin_move(caches: Sequence[torch.Tensor], block_ids: Sequence[int], host: torch.Tensor,
                bufs: BlockBuffers, distinct: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Check a gather's or scatter's arguments (``distinct``: no block id twice) and write the
    ids into ``bufs.ids_host``; returns the first cache and that view of the ids."""
    first = _check_caches(caches)
    ids = [int(b) for b in block_ids]
    if len(ids) > bufs.max_blocks:
        raise InvalidArgument(f"{len(ids)} blocks do not fit buffers for {bufs.max_blocks}")
    if any(not 0 <= b < first.shape[0] for b in ids):
        raise InvalidArgument(f"block ids must lie in [0, {first.shape[0]})")
    want = blocks_shape(caches, len(ids))
    if (host.device.type != "cpu" or host.dtype != first.dtype or tuple(host.shape[1:]) != want[1:]
            or host.shape[0] < len(ids) or not host.is_contiguous()):
        raise InvalidArgument(f"host blocks must be a contiguous CPU {first.dtype} tensor [>= {len(ids)}, "
                              f"{', '.join(map(str, want[1:]))}], not {host.dtype} {list(host.shape)}")
    if CUDA.is_device_tensor(first) and not CUDA.is_pinned(host):
        raise InvalidArgument("host blocks of a CUDA cache must be in pinned memory")
    if bufs.busy():
        raise InvalidArgument("these block buffers are still in use by an earlier transfer")
    if distinct and len(set(ids)) != len(ids):
        raise InvalidArgument("block ids to scatter into must be distinct")
    ids_host = bufs.ids_host[:len(ids)]
    ids_host.numpy()[:] = ids
    return first, ids_host


def _streams(first: torch.Tensor, side: str) -> Tuple[Any, Any]:
    """The caller's current stream and kvj's ``side`` stream on the device of CUDA cache ``first``."""
    dev = CUDA.device_of(first)
    return CUDA.current_stream(dev), CUDA.side_stream(dev, side)


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int], host: torch.Tensor,
                  bufs: BlockBuffers) -> Transfer:
    """Copy blocks ``block_ids`` of every layer into ``host[:n]`` (``[n, layers, *block]``).

    On CUDA the ids go up and one ``index_select`` per layer (one in all: ``fused_view``) gathers
    the blocks into ``bufs.blocks``, on the caller's current stream, after the kernels that wrote
    them and before any later one, so the blocks may be freed and reused as soon as this returns.
    kvj's d2h stream waits for that, copies the gathered blocks into pinned ``host`` and records
    the returned transfer's event; the caller's stream does not wait for the copy. Read ``host``
    (and reuse ``bufs``) only once the transfer is done. On the CPU the blocks are gathered
    straight into ``host``.
    """
    first, ids_host = _begin_move(caches, block_ids, host, bufs)
    n = len(ids_host)
    out = host[:n]
    if not CUDA.is_device_tensor(first):
        for cache, part in _pairs(caches, out):
            torch.index_select(cache, 0, ids_host, out=part)
        return bufs.began(Transfer())
    cu = CUDA
    current, side = _streams(first, "d2h")
    assert bufs.ids is not None and bufs.blocks is not None
    gathered = bufs.blocks[:n]
    with cu.enqueue_on(current):
        dev_ids = bufs.ids[:n]
        cu.copy(dev_ids, ids_host)
        for cache, part in _pairs(caches, gathered):
            # index_select writes through out's strides on CUDA (Indexing.cu, index_select_out_cuda_impl)
            torch.index_select(cache, 0, dev_ids, out=part)
    cu.gpu_wait_stream(side, current)
    with cu.enqueue_on(side):
        cu.copy(out, gathered)
        event = cu.record(side)
    cu.keep_alive(bufs.blocks, side)
    return bufs.began(Transfer(event, side))


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int], host: torch.Tensor,
                   bufs: BlockBuffers) -> Transfer:
    """Put ``host[i]`` (``[n, layers, *block]``) into block ``block_ids[i]`` of every layer.

    On CUDA kvj's h2d stream waits for the caller's queued work (which may still read those blocks'
    old contents), copies the ids and the pinned blocks up in one transfer each and
    ``index_copy_``s them into every layer (in one, for ``fused_view`` caches), then records the
    returned transfer's event. Neither the host nor the caller's stream waits: ``fence()`` the
    transfer before the caller's stream reads the blocks, or poll ``done()`` (a load across steps);
    ``host`` and ``bufs`` are in use until it is done. On the CPU the blocks are copied in before
    this returns.
    """
    first, ids_host = _begin_move(caches, block_ids, host, bufs, distinct=True)
    n = len(ids_host)
    src = host[:n]
    if not CUDA.is_device_tensor(first):
        _scatter_cpu(caches, src, ids_host)
        return bufs.began(Transfer())
    cu = CUDA
    current, side = _streams(first, "h2d")
    assert bufs.ids is not None and bufs.blocks is not None
    cu.gpu_wait_stream(side, current)
    with cu.enqueue_on(side):
        dev_ids, blocks = bufs.ids[:n], bufs.blocks[:n]
        cu.copy(dev_ids, ids_host)
        cu.copy(blocks, src)
        for cache, part in _pairs(caches, blocks):
            cache.index_copy_(0, dev_ids, part)
        event = cu.record(side)
    for t in (*caches, bufs.ids, bufs.blocks):
        cu.keep_alive(t, side)
    return bufs.began(Transfer(event, side))


def _scatter_cpu(caches: Sequence[torch.Tensor], host: torch.Tensor, index: torch.Tensor) -> None:
    """``cache[index[i]] = host[i, layer]`` for every layer, on CPU: numpy fancy-index
    assignments (a row copy per block, about 6x faster than ``index_copy_``, which copies
    element by element here), one for caches in one allocation, else one per layer."""
    idx = index.numpy()
    for cache, part in _pairs(caches, host):
        cache.numpy()[idx] = part.numpy()
