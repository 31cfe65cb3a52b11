"""Journaling a request's KV block by block, as the transformers integration and the demo's
engines do (kvj-segment(5), Requests of kvj.integrations.blocks).

Block ``b`` is segment ``b`` of its request, positions ``[b*block_size, (b+1)*block_size)``
of every layer, with the ids of its tokens and of the one after it: a request resumed after
its last durable block knows its next input. ``BlockJournal`` writes requests,
``resume_points`` reads them back, ``BlockJournal.load`` fetches their longest intact prefix.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from kvj.errors import FormatError, LayoutMismatch, SegmentCorrupt, SegmentMissing
from kvj.journal.state import JournalState, RequestState
from kvj.segments.kvblock import KVBlockLayout
from kvj.segments.load import load as load_segment

if TYPE_CHECKING:
    from kvj.journal.journal import Journal



def prompt_hash(prompt: Sequence[int]) -> str:
    """SHA-256 of the prompt's token ids (int64 little-endian), as recorded in the start record."""
    return hashlib.sha256(torch.tensor(list(prompt), dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class ResumePoint:
    """Where a journaled request can continue: KV for ``[0, position)`` from ``keys``, and
    ``tokens`` up to and including ``position``, the next input."""

    request_id: str
    prompt: List[int]
    max_new_tokens: int
    meta: Dict[str, Any]
    position: int
    tokens: List[int]
    keys: List[str]
    layouts: List[Dict[str, Any]]  #: each block's recorded layout; its segment must carry the same
    fallback: Optional[str] = None  #: why fewer blocks are used than the journal lists, if so


def _point(req_id: str, prompt: Optional[Sequence[int]], meta: Mapping[str, Any],
           segments: Iterable[Tuple[int, Optional[str], Optional[Sequence[int]], Mapping[str, Any]]],
           layout: KVBlockLayout, fallback: Optional[str] = None) -> ResumePoint:
    if prompt is None:
        raise FormatError(f"request {req_id}: its start record has no token ids; it cannot be resumed")
    prompt = [int(t) for t in prompt]
    max_new = meta.get("max_new_tokens")
    if not isinstance(max_new, int):
        raise FormatError(f"request {req_id}: its start record has no max_new_tokens")
    by_seg = {seg: (key, tokens, lay) for seg, key, tokens, lay in segments}
    bs = layout.block_size
    tokens, keys, layouts = list(prompt), [], []
    for b in range(len(by_seg) + 1):
        if b not in by_seg:
            later = [s for s in by_seg if s > b]
            if later:
                fallback = f"block {b} is not durable; blocks {sorted(later)} after it are not used"
            break
        key, span, lay = by_seg[b]
        layout.check(lay, f"request {req_id} segment {b}")
        ids = [int(t) for t in lay.get("token_ids", [])]
        start = b * bs
        known = tokens[start:start + bs + 1]  # the prompt's part of the block, and earlier blocks' next token
        if (key is None or span is None or tuple(span) != (start, start + bs) or len(ids) != bs + 1
                or ids[:len(known)] != known):
            fallback = f"segment {b} does not continue the request's tokens; resuming before it"
            break
        tokens[start:start + bs + 1] = ids
        keys.append(key)
        layouts.append(dict(lay))
    position = len(keys) * bs
    return ResumePoint(req_id, prompt, max_new, dict(meta), position, tokens[:max(position + 1, len(prompt))],
                       keys, layouts, fallback)


def resume_points(source: Union[JournalState, Mapping[str, Any]], layout: KVBlockLayout) -> List[ResumePoint]:
    """Resume points of every in-flight request (in start order), from ``kvj.replay`` state or a
    recovery manifest; ``LayoutMismatch`` for a segment of another model or geometry."""
    if isinstance(source, JournalState):
        reqs: List[RequestState] = sorted(source.in_flight(), key=lambda r: r.start_lsn)
        return [_point(r.id, r.tokens, r.meta,
                       ((s.seg, s.key, s.tokens, s.layout) for s in r.segments.values()), layout)
                for r in reqs]
    return [_point(r["id"], r.get("tokens"), r.get("meta") or {},
                   ((s["seg"], s.get("key"), s.get("tokens"), s.get("layout") or {}) for s in r.get("segments", [])),
                   layout, _manifest_fallback(r.get("fallback")))
            for r in source.get("requests", [])]


def _manifest_fallback(fallback: Any) -> Optional[str]:
    """A recovery manifest's fallback entry (segments dropped as damaged) as one line."""
    if not fallback:
        return None
    dropped = ", ".join(f"segment {d.get('seg')} {d.get('problem')}" for d in fallback.get("dropped", []))
    lost = fallback.get("lost_tokens") or ["?", "?"]
    return f"recover resumes at token {lost[0]} instead of {lost[1]}" + (f" ({dropped})" if dropped else "")


@dataclass
class _Progress:
    """How far a request's blocks are journaled, and the flushes not yet done."""

    next_block: int = 0
    pending: List["Future[int]"] = field(default_factory=list)


class BlockJournal:
    """Journals requests' KV block by block: ``start``, ``flush`` per completed block (returns at
    once, stored in the background), ``end`` (after every flush of the request)."""

    def __init__(self, journal: "Journal", layout: KVBlockLayout):
        self.journal = journal
        self.layout = layout
        self._requests: Dict[str, _Progress] = {}
        self._staging: Any = None

    def start(self, request_id: str, prompt: Sequence[int], max_new_tokens: int,
              meta: Optional[Mapping[str, Any]] = None) -> None:
        """Journal a new request: its prompt token ids and how many tokens it will generate."""
        self.journal.start(request_id, prompt_hash(prompt), [int(t) for t in prompt],
                           {**dict(meta or {}), "max_new_tokens": int(max_new_tokens),
                            "block_size": self.layout.block_size, "model": self.layout.model})
        self._requests[request_id] = _Progress()

    def adopt(self, point: ResumePoint) -> None:
        """Track a resumed request: its blocks below ``point.position`` are durable already."""
        self._requests[point.request_id] = _Progress(next_block=point.position // self.layout.block_size)

    def next_block(self, request_id: str) -> int:
        """Index of the request's first block not yet flushed."""
        return self._requests[request_id].next_block

    def flush(self, request_id: str, index: int, block: torch.Tensor, token_ids: Sequence[int]) -> "Future[int]":
        """Flush block ``index`` (``layout.shape``); ``token_ids`` are its tokens and the next one."""
        tracked = self._requests[request_id]
        bs = self.layout.block_size
        if index != tracked.next_block:
            raise FormatError(f"request {request_id}: block {index} flushed out of order "
                              f"(expected {tracked.next_block}); a stored block is never rewritten")
        if tuple(block.shape) != self.layout.shape or len(token_ids) != bs + 1:
            raise LayoutMismatch(f"block of shape {tuple(block.shape)} with {len(token_ids)} token ids does not "
                                 f"fit layout {self.layout.shape} (+{bs + 1} ids)")
        fut = self.journal.flush(request_id, index, block, token_range=(index * bs, (index + 1) * bs),
                                 layout=self.layout.segment_layout(token_ids))
        tracked.next_block += 1
        tracked.pending = [f for f in tracked.pending if not f.done()] + [fut]
        return fut

    def end(self, request_id: str, status: str = "ok") -> None:
        """Wait for the request's flushes, then journal its end."""
        tracked = self._requests.pop(request_id)
        for fut in tracked.pending:
            fut.result()
        self.journal.end(request_id, status)

    def load(self, point: ResumePoint, device: Union[str, torch.device] = "cpu") -> List[torch.Tensor]:
        """Fetch a resume point's blocks onto ``device``, in order; a missing or damaged segment
        ends the usable prefix, and ``point`` is cut back to it (saying so in ``fallback``)."""
        device = torch.device(device)
        if device.type == "cuda" and self._staging is None:  # reused pinned buffers for host-to-device copies
            from kvj.segments.staging import StagingPool
            self._staging = StagingPool(4 * self.layout.nbytes, pinned=True)
        blocks: List[torch.Tensor] = []
        for b, key in enumerate(point.keys):
            try:
                block = load_segment(self.journal.store, key, device, expect_layout=point.layouts[b], staging=self._staging)
            except (SegmentMissing, SegmentCorrupt) as exc:
                _cut(point, b, self.layout.block_size, f"segment {b} unreadable ({exc}); resuming before it")
                break
            if tuple(block.shape) != self.layout.shape or block.dtype != self.layout.torch_dtype:
                raise LayoutMismatch(f"request {point.request_id} segment {b} holds {tuple(block.shape)} "
                                     f"{block.dtype}, the cache wants {self.layout.shape} {self.layout.dtype}")
            blocks.append(block)
        return blocks


def _cut(point: ResumePoint, blocks: int, block_size: int, why: str) -> None:
    point.position = blocks * block_size
    point.keys = point.keys[:blocks]
    point.layouts = point.layouts[:blocks]
    point.tokens = point.tokens[:max(point.position + 1, len(point.prompt))]
    point.fallback = why
