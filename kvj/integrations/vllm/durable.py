"""Which KV blocks are durable: in a journal, on every rank, in another engine's journal, and on this
worker as it saves and loads them (with the news of it for the scheduler). No vLLM needed."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import kvj
from kvj.journal import ranks as rank_journals
from kvj.journal.config import default_store_path
from kvj.integrations.vllm.plan import WorkerNews
from kvj.segments import kvblock
from kvj.segments.store import SegmentInfo, SegmentStore

log = logging.getLogger("kvj.vllm")


def durable_blocks(state: "kvj.JournalState", seed: str) -> Dict[str, Dict[str, Any]]:
    """chain key -> {"key", "layout"} of every KV block segment of this chain seed in the journal
    (its requests', and its prefix cache's: blocks of requests that ended, ``JournalState.cache``)."""
    found: Dict[str, Dict[str, Any]] = {}
    refs = [ref for req in state.requests.values() for ref in req.segments.values()] + list(state.cache.values())
    for ref in refs:
        lay = ref.layout or {}
        if ref.key and lay.get("seed") == seed and lay.get("chain") and lay.get("format") == kvblock.FORMAT:
            found[lay["chain"]] = {"key": ref.key, "layout": lay}
    return found


def _replay(path: str) -> "kvj.JournalState":
    return kvj.replay(path) if os.path.isdir(path) else kvj.JournalState()


def durable_on_all_ranks(path: str, seed: str, tp_size: int, pp_size: int) -> Set[str]:
    """Chain keys of this seed that every rank's journal holds a durable block of."""
    found: Optional[Set[str]] = None
    for p in range(pp_size):
        for t in range(tp_size):
            mine = set(durable_blocks(_replay(rank_journals.rank_journal(path, t, p, tp_size, pp_size)), seed))
            found = mine if found is None else found & mine
    return found or set()


def source_chains(source: str, seed: str, tp_size: int, pp_size: int) -> Set[str]:
    """Chain keys of this seed durable in another engine's journal (read, never written); when it
    holds blocks but none of this layout, say why in one line: nothing of it will load."""
    found = durable_on_all_ranks(source, seed, tp_size, pp_size)
    if not found:
        journals = list(rank_journals.rank_journals(source).values()) or [source]
        others = {lay.get("seed") for j in journals for req in _replay(j).requests.values()
                  for ref in req.segments.values() for lay in [ref.layout or {}]
                  if lay.get("format") == kvblock.FORMAT}
        if others:
            log.warning("kvj: source %s holds KV blocks of another layout (model weights, dtype, block size or "
                        "parallel sizes differ: its layout seed %s, this engine's %s): none will load, its "
                        "requests are computed here", source, ",".join(sorted(map(str, others)))[:40], seed[:16])
    return found


class DurableBlocks:
    """This worker's durable blocks by chain key (its journal's, and its sources' read-only), the
    segment each (chain, next token) is in (journaled again by reference), and the news of both."""

    def __init__(self, path: str, seed: str, rank: int, sources: Sequence[str] = ()):
        self.rank = rank
        self.lock = threading.Lock()
        #: other engines' stores, read-only: blocks of theirs this worker may load (a handoff)
        self.sources: List[SegmentStore] = []
        self.entries: Dict[str, Dict[str, Any]] = {}  #: chain -> {"key", "layout"[, "store": a source's]}
        for source in sources:
            found = durable_blocks(_replay(source), seed)
            if found:
                ro = SegmentStore(default_store_path(source), threads=1)
                self.sources.append(ro)
                self.entries.update({chain: {**entry, "store": ro} for chain, entry in found.items()})
        self.entries.update(durable_blocks(_replay(path), seed))
        self.known: Dict[Tuple[str, int], SegmentInfo] = {}
        self.news = WorkerNews()

    def entry(self, chain: str) -> Optional[Dict[str, Any]]:
        with self.lock:
            return self.entries.get(chain)

    def durable(self, chain: str, next_token: int, info: SegmentInfo) -> None:
        """Its segment ``info`` is durable and recorded on this rank (saved, or journaled by reference)."""
        with self.lock:
            self.known[(chain, next_token)] = info
            self.entries[chain] = {"key": info.key, "layout": info.layout}
            self.news.durable[chain] = [self.rank]

    def loaded(self, chain: str, info: SegmentInfo) -> None:
        """Loaded from this journal: a later save of it is journaled by reference (a source's is saved anew)."""
        with self.lock:
            if "store" not in self.entries.get(chain, {}):
                self.known[(chain, int(info.layout["token_ids"][-1]))] = info

    def gone(self, chain: str, next_token: int) -> None:
        """Its segment was collected: it is saved anew."""
        with self.lock:
            self.known.pop((chain, next_token), None)

    def lost(self, chain: str) -> None:
        """It failed to load: not durable here any more (news: lost)."""
        with self.lock:
            self.entries.pop(chain, None)
            if chain not in self.news.lost:
                self.news.lost.append(chain)

    def tokens_loaded(self, vllm_id: str, tokens: int) -> None:
        with self.lock:
            by_rank = self.news.loaded.setdefault(vllm_id, {})
            by_rank[self.rank] = by_rank.get(self.rank, 0) + tokens

    def take_news(self) -> WorkerNews:
        with self.lock:
            news, self.news = self.news, WorkerNews()
        return news

    def close(self) -> None:
        for ro in self.sources:
            ro.close()
