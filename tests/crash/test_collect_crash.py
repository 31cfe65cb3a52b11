"""Collection at grace 0 inside a ``put_many``'s dedup claims, under simulated power loss.

Request A flushes three blocks through one ``put_many`` and ends: its segments are referenced by
nothing. Request B flushes two of the same blocks (dedup hits: claims on stored segments) and a
new one, and a compaction at grace 0 runs after B's claims and before its new member is written
(the window in which a dedup hit's segment was collected, and B's record then named a missing
segment). Every operation goes through a ``RecordingFS``; for every crash state a power loss
may leave, fsck finds nothing but a repairable torn tail, and once B's flushes were acknowledged
its segments restore bit-exactly.
"""

from __future__ import annotations

import os
import random
from typing import Dict

import torch
from support.crashcheck import add_figure, fsck_clean_or_repairable, read_records
from support.crashfs import FAST_FS, FIXED_PLANS, RecordingFS, iter_crash_states, random_plans

from kvj import CommitPolicy, Journal
from kvj.ops.compact import compact
from kvj.segments.load import load
from kvj.segments.store import SegmentStore

SEED = 4203


def block(n: int) -> torch.Tensor:
    return torch.randn((2, 16, 2, 8), generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)


def item(n: int):
    t = block(n)
    return memoryview(t.view(torch.uint8).numpy()).cast("B"), t.dtype, tuple(t.shape), {"block": n}


def flush(j: Journal, rid: str, blocks: list) -> Dict[str, torch.Tensor]:
    """``rid``'s blocks through one ``put_many``, each journaled by reference; key -> tensor."""
    infos = j.store.put_many([item(n) for n in blocks], codec="zstd")
    for s, info in enumerate(infos):
        j.flush(rid, s, token_range=(16 * s, 16 * s + 16), info=info).result()
    return {info.key: block(n) for info, n in zip(infos, blocks)}


def workload(fs: RecordingFS, path: str) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    with Journal.open(path, fs=fs, policy=CommitPolicy(max_delay=0.001)) as j:
        j.start("a", durable=True)
        tensors.update(flush(j, "a", [0, 1, 2]))
        j.end("a", durable=True)
        j.start("b", durable=True)
        store = j.store
        write_pack = store._write_pack
        compacted = []

        def compact_first(new, found):
            # B's dedup hits on A's segments are claimed; its new member is not written yet
            result = compact(path, store, grace=0, fs=fs)
            compacted.append(result.segments_removed)
            return write_pack(new, found)

        store._write_pack = compact_first
        tensors.update(flush(j, "b", [0, 1, 3]))
        store._write_pack = write_pack
        j.sync()
        fs.note("b acknowledged")
    assert compacted and [key for key in compacted[0] if key in tensors] == [store.key_for(block(2), {"block": 2})], \
        f"the compaction should collect A's block 2 alone, not B's claimed blocks: {compacted}"
    return tensors


def check(state: str, tensors: Dict[str, torch.Tensor], acknowledged: bool, context: str) -> None:
    journal = os.path.join(state, "j")
    if not os.path.isdir(journal):
        assert not acknowledged, f"the journal is gone after B was acknowledged [{context}]"
        return
    _state, records = read_records(journal)
    fsck_clean_or_repairable(journal, records, FAST_FS, f" [{context}]")
    replayed, _ = read_records(journal)
    b = replayed.requests.get("b")
    if acknowledged:
        assert b is not None and sorted(b.segments) == [0, 1, 2], f"B's acknowledged flushes are lost [{context}]"
    with SegmentStore(os.path.join(journal, "segments"), threads=1) as store:
        for req in replayed.in_flight():
            for ref in req.segments.values():
                assert torch.equal(load(store, ref.key), tensors[ref.key]), f"{req.id}/{ref.seg} differs [{context}]"


def test_a_put_many_claims_its_dedup_hits_against_a_compaction_at_grace_0_in_every_crash_state(tmp_path):
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    rec = str(tmp_path / "rec")
    fs = RecordingFS(rec)
    tensors = workload(fs, os.path.join(rec, "j"))
    n = 0
    for k, plan, state in iter_crash_states(fs, fs.crash_points, lambda k: list(FIXED_PLANS) + random_plans(rng, 3),
                                            str(tmp_path / "scratch")):
        context = f"crash after {k} ops ({fs.ops[k - 1].describe() if k else 'start'}), plan {plan.name}"
        check(state, tensors, "b acknowledged" in fs.notes(k), context)
        n += 1
    add_figure("collection crash states checked", n)
    assert n > 100
