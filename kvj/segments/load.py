"""Load: segments back onto a device, and into a paged KV cache in the right slots.

Paged-cache convention (``kvj.segments.kvblock``, spec in ``man/kvj-segment.5``): a
vLLM-like cache is one tensor per layer shaped ``[num_blocks, 2, block_size, num_kv_heads,
head_dim]`` (K at index 0, V at 1). A request's KV is flushed as **one segment per block**,
holding that block for every layer (:func:`gather_block`), shape ``[num_layers, 2,
block_size, num_kv_heads, head_dim]`` in the cache dtype, with the layout
:func:`paged_layout`. A block's content does not depend on where it sat in the old cache, so
identical prefix blocks of different requests share one key, and restore puts block ``i`` of
a request into ``new_block_ids[i]`` of the new cache, whatever ids it had before.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from kvj.errors import InvalidArgument, LayoutMismatch
from kvj.segments import device as cuda
from kvj.segments import kvblock
from kvj.segments.staging import StagingPool
from kvj.segments.store import SegmentStore

Device = Union[str, torch.device]

def paged_layout(model: str, kv_caches: Sequence[torch.Tensor]) -> Dict[str, Any]:
    """The layout every block segment of ``kv_caches`` carries (restore also takes 0.2's)."""
    _check_caches(kv_caches)
    return kvblock.of_caches(model, kv_caches).segment_layout()


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    if not kv_caches:
        raise InvalidArgument("kv_caches is empty")
    first = kv_caches[0]
    if first.dim() != 5 or first.shape[1] != 2:
        raise InvalidArgument("each cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim]")
    for c in kv_caches:
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise InvalidArgument("all layer caches must share shape, dtype and device")
    return first


def gather_block(kv_caches: Sequence[torch.Tensor], block_id: int) -> torch.Tensor:
    """One block of every layer, ``[num_layers, 2, block_size, heads, head_dim]`` (to flush)."""
    _check_caches(kv_caches)
    return torch.stack([c[block_id] for c in kv_caches])


#: Pinned staging shared by every ``load`` not given its own (pinned memory is costly to
#: allocate, so it is made once per process and reused; bounded like any StagingPool).
DEFAULT_STAGING_BYTES = 256 << 20
_default_staging: Optional[StagingPool] = None
_default_staging_lock = threading.Lock()


def default_staging() -> StagingPool:
    """The process-wide pinned staging pool ``load`` uses when none is given."""
    global _default_staging
    with _default_staging_lock:
        if _default_staging is None:
            _default_staging = StagingPool(DEFAULT_STAGING_BYTES, pinned=True)
        return _default_staging


def load(store: SegmentStore, key: str, device: Device = "cpu",
         expect_layout: Optional[Dict[str, Any]] = None,
         staging: Optional[StagingPool] = None) -> torch.Tensor:
    """One segment on ``device``: decoded in parallel chunks; via pinned staging for CUDA.

    The host waits only for this segment's copy (an event after it), never for the caller's
    stream; the staging buffer is reused once that copy is done. A bare ``"cuda"`` is the
    calling thread's current device.
    """
    target = cuda.CUDA.resolve(device)
    if target.type != "cuda":
        return store.get(key, target, expect_layout=expect_layout)
    info = store.info(key)
    pool = staging or default_staging()
    buf = pool.acquire(info.raw_size, pinned=True)
    try:
        return store.get(key, target, expect_layout=expect_layout, out=buf)
    finally:
        pool.release(buf)  # get returns (or raises) only once no copy reads the buffer


def load_many(store: SegmentStore, keys: Sequence[str], device: Device = "cpu",
              expect_layout: Optional[Dict[str, Any]] = None, workers: Optional[int] = None) -> List[torch.Tensor]:
    """Several segments, decoded concurrently (small segments are one chunk each).

    ``device`` is resolved here, in the caller's thread: a bare ``"cuda"`` means the caller's
    current device, not the worker threads' default (device 0); and the workers load with the
    caller's current stream as theirs, so the tensors are marked as used by the stream that
    will use them (not the workers' default stream), lest the allocator reuse them early.
    """
    target = cuda.CUDA.resolve(device)
    stream = cuda.CUDA.current_stream(target) if target.type == "cuda" else None

    def one(key: str) -> torch.Tensor:
        if stream is None:
            return load(store, key, target, expect_layout)
        with cuda.CUDA.use(stream):
            return load(store, key, target, expect_layout)

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        return list(pool.map(one, keys))


def restore_paged(store: SegmentStore, keys: Sequence[str], kv_caches: Sequence[torch.Tensor],
                  new_block_ids: Sequence[int], *, model: str, workers: Optional[int] = None,
                  staging: Optional[StagingPool] = None) -> None:
    """Scatter a request's block segments into ``kv_caches`` at ``new_block_ids``.

    ``keys[i]`` (see the module convention) goes to block ``new_block_ids[i]`` of every layer.
    Blocks are decoded in parallel into one staging buffer (pinned when the cache is on CUDA),
    each checked against the cache's layout before it is decoded and its shape after; only
    when all are in does anything reach the cache (a segment of another model or layout raises
    LayoutMismatch with every slot untouched), then ``kvj.segments.device.scatter_blocks`` puts
    them in: on the CPU one row copy per layer, on a GPU one non-blocking transfer on a side
    stream and one ``index_copy_`` per layer, which the host waits for (its event, not a stream).
    """
    first = _check_caches(kv_caches)
    if len(keys) != len(new_block_ids):
        raise InvalidArgument("keys and new_block_ids differ in length")
    ids = [int(b) for b in new_block_ids]
    if len(set(ids)) != len(ids) or any(not 0 <= b < first.shape[0] for b in ids):
        raise InvalidArgument("new_block_ids must be distinct slots of the cache")
    if not keys:
        return
    expected = kvblock.of_caches(model, kv_caches)
    block_shape = (len(kv_caches),) + tuple(first.shape[1:])
    is_cuda = cuda.CUDA.is_device_tensor(first)
    block_bytes = first[0].numel() * first.element_size() * len(kv_caches)
    total = block_bytes * len(keys)
    ids_at = -(-total // 8) * 8  # the block ids go up from the same pinned buffer, 8-aligned
    pool = staging or (default_staging() if is_cuda else StagingPool(total))
    buf = pool.acquire(ids_at + 8 * len(keys), pinned=is_cuda)
    try:
        # A key that recurs (a shared prefix block) is decoded once and its bytes copied.
        first_of: Dict[str, int] = {}
        for i, key in enumerate(keys):
            first_of.setdefault(key, i)
        slot = [buf[i * block_bytes:(i + 1) * block_bytes] for i in range(len(keys))]

        def one(i: int) -> None:
            layout = store.info(keys[i]).layout  # checked before decoding, the size on the way in
            expected.check(layout or {}, f"segment {keys[i]}")
            try:
                block = store.get(keys[i], expect_layout=layout, out=slot[i])
            except InvalidArgument:
                raise LayoutMismatch(f"segment {keys[i]} holds more than one block of this cache") from None
            if tuple(block.shape) != block_shape or block.dtype != first.dtype:
                raise LayoutMismatch(f"segment {keys[i]} holds {block.dtype} {list(block.shape)}, this cache's "
                                     f"blocks are {first.dtype} {list(block_shape)}")

        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as ex:
            list(ex.map(one, first_of.values()))
        for i, key in enumerate(keys):
            if first_of[key] != i:
                np.copyto(slot[i].numpy(), slot[first_of[key]].numpy())
        host = buf[:total].view(first.dtype).view((len(keys),) + block_shape)
        bufs = cuda.block_buffers(kv_caches, len(ids), buf[ids_at:ids_at + 8 * len(ids)].view(torch.long))
        moved = cuda.scatter_blocks(kv_caches, ids, host, bufs)
        moved.wait()  # the staging buffer is reused once the copy from it is done (and, the host
        # having waited, the caller's later work on any stream comes after the scatter)
    finally:
        pool.release(buf)  # scatter_blocks raises only once nothing reads the buffer
