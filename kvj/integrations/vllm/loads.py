"""Loads, asynchronous across steps and never waited for: in chunks of a staging slot's blocks.

Each chunk's blocks are read, checked (chunk CRCs, digest, layout) and decoded by kvj's loader
threads into a staging slot; ``poll`` (every step) copies a chunk in once its reads are done (one
copy to the device, one scatter) and frees its slot once that copy is. A load is finished once all
its chunks are in; its first failed block and all after it are load errors (vLLM recomputes them).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import torch

import kvj
from kvj.errors import LayoutMismatch, SegmentCorrupt
from kvj.integrations.vllm.buffers import Buffers
from kvj.integrations.vllm.durable import DurableBlocks
from kvj.integrations.vllm.plan import Load
from kvj.segments import device
from kvj.segments import segfile
from kvj.segments import tensors as seg
from kvj.segments.kvblock import KVBlockLayout
from kvj.segments.store import SegmentInfo

log = logging.getLogger("kvj.vllm")

#: A chunk's states: waiting for a staging slot, its blocks being read, read and checked
#: (waiting for a ring slot), copying into the cache, done (its slot given back).
QUEUED, READING, READ, COPYING, DONE = range(5)


@dataclass(eq=False)
class _Chunk:
    start: int  #: its blocks are the load's [start, end)
    end: int
    state: int = QUEUED
    slot: Optional[torch.Tensor] = None
    reads: List["Future[SegmentInfo]"] = field(default_factory=list)
    good: int = 0  #: blocks of it to copy in (once READ)
    copy: Optional[device.Transfer] = None


@dataclass(eq=False)
class _Loading:
    load: Load
    chunks: List[_Chunk]
    failed: Optional[int] = None  #: the first block not loaded (it and all after it are errors)


class Loads:
    """The worker's loads (module docstring); ``stats`` are the worker's counters."""

    def __init__(self, journal: "kvj.Journal", layout: KVBlockLayout, buffers: Buffers, blocks: DurableBlocks,
                 stats: Dict[str, int], threads: int):
        self.journal, self.layout, self.buffers, self.blocks, self.stats = journal, layout, buffers, blocks, stats
        self._loader = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvj-load")
        self._loading: List[_Loading] = []
        self._errors: Set[int] = set()

    def start(self, loads: List[Load]) -> None:
        """Queue ``loads``, in chunks; their reads start as staging slots are free (never waiting for one)."""
        for load in loads:
            n, per = len(load.blocks), self.buffers.per_round
            ld = _Loading(load, [_Chunk(i, min(n, i + per)) for i in range(0, n, per)])
            if self.buffers.loads is None:  # no staging: vLLM computes them all
                self._fail_load(ld, 0, None)
            self._loading.append(ld)
        self._start_reads()

    def _start_reads(self) -> None:
        """Start the reads of queued chunks, in arrival order, while staging slots are free."""
        pool, lay = self.buffers.loads, self.layout
        for ld in self._loading:
            for ch in ld.chunks:
                if ch.state != QUEUED or ld.failed is not None:
                    continue
                slot = pool.take() if pool is not None else None
                if slot is None:
                    return  # started once earlier chunks give their slots back
                ch.slot, ch.state = slot, READING
                read = self._read_block if self.buffers.on_device else self._read_into_cache
                ch.reads = [self._loader.submit(read, chain, slot[k * lay.nbytes:(k + 1) * lay.nbytes], block_id)
                            for k, (block_id, chain) in enumerate(ld.load.blocks[ch.start:ch.end])]

    def _read_into_cache(self, chain: str, out: torch.Tensor, block_id: int) -> SegmentInfo:
        """On a loader thread, for caches on the CPU: ``_read_block``, then the block into every layer
        here (vLLM touches no block of a loading request before the load is reported finished)."""
        info = self._read_block(chain, out)
        block = out.view(self.layout.torch_dtype).view(self.layout.shape)
        torch._foreach_copy_([cache[block_id] for cache in self.buffers.caches], list(block.unbind(0)))
        return info

    def _read_block(self, chain: str, out: torch.Tensor, block_id: int = -1) -> SegmentInfo:
        """On a loader thread: read, verify (chunk CRCs, digest, layout) and decode one block into ``out``."""
        entry = self.blocks.entry(chain)
        if entry is None:
            raise SegmentCorrupt(chain, None, "no durable block of this chain")
        key, layout = entry["key"], entry["layout"]
        self.layout.check(layout, f"segment {key}")
        store = entry.get("store") or self.journal.store  # another engine's, read-only: never touched
        with store.counted_load(key), store.backend.open(key) as src:  # read by chunk straight into ``out``
            header = segfile.read_header(src, key=key)  # checks the digest against the key
            if header.layout != layout or tuple(header.shape) != self.layout.shape or header.dtype != self.layout.dtype:
                raise LayoutMismatch(f"segment {src.name} holds {header.dtype} {header.shape} {header.layout}, "
                                     f"the journal says {self.layout.shape} {layout}")
            seg.decode_into(src, out, name=src.name, max_raw=store.max_segment_bytes, header=header)
        return SegmentInfo.from_header(header)

    def poll(self) -> Set[str]:
        """The loads finished since the last call: the copies of all their chunks are done (polled)."""
        done: Set[str] = set()
        still: List[_Loading] = []
        for ld in self._loading:
            if not self._advance(ld):
                still.append(ld)
                continue
            done.add(ld.load.vllm_id)
            good = len(ld.load.blocks) if ld.failed is None else ld.failed
            self.blocks.tokens_loaded(ld.load.vllm_id, good * self.layout.block_size)
        self._loading = still
        self._start_reads()
        return done

    def _advance(self, ld: _Loading) -> bool:
        """Move ``ld``'s chunks on as far as they go without waiting; True once all are done. Chunks
        are checked in order (the first failed block ends what is loaded); one read and checked is
        copied in as soon as a ring slot is free."""
        in_order = True  # every earlier chunk has been checked
        on_device = self.buffers.on_device
        for ch in ld.chunks:
            if ch.state == READING and all(f.done() for f in ch.reads):
                if ld.failed is not None:  # after a failed block: read, but not used
                    self._forget_lost(ld, ch)
                    self._give_chunk(ch)
                elif in_order:
                    self._check_chunk(ld, ch)
            if ch.state == READ:
                if ld.failed is not None:
                    ch.good = max(0, min(ch.good, ld.failed - ch.start))
                bufs = self.buffers.take_ring() if ch.good and on_device else None
                if bufs is False:  # no room on the device: vLLM computes this chunk and the rest
                    self._fail_load(ld, ch.start, None)
                    ch.good = 0
                if not ch.good:
                    self._give_chunk(ch)
                elif not on_device:  # the loader threads put the blocks in already
                    self.stats["blocks_loaded"] += ch.good
                    self._give_chunk(ch)
                elif bufs:
                    ids = [b for b, _ in ld.load.blocks[ch.start:ch.start + ch.good]]
                    host = ch.slot[:ch.good * self.layout.nbytes].view(self.layout.torch_dtype)  # type: ignore[index]
                    ch.copy = device.scatter_blocks(self.buffers.caches, ids, host.view(ch.good, *self.layout.shape),
                                                    bufs)
                    ch.state = COPYING
                    self.stats["blocks_loaded"] += ch.good
            if ch.state == COPYING and ch.copy is not None and ch.copy.done():  # later work on any stream sees it
                self._give_chunk(ch)
            in_order = in_order and ch.state not in (QUEUED, READING)
        return all(ch.state == DONE for ch in ld.chunks)

    def _check_chunk(self, ld: _Loading, ch: _Chunk) -> None:
        """A chunk's reads are done: its blocks up to the load's first failed one are to be copied."""
        for k, read in enumerate(ch.reads):
            chain = ld.load.blocks[ch.start + k][1]
            exc = read.exception()
            if exc is not None:
                log.warning("kvj: block %s not loaded (%s); vLLM recomputes it and what follows", chain[:16], exc)
                self._fail_load(ld, ch.start + k, ch)
                break
            self.blocks.loaded(chain, read.result())
            ch.good = k + 1
        ch.state = READ

    def _fail_load(self, ld: _Loading, first: int, ch: Optional[_Chunk]) -> None:
        """Block ``first`` of the load and all after it are load errors; chunks not started never
        start. ``ch``: the chunk whose read failed."""
        ld.failed = first
        ids = [b for b, _ in ld.load.blocks[first:]]
        self._errors.update(ids)
        self.stats["blocks_failed"] += len(ids)
        if ch is not None:
            self._forget_lost(ld, ch)
        for other in ld.chunks:
            if other.state == QUEUED:
                other.state = DONE

    def _forget_lost(self, ld: _Loading, ch: _Chunk) -> None:
        """The blocks of ``ch`` whose read failed are no longer durable here (news: lost)."""
        for k, read in enumerate(ch.reads):
            if read.done() and read.exception() is not None:
                self.blocks.lost(ld.load.blocks[ch.start + k][1])

    def _give_chunk(self, ch: _Chunk) -> None:
        """``ch`` is done: nothing reads or writes its slot any more."""
        if ch.slot is not None and self.buffers.loads is not None:
            self.buffers.loads.give(ch.slot)
        ch.slot, ch.state = None, DONE

    def errors(self) -> Set[int]:
        """Block ids that failed to load since the last call (``get_block_ids_with_load_errors``)."""
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._loader.shutdown(wait=True)

