"""What the connector's scheduler side and its workers tell each other each step (no vLLM needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class Start:
    vllm_id: str
    jid: str
    tokens: List[int]
    meta: Dict[str, Any]


@dataclass
class Save:
    jid: str
    block: int  #: index of the block in the request
    block_id: int  #: where it sits in the paged cache
    chain: str
    token_ids: List[int]  #: the block's tokens and the next one


@dataclass
class Load:
    vllm_id: str
    blocks: List[Tuple[int, str]]  #: (block id, chain key), in order from the request's first loaded block


#: A ``Finish`` status that journals nothing: the request stays in flight (kvj serve resumes it).
PARKED = "parked"


@dataclass
class Finish:
    vllm_id: str
    jid: str
    status: str
    resumes: List[str]  #: earlier incarnations it carries, ended "resumed" before it
    to: Optional[str] = None  #: with status "handoff": the engine that continues it (a HANDOFF record, not an END)


@dataclass
class StepPlan:
    """One step's work for the workers (the connector's metadata)."""

    starts: List[Start] = field(default_factory=list)
    tokens: List[Tuple[str, int, List[int]]] = field(default_factory=list)  #: (journal id, position, ids)
    saves: List[Save] = field(default_factory=list)
    loads: List[Load] = field(default_factory=list)
    finishes: List[Finish] = field(default_factory=list)
    reseeds: Dict[str, int] = field(default_factory=dict)  #: vLLM id -> sampler draws to replay


@dataclass
class WorkerNews:
    """Worker to scheduler, each step, keyed by the ranks that report it: a block, START or load
    counts once every rank has (the scheduler accumulates across steps); ``merge`` is the union."""

    durable: Dict[str, List[int]] = field(default_factory=dict)  #: chain key -> ranks with it durable
    lost: List[str] = field(default_factory=list)  #: chain keys that failed to load (on any rank)
    started: Dict[str, List[int]] = field(default_factory=dict)  #: vLLM id -> ranks with its START durable
    loaded: Dict[str, Dict[int, int]] = field(default_factory=dict)  #: vLLM id -> rank -> tokens loaded

    def merge(self, other: "WorkerNews") -> None:
        """Add ``other``'s reports to these."""
        for chain, ranks in other.durable.items():
            self.durable[chain] = sorted(set(self.durable.get(chain, [])) | set(ranks))
        self.lost += [c for c in other.lost if c not in self.lost]
        for rid, ranks in other.started.items():
            self.started[rid] = sorted(set(self.started.get(rid, [])) | set(ranks))
        for rid, by_rank in other.loaded.items():
            mine = self.loaded.setdefault(rid, {})
            for rank, n in by_rank.items():
                mine[rank] = mine.get(rank, 0) + n

    def __bool__(self) -> bool:
        return bool(self.durable or self.lost or self.started or self.loaded)
