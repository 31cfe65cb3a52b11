"""The prefix cache that survives restarts (issue 38 item 4): the KV blocks of ended requests are a
cache under the store's byte budget, evicted least recently used first, not orphans collected
after the grace period; fsck counts them as cached; the connector's durable blocks include them
after compaction dropped their requests."""

from __future__ import annotations

import time

import torch

import kvj
from kvj.integrations.vllm.durable import durable_blocks
from kvj.integrations.vllm.plan import Finish, Save, Start, StepPlan
from kvj.integrations.vllm.worker import WorkerJournal
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.ops.fsck import fsck
from kvj.segments.kvblock import FORMAT, LHNC, KVBlockLayout, chain_keys
from kvj.segments.store import SegmentStore

BLOCK = 4


def served(path: str) -> tuple:
    """A worker journal in which request r1 saved two KV blocks and ended, and r2 (in flight) one."""
    layout = KVBlockLayout("tiny@x", "float32", 2, 2, 8, BLOCK, LHNC)
    worker = WorkerJournal(path, layout, threads=1)
    gen = torch.Generator().manual_seed(3)
    worker.register([torch.randn(8, 2, BLOCK, 16, generator=gen) for _ in range(2)])
    tokens = list(range(300, 311))
    chains = chain_keys(layout.seed(), tokens, BLOCK)
    meta = {"format": "kvj-vllm-request/1", "prompt_len": 7}
    worker.step(StepPlan(starts=[Start("v1", "r1", tokens[:7], meta)], tokens=[("r1", 7, tokens[7:])],
                         saves=[Save("r1", b, 5 + b, chains[b], tokens[b * BLOCK:(b + 1) * BLOCK + 1]) for b in (0, 1)],
                         finishes=[Finish("v1", "r1", "stopped", [])]))
    other = [500 + t for t in range(6)]
    worker.step(StepPlan(starts=[Start("v2", "r2", other, meta)],
                         saves=[Save("r2", 0, 1, chain_keys(layout.seed(), other, BLOCK)[0], other[:BLOCK + 1])]))
    worker.drain()
    worker.close()
    return layout.seed(), chains[:2]


def seal(path: str) -> None:
    """Seal the log files so far (compaction folds sealed files only)."""
    with kvj.Journal.open(path, policy=CommitPolicy(file_size_limit=36)) as j:
        j.start(f"seal-{time.monotonic_ns()}", durable=True)


def test_blocks_of_ended_requests_are_a_cache_kept_under_a_budget_not_orphans(tmp_path):
    path = str(tmp_path / "j")
    seed, chains = served(path)
    state = kvj.replay(path)
    assert set(state.cache) == set(chains) and state.requests["r1"].ended
    cached = {state.cache[c].key for c in chains}
    seal(path)
    later = time.time() + 7200  # past the grace period and eviction's minimum age
    result = compact(path, grace=0, now=later, max_store_bytes=1 << 30)
    assert result.snapshot and not set(result.segments_removed) & cached  # a cache, not orphans
    after = kvj.replay(path)
    assert "r1" not in after.requests and set(after.cache) == set(chains)  # the snapshot keeps the cache
    assert set(durable_blocks(after, seed)) >= set(chains)  # the connector still finds them after a restart
    check = fsck(path)
    assert check.orphans == [] and check.cached == 2 and not check.errors


def test_without_a_budget_cached_blocks_are_collected_after_the_grace_period(tmp_path):
    path = str(tmp_path / "j")
    _seed, chains = served(path)
    cached = {kvj.replay(path).cache[c].key for c in chains}
    seal(path)
    result = compact(path, grace=0, now=time.time() + 7200)
    assert cached <= set(result.segments_removed)
    seal(path)
    compact(path, grace=0, now=time.time() + 7200)
    assert kvj.replay(path).cache == {}  # the next snapshot drops what the store no longer holds


def test_the_budget_evicts_the_least_recently_used_cached_block_and_never_one_in_flight(tmp_path):
    path = str(tmp_path / "j")
    _seed, chains = served(path)
    state = kvj.replay(path)
    first, second = (state.cache[c].key for c in chains)
    needed = set(state.referenced_keys())
    with SegmentStore(f"{path}/segments") as store:
        sizes = {key: store.stat(key).size for key in store.keys()}
        store.note_use(first)  # the first block was used since: the second is the least recent
    seal(path)
    budget = sum(sizes.values()) - 1
    result = compact(path, grace=3600, now=time.time() + 7200, max_store_bytes=budget)
    assert result.segments_evicted == [second] and not needed & set(result.segments_evicted)
    seal(path)
    compact(path, grace=3600, now=time.time() + 7200, max_store_bytes=budget)
    assert [ref.key for ref in kvj.replay(path).cache.values()] == [first]
    assert fsck(path).cached == 1


def test_the_cached_format_is_the_connector_s():
    from kvj.journal.state import CACHED_FORMATS

    assert FORMAT in CACHED_FORMATS
