"""Load: segments back onto a device, decoded in parallel, through pinned staging for CUDA.

``load`` brings one segment, ``load_many`` several at once; both share one process-wide
pinned staging pool (``default_staging``). Scattering KV blocks into a paged cache is the
KV block's own (``kvj.segments.kvblock.restore_paged``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from kvj.segments import device as cuda
from kvj.segments.staging import StagingPool
from kvj.segments.store import SegmentStore

Device = Union[str, torch.device]


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
