"""A step's saves, on the serving thread without waiting: gathered in rounds, written by kvj's threads.

A block already durable is journaled again by reference. The others go through one gather per
round (on the compute stream, into a free ring slot, then for a device cache one copy into pinned
staging on kvj's side stream) and one job on kvj's save thread, which waits for that copy and hands
the blocks to the flusher; each block's SEGMENT record follows its segment's fsync. With no free
ring slot or staging (kvj is behind), the step's remaining blocks are not journaled, nor any later
block of those requests: a request's journaled blocks stay a prefix (docs/vllm.md).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple

import torch

import kvj
from kvj.integrations.vllm.buffers import Buffers
from kvj.integrations.vllm.durable import DurableBlocks
from kvj.integrations.vllm.plan import Save
from kvj.segments import device
from kvj.segments.flusher import Flusher
from kvj.segments.kvblock import KVBlockLayout
from kvj.segments.store import SegmentInfo

log = logging.getLogger("kvj.vllm")

#: Seconds between warnings that blocks were not journaled.
WARN_EVERY = 10.0


class Saves:
    """The worker's saves (module docstring); ``stats`` are the worker's counters, ``fail`` its failure."""

    def __init__(self, journal: "kvj.Journal", layout: KVBlockLayout, buffers: Buffers, blocks: DurableBlocks,
                 flusher: Flusher, stats: Dict[str, int], fail: Callable[[BaseException], None]):
        self.journal, self.layout, self.buffers, self.blocks = journal, layout, buffers, blocks
        self.flusher, self.stats, self.fail = flusher, stats, fail
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvj-save")
        self._gaps: Dict[str, int] = {}  #: journal id -> its first block not journaled (kvj was behind)
        self._pending: Dict[str, List["Future[Any]"]] = {}  #: journal id -> its saves not yet recorded
        self._rounds: Set["Future[None]"] = set()  #: jobs on the save thread not yet done
        self._lock = threading.Lock()
        self._warned = 0.0

    def save(self, saves: Sequence[Save]) -> None:
        """Gather the blocks not yet durable in rounds while a ring slot and staging are free; then
        journal the durable ones by reference."""
        copies: List[Save] = []
        refs: List[Tuple[Save, SegmentInfo]] = []
        skipped = 0
        for save in saves:
            known = self.blocks.known.get((save.chain, save.token_ids[-1]))
            if known is not None:
                refs.append((save, known))
            elif self._gapped(save):
                skipped += self._skip(save)
            else:
                copies.append(save)
        per = self.buffers.per_round
        for i in range(0, len(copies), per):
            if not self._gather_round(copies[i:i + per]):
                for save in copies[i:]:
                    skipped += self._skip(save)
                break
        for save, known in refs:
            if self._gapped(save):
                skipped += self._skip(save)
                continue
            self._pending.setdefault(save.jid, []).append(self._writer.submit(self._reference, save, known))
            self.stats["blocks_referenced"] += 1
            self.blocks.durable(save.chain, save.token_ids[-1], known)  # this rank holds it (again)
        if skipped:
            self.stats["steps_skipping"] += 1
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY:
                self._warned = now
                log.warning("kvj: behind the engine, %d block(s) of this step not journaled (%d in all); those "
                            "requests stay durable up to their last journaled block", skipped,
                            self.stats["blocks_skipped"])

    def _gapped(self, save: Save) -> bool:
        """Whether ``save`` comes at or after a block of its request that was not journaled."""
        gap = self._gaps.get(save.jid)
        return gap is not None and save.block >= gap

    def _skip(self, save: Save) -> int:
        """Count ``save`` not journaled; no later block of its request will be. Returns 1."""
        self._gaps[save.jid] = min(save.block, self._gaps.get(save.jid, save.block))
        self.stats["blocks_skipped"] += 1
        return 1

    def _gather_round(self, saves: Sequence[Save]) -> bool:
        """One gather of ``saves``' blocks, and one job for kvj's thread to write them; False
        (nothing done) when no staging slot or ring slot is free: kvj is behind."""
        n, lay = len(saves), self.layout
        slot = self.buffers.saves.take() if self.buffers.saves is not None else None
        if slot is None:
            return False
        bufs = self.buffers.take_ring()
        if not bufs:
            self.buffers.saves.give(slot)  # type: ignore[union-attr]
            return False
        host = slot[:n * lay.nbytes].view(lay.torch_dtype).view(n, *lay.shape)
        try:
            moved = device.gather_blocks(self.buffers.caches, [s.block_id for s in saves], host, bufs)
        except BaseException:
            self.buffers.saves.give(slot)  # type: ignore[union-attr]  # raises only once nothing writes it
            raise
        done: "Future[None]" = Future()
        for s in saves:
            self._pending.setdefault(s.jid, []).append(done)
        self.stats["rounds"] += 1
        job = self._writer.submit(self._write_round, slot, host, moved, list(saves), done)
        with self._lock:
            self._rounds.add(job)
        job.add_done_callback(self._round_done)
        return True

    def _round_done(self, job: "Future[None]") -> None:
        with self._lock:
            self._rounds.discard(job)

    def _write_round(self, slot: torch.Tensor, host: torch.Tensor, moved: device.Transfer, saves: List[Save],
                     done: "Future[None]") -> None:
        """On kvj's thread: wait for the round's copy, hand the blocks to the flusher where they
        are (one pack: one fdatasync); the staging slot is free again once the flusher is done."""
        pool = self.buffers.saves
        assert pool is not None
        landed = False
        try:
            moved.wait()
            landed = True
            layouts = [self.layout.segment_layout(save.token_ids, save.chain) for save in saves]
            written = self.flusher.submit_many(host, layouts, lambda infos: self._saved_many(saves, infos))
        except BaseException as exc:
            pool.give(slot, reuse=landed)
            self.fail(exc)
            done.set_exception(exc)
            return
        self.stats["blocks_saved"] += len(saves)

        def written_out(f: "Future[Any]") -> None:
            pool.give(slot)
            exc = f.exception()
            done.set_exception(exc) if exc is not None else done.set_result(None)
        written.add_done_callback(written_out)

    def _reference(self, save: Save, known: SegmentInfo) -> None:
        """On kvj's thread: claim ``known``'s segment (a use: compaction keeps it through its grace
        period) and journal the block by reference; a segment gone meanwhile is not journaled."""
        if not self.journal.store.claim_existing(known.key):  # the journal gives the claim back once recorded
            self.blocks.gone(save.chain, save.token_ids[-1])
            self.stats["blocks_skipped"] += 1
            return
        self.journal.store.note_use(known.key)
        self._record(save, known)

    def _saved_many(self, saves: List[Save], infos: List[SegmentInfo]) -> None:
        """On a flusher thread, once the blocks' segments are durable: their records."""
        for save, info in zip(saves, infos):
            self._record(save, info)
            self.blocks.durable(save.chain, save.token_ids[-1], info)

    def _record(self, save: Save, info: SegmentInfo) -> None:
        start = save.block * self.layout.block_size
        self.journal.flush(save.jid, save.block, token_range=(start, start + self.layout.block_size), info=info)

    def recorded(self, jid: str) -> "Future[None]":
        """Done once every save of request ``jid`` so far is recorded (its END may follow); it is finished."""
        self._gaps.pop(jid, None)
        return when_all(self._pending.pop(jid, []))

    def drain(self) -> None:
        """Wait until every round so far is handed to the flusher, then until the flusher is done."""
        with self._lock:
            rounds = list(self._rounds)
        wait(rounds)
        self.flusher.drain()

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def when_all(futures: Sequence["Future[Any]"]) -> "Future[None]":
    """A future done once all of ``futures`` are; it fails with the first of their errors."""
    done: "Future[None]" = Future()
    left = [len(futures)]
    lock = threading.Lock()
    errors: List[BaseException] = []

    def one(f: "Future[Any]") -> None:
        if f.exception() is not None:
            errors.append(f.exception())  # type: ignore[arg-type]
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done.set_exception(errors[0]) if errors else done.set_result(None)

    if not futures:
        done.set_result(None)
    for f in futures:
        f.add_done_callback(one)
    return done
