"""The content-addressed segment store: durable, deduplicated puts (``puts``) and verified gets.

A segment's key is its digest (``segfile``), so identical blocks are stored once and a key only
ever names the bytes it was computed from. Keys are validated before they touch a path; the
bytes live in a :class:`~kvj.segments.local.LocalDirBackend`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from kvj.fileio import FS, REAL_FS, Buffer
from kvj.names import check_key
from kvj.segments import segfile as seg
from kvj.segments.layout import check_layout
from kvj.segments.local import Keep, LocalDirBackend, ObjectStat
from kvj.segments.puts import SegmentInfo, SegmentPuts
from kvj.segments.source import Source, whole_if_small
from kvj.trust import check_owner

if TYPE_CHECKING:  # torch is imported where tensors are made, so header-only users start without it
    import torch

__all__ = ["SegmentInfo", "SegmentStore"]  # SegmentInfo: what puts and reads return


class SegmentStore(SegmentPuts):
    """Durable, deduplicated, verified tensor segments.

    ``threads`` sizes the pool that hashes and codes chunks. Puts note each key in the use log;
    with ``count_loads`` (a serving engine's store, not a check's) every load is noted too.
    """

    #: Reads refuse segments declaring more raw bytes (a hostile header allocates nothing); raise it for larger tensors.
    DEFAULT_MAX_SEGMENT_BYTES = 8 << 30

    def __init__(self, root: Union[str, os.PathLike], fs: FS = REAL_FS, threads: Optional[int] = None,
                 max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES, count_loads: bool = False):
        check_owner(root)  # as root, a store another user owns is refused (kvj.trust)
        pool = ThreadPoolExecutor(max_workers=threads or max(2, os.cpu_count() or 2), thread_name_prefix="kvj-chunk")
        super().__init__(LocalDirBackend(root, fs), pool, max_segment_bytes)
        self.count_loads = count_loads

    def close(self) -> None:
        """Stop the pool and drop every claim still held."""
        self._closed = True
        self.pool.shutdown(wait=True)
        self.unjournaled()

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def key_for(self, tensor: "torch.Tensor", layout: Optional[Dict[str, Any]] = None) -> str:
        """The key ``put`` would give ``tensor`` (a CPU tensor) under ``layout``."""
        from kvj.segments import tensors

        raw = tensors.tensor_bytes(tensor)
        return seg.compute_digest(raw, tensors.dtype_name(tensor.dtype), tensor.shape,
                                  seg.canonical_layout(layout), self.pool).hex()

    def counted_load(self, key: str) -> ContextManager[None]:
        """With ``count_loads``, note a load of ``key`` (get, verify, a reader of read_stored), served or not."""
        return self.backend.uses.counting(key) if self.count_loads else nullcontext()

    def io_counts(self) -> Dict[str, int]:
        """The backend's disk work so far: ``file_syncs``, ``dir_syncs``, ``bytes_written``."""
        return self.backend.io_counts()

    def read_stored(self, key: str) -> Buffer:
        """A segment's stored bytes, unchecked (``segfile.check_stored`` them before shipping them as good)."""
        return self.backend.get(check_key(key))

    def stat(self, key: str) -> ObjectStat:
        """Stored size and last use (store or dedup claim) of a segment; SegmentMissing if absent."""
        return self.backend.stat(check_key(key))

    def info(self, key: str) -> SegmentInfo:
        """Header-only look-up (the chunks are not read)."""
        with self._reading(key, counted=False) as (_src, header):
            return SegmentInfo.from_header(header)

    @contextmanager
    def _reading(self, key: str, counted: bool = True) -> Iterator[Tuple[Source, seg.Header]]:
        """``key``'s bytes (one open; a small file read whole, once) and its header, checked against the
        key; with ``counted``, a load for the use log whatever the block raises."""
        check_key(key)
        with self.counted_load(key) if counted else nullcontext(), self.backend.open(key) as opened:
            src = whole_if_small(opened)
            yield src, seg.read_header(src, key=key)

    def get(self, key: str, device: Union[str, "torch.device"] = "cpu",
            expect_layout: Optional[Dict[str, Any]] = None, out: Optional["torch.Tensor"] = None) -> "torch.Tensor":
        """Read, verify (every chunk CRC and the digest) and return the tensor on ``device``.

        ``expect_layout`` must equal the segment's layout (LayoutMismatch). ``out``: a uint8 CPU
        staging buffer (e.g. pinned) to decode into, reusable once this returns.
        """
        from kvj.segments import device as cuda
        from kvj.segments import tensors

        with self._reading(key) as (src, header):
            if expect_layout is not None:
                check_layout(header.layout, expect_layout, f"segment {src.name}")
            header, tensor = tensors.decode_into(src, out, pool=self.pool, max_raw=self.max_segment_bytes,
                                                 header=header)
        target = cuda.CUDA.resolve(device)
        if target.type == "cpu":
            return tensor
        if target.type != "cuda":
            return tensor.to(target)
        on_device, copied = cuda.CUDA.upload(tensor, target)
        cuda.CUDA.finish(copied, cuda.CUDA.side_stream(target, "h2d"))
        return on_device

    def verify(self, key: str) -> SegmentInfo:
        """Fully check a stored segment (``segfile.verify``); SegmentCorrupt on any mismatch."""
        with self._reading(key) as (src, header):
            seg.check_raw_limit(header, src.name, self.max_segment_bytes)
            seg.verify(src, pool=self.pool, header=header)
        return SegmentInfo.from_header(header)

    def exists(self, key: str) -> bool:
        return self.backend.exists(check_key(key))

    def keys(self) -> Iterator[str]:
        return self.backend.keys()

    def delete(self, key: str, older_than: Optional[float] = None) -> bool:
        """Remove a segment; with ``older_than`` only if no put stored or claimed it since. True if removed."""
        return bool(self.backend.delete_many([check_key(key)], older_than))

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None,
                    keep: Optional[Keep] = None) -> List[str]:
        """``delete`` the keys no writer claims and ``keep`` does not name, durably together; those removed."""
        return self.backend.delete_many([check_key(key) for key in keys], older_than, keep)

    def quarantine(self, key: str) -> str:
        """Move a (damaged) segment aside; later gets see it as missing."""
        return self.backend.quarantine(check_key(key))

    def quarantined_copies(self, key: Optional[str] = None) -> List[str]:
        """Where damaged copies of ``key`` (of every key, for None) were quarantined."""
        return self.backend.quarantined_copies(check_key(key) if key is not None else None)
