"""A deterministic multi-request greedy generation loop that journals KV and resumes from it.

The loop serves several requests interleaved (one step of each in turn) over a KV backend
(a transformers ``DynamicCache`` per request, or a paged cache). Every request follows one
fixed computation schedule: the prompt is prefilled in chunks that end on block
boundaries, then tokens are decoded one at a time. A request resumed from its last durable
block re-enters that schedule at a block boundary, with bit-identical KV before it, so each
recomputed position sees exactly the inputs it saw before the crash: the greedy output is
the uninterrupted run's, token for token, and only positions after the durable prefix
are computed again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence

import torch

from kvj.errors import FormatError
from kvj.integrations.blocks import BlockJournal, ResumePoint
from kvj.segments.kvblock import KVBlockLayout


class KVBackend(Protocol):
    """What the loop needs from a KV cache implementation."""

    layout: KVBlockLayout
    device: torch.device

    def forward(self, request_id: str, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start``... through the model, appending their KV to
        the request's cache (created on first use); return the last position's logits."""

    def block(self, request_id: str, index: int) -> torch.Tensor:
        """Block ``index`` of the request's KV, shaped ``layout.shape``."""

    def restore(self, request_id: str, blocks: List[torch.Tensor]) -> None:
        """Create the request's cache holding ``blocks`` (positions ``[0, len*block_size)``)."""

    def release(self, request_id: str) -> None:
        """Drop the request's cache."""


@dataclass
class RequestRun:
    """One request's progress, and what its resumption cost."""

    id: str
    prompt: List[int]
    max_new_tokens: int
    tokens: List[int]
    computed: int = 0  #: positions with KV in the cache
    restored: int = 0  #: positions whose KV came from the journal
    restore_s: float = 0.0  #: time to load and install the restored blocks
    forward_s: float = 0.0  #: time spent in the model for this request
    positions_run: List[int] = field(default_factory=list)  #: first position of every forward pass
    fallback: Optional[str] = None

    @property
    def done(self) -> bool:
        return len(self.tokens) >= len(self.prompt) + self.max_new_tokens

    @property
    def generated(self) -> List[int]:
        return self.tokens[len(self.prompt):]


class GenerationLoop:
    """Greedy generation for several requests at once, journaled block by block when a
    ``BlockJournal`` is given (none: a plain reference run)."""

    def __init__(self, backend: KVBackend, blocks: Optional[BlockJournal] = None, *,
                 on_step: Optional[Callable[[RequestRun], None]] = None,
                 on_finish: Optional[Callable[[RequestRun], None]] = None):
        if blocks is not None and blocks.layout != backend.layout:
            raise FormatError(f"journal layout {blocks.layout} differs from the cache's {backend.layout}")
        self.backend = backend
        self.blocks = blocks
        self.on_step = on_step
        self.on_finish = on_finish  #: called before the end record: deliver the output durably here
        self.active: Dict[str, RequestRun] = {}
        self.finished: Dict[str, RequestRun] = {}

    def submit(self, request_id: str, prompt: Sequence[int], max_new_tokens: int,
               meta: Optional[Mapping[str, object]] = None) -> RequestRun:
        """Add a new request (journaling its start)."""
        if not prompt or max_new_tokens < 1:
            raise FormatError("a request needs a non-empty prompt and max_new_tokens >= 1")
        if self.blocks is not None:
            self.blocks.start(request_id, prompt, max_new_tokens, meta)
        run = RequestRun(request_id, list(prompt), max_new_tokens, list(prompt))
        self.active[request_id] = run
        return run

    def resume(self, point: ResumePoint) -> RequestRun:
        """Continue a journaled request from its durable blocks: load them into the cache and
        recompute only the positions after them."""
        if self.blocks is None:
            raise FormatError("resuming needs a BlockJournal")
        t0 = time.perf_counter()
        blocks = self.blocks.load(point, self.backend.device)
        if blocks:
            self.backend.restore(point.request_id, blocks)
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize(self.backend.device)
        self.blocks.adopt(point)
        run = RequestRun(point.request_id, list(point.prompt), point.max_new_tokens, list(point.tokens),
                         computed=point.position, restored=point.position, restore_s=time.perf_counter() - t0,
                         fallback=point.fallback)
        self.active[point.request_id] = run
        return run

    def step(self) -> bool:
        """Advance every active request by one forward pass; False once none is left."""
        for run in list(self.active.values()):
            if not run.done:
                self._advance(run)
            if run.done:
                self._finish(run)
        return bool(self.active)

    def run(self) -> Dict[str, List[int]]:
        """Step until every request is finished; the generated token ids of each."""
        while self.step():
            pass
        return {rid: run.generated for rid, run in self.finished.items()}

    def _advance(self, run: RequestRun) -> None:
        bs, prompt_len = self.backend.layout.block_size, len(run.prompt)
        start = run.computed
        end = min(prompt_len, (start // bs + 1) * bs) if start < prompt_len else start + 1
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = self.backend.forward(run.id, run.tokens[start:end], start)
        run.computed = end
        if end >= prompt_len:
            run.tokens.append(int(torch.argmax(logits)))
        run.forward_s += time.perf_counter() - t0
        run.positions_run.append(start)
        if self.blocks is not None:
            b = self.blocks.next_block(run.id)
            while (b + 1) * bs <= run.computed:
                self.blocks.flush(run.id, b, self.backend.block(run.id, b), run.tokens[b * bs:(b + 1) * bs + 1])
                b += 1
        if self.on_step is not None:
            self.on_step(run)

    def _finish(self, run: RequestRun) -> None:
        if self.on_finish is not None:
            self.on_finish(run)
        if self.blocks is not None:
            self.blocks.end(run.id)
        self.backend.release(run.id)
        self.finished[run.id] = self.active.pop(run.id)
