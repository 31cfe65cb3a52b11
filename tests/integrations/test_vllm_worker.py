"""The vLLM connector's worker side (``kvj.integrations.vllm_worker``), driven directly: no engine.

Caches are laid out as vLLM 0.32 allocates them: the CPU backend's contiguous
``[num_blocks, kv_heads, block, 2*head_dim]`` and FlashAttention's NHD-ordered cache seen
through the same logical view (``cache[block_id]`` is not contiguous). With the CUDA
stand-in they are "device" tensors: saves go gather -> pinned staging on a side stream, loads
pinned staging -> one copy -> scatter, through ``kvj.segments.device``.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import pytest
import torch
from support.fakecuda import FakeCuda
from support.wait import wait_for

import kvj
from kvj.integrations.vllm_worker import Finish, Load, Save, Start, StepPlan, WorkerJournal
from kvj.segments import device, kvblock
from kvj.segments.kvblock import LHNC, KVBlockLayout

L, H, BS, D, NB = 2, 2, 4, 8, 12
LAYOUT = KVBlockLayout("test-model", "bfloat16", L, H, D, BS, LHNC)
SEED = LAYOUT.seed()


def make_caches(order: str, seed: int = 0) -> List[torch.Tensor]:
    """Per-layer caches of logical shape [NB, H, BS, 2D]: contiguous (CPU backend) or a view of
    an [NB, BS, H, 2D] allocation (FlashAttention's NHD order)."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(L):
        if order == "HNC":
            caches.append(torch.randn(NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16))
        else:
            caches.append(torch.randn(NB, BS, H, 2 * D, generator=gen).to(torch.bfloat16).permute(0, 2, 1, 3))
    return caches


def tokens_of(n: int, base: int = 0) -> List[int]:
    return [(base + 7 * i) % 1000 for i in range(n)]


def saves_for(jid: str, tokens: List[int], block_ids: List[int]) -> List[Save]:
    chains = kvblock.chain_keys(SEED, tokens, BS)
    return [Save(jid, b, block_ids[b], chains[b], tokens[b * BS:(b + 1) * BS + 1]) for b in range(len(block_ids))]


def block_of(caches: List[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([c[block_id] for c in caches])


@pytest.fixture(params=["cpu", "cuda"])
def on(request, monkeypatch):
    """Caches on the CPU (vLLM's CPU backend) or on the stand-in's cuda:0."""
    if request.param == "cpu":
        return None
    fake = FakeCuda(devices=1)
    monkeypatch.setattr(device, "CUDA", fake)
    return fake


def place(caches: List[torch.Tensor], fake) -> List[torch.Tensor]:
    if fake is not None:
        for c in caches:
            fake.adopt(c, 0)
    return caches


@pytest.mark.parametrize("order", ["HNC", "NHD"])
def test_a_step_saves_its_blocks_and_a_restart_loads_them_bit_for_bit(tmp_path, on, order):
    journal = str(tmp_path / "j")
    src = place(make_caches(order), on)
    tokens = tokens_of(3 * BS + 2)
    ids = [5, 0, 9]
    worker = WorkerJournal(journal, LAYOUT, threads=2)
    worker.register(src)
    want = {b: block_of(src, ids[b]).clone() for b in range(3)}
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens[:BS + 1], {"prompt_len": BS + 1})],
                         saves=saves_for("e-r0", tokens, ids[:1])))
    worker.step(StepPlan(tokens=[("e-r0", BS + 1, tokens[BS + 1:])], saves=saves_for("e-r0", tokens, ids)[1:]))
    for c in src:  # vLLM overwrites the blocks once the step's gather is enqueued
        c.fill_(0)
    worker.step(StepPlan(finishes=[Finish("r0", "e-r0", "length", [])]))
    sending, _ = worker.poll()
    assert sending == {"r0"}
    worker.close()

    state = kvj.replay(journal)
    (req,) = state.requests.values()
    assert req.ended and req.status == "length" and req.tokens + req.output == tokens
    assert sorted(req.segments) == [0, 1, 2] and req.resume_position == 3 * BS
    assert state.counts["tokens"] == 1
    assert worker.stats["blocks_saved"] == 3 and worker.stats["rounds"] == 2

    # A restarted worker loads them into other blocks of fresh caches.
    dst = place([torch.zeros_like(c) for c in make_caches(order, seed=1)], on)
    again = WorkerJournal(journal, LAYOUT, threads=2)
    again.register(dst)
    chains = kvblock.chain_keys(SEED, tokens, BS)
    new_ids = [3, 11, 1]
    again.step(StepPlan())
    again.start_loads(StepPlan(loads=[Load("r1", list(zip(new_ids, chains)))]))
    recving: set = set()
    wait_for(lambda: recving.update(again.poll()[1]) or "r1" in recving, "the load")
    assert again.load_errors() == set()
    for b, block_id in enumerate(new_ids):
        assert torch.equal(block_of(dst, block_id), want[b]), f"block {b}"
    news = again.news()
    assert news is not None and news.loaded == {"r1": 3 * BS}
    again.close()
    if on is not None:
        assert on.violations == []


def test_a_damaged_block_is_reported_with_every_block_after_it(tmp_path):
    journal = str(tmp_path / "j")
    src = make_caches("HNC")
    tokens = tokens_of(3 * BS + 1)
    worker = WorkerJournal(journal, LAYOUT, threads=2)
    worker.register(src)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})], saves=saves_for("e-r0", tokens, [1, 2, 3])))
    worker.close()
    state = kvj.replay(journal)
    victim = state.requests["e-r0"].segments[1].key
    path = os.path.join(journal, "segments", "objects", victim[:2], victim + ".kvjseg")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0x40
    open(path, "wb").write(bytes(data))

    dst = [torch.zeros_like(c) for c in src]
    again = WorkerJournal(journal, LAYOUT, threads=2)
    again.register(dst)
    chains = kvblock.chain_keys(SEED, tokens, BS)
    again.start_loads(StepPlan(loads=[Load("r1", [(4, chains[0]), (5, chains[1]), (6, chains[2])])]))
    recving: set = set()
    wait_for(lambda: recving.update(again.poll()[1]) or "r1" in recving, "the load")
    assert again.load_errors() == {5, 6}  # the damaged block and the one after it: recomputed
    assert torch.equal(block_of(dst, 4), block_of(src, 1)) and not block_of(dst, 5).any()
    news = again.news()
    assert news.loaded == {"r1": BS} and news.lost == [chains[1]]
    again.close()
