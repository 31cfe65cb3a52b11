"""The independent reader on the vLLM connector's records and block segments (kvj-segment(5), KV
BLOCKS, requests of the vLLM connector; kvj-journal(5), tokens).

The connector's worker side (``kvj.integrations.vllm.worker``, no vLLM needed) runs for real on
paged caches in vLLM's per-layer view, driven with the step plans its scheduler side sends; the
reader then checks the layout, seed, chained keys, bytes and the tokens records.
"""

from __future__ import annotations

import os

import torch

import kvj
from spec import reader

LAYERS, HEADS, BLOCK, HEAD = 2, 2, 4, 8


def test_vllm_blocks_carry_their_identity_chain_and_bytes(tmp_path):
    from kvj.integrations.vllm.plan import Finish, Save, Start, StepPlan
    from kvj.integrations.vllm.worker import WorkerJournal
    from kvj.segments.kvblock import LHNC, KVBlockLayout, chain_keys

    path = str(tmp_path / "j")
    layout = KVBlockLayout("tiny-llama@default", "bfloat16", LAYERS, HEADS, HEAD, BLOCK, LHNC)
    worker = WorkerJournal(path, layout, threads=1)
    gen = torch.Generator().manual_seed(11)
    caches = [torch.randn(8, HEADS, BLOCK, 2 * HEAD, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    worker.register(caches)
    tokens = list(range(300, 311))  # a 7-token prompt and 4 generated: two whole blocks and their next token
    chains = chain_keys(layout.seed(), tokens, BLOCK)
    where = {0: 5, 1: 2}  # block index -> block id in the paged cache
    saves = [Save("r1", b, where[b], chains[b], tokens[b * BLOCK:(b + 1) * BLOCK + 1]) for b in (0, 1)]
    meta = {"format": "kvj-vllm-request/1", "prompt_len": 7}
    worker.step(StepPlan(starts=[Start("v1", "r1", tokens[:7], meta)], tokens=[("r1", 7, tokens[7:])], saves=saves,
                         finishes=[Finish("v1", "r1", "stopped", [])]))
    worker.drain()
    # A second request with the same first block: journaled by reference, no second copy.
    worker.step(StepPlan(starts=[Start("v2", "r2", tokens[:5], meta)], saves=[Save("r2", 0, 7, chains[0], tokens[:5])]))
    worker.close()

    journal = reader.read_journal(path)
    store = reader.read_store(os.path.join(path, "segments"))
    reader.check_segment_records(journal, store)
    # Segment records follow their segments' fsyncs: those of one step may come in any order.
    records = sorted((r.payload for r in journal.records if r.rtype == 2), key=lambda p: (p["id"], p["seg"]))
    assert [(r["id"], r["seg"]) for r in records] == [("r1", 0), ("r1", 1), ("r2", 0)]
    assert records[2]["key"] == records[0]["key"] and len(store) == 2
    for rec in records[:2]:
        seg = store[rec["key"]]
        assert reader.check_layout(seg) == "kvj-kv-block/2"
        assert seg.layout["model"] == "tiny-llama@default" and seg.layout["order"] == "LHNC"
        assert seg.layout["chain"] == chains[rec["seg"]]
        block_id = where[rec["seg"]]
        assert seg.raw == b"".join(c[block_id].contiguous().view(torch.uint8).numpy().tobytes() for c in caches)
    assert [r.payload for r in journal.records if r.rtype == 9] == [{"id": "r1", "at": 7, "tokens": tokens[7:]}]
    folded = reader.fold(journal.records)["requests"]
    assert list(folded) == ["r2"] and folded["r2"]["output"] == []  # r1 ended
    ends = [r.payload for r in journal.records if r.rtype == 3]
    assert ends == [{"id": "r1", "status": "stopped"}]
    state = kvj.replay(path)
    assert state.requests["r1"].output == tokens[7:] and state.requests["r2"].resume_position == BLOCK
    # r1's blocks, its request ended, are the prefix cache (kvj-journal(5), REPLAY), by chain key
    cache = reader.fold(journal.records)["cache"]
    assert sorted(cache) == sorted(chains[:2]) == sorted(state.cache)
    assert {c: s["key"] for c, s in cache.items()} == {c: ref.key for c, ref in state.cache.items()}
