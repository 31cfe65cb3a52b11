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


def test_no_room_for_the_gather_buffer_skips_the_steps_journaling_never_the_step(tmp_path, monkeypatch, caplog):
    """The device buffer is made once, outside vLLM's memory profile: when the device has no room
    for it, the step's blocks are not journaled (a warning) and the step goes on; the request's
    finish is still reported, so vLLM frees its blocks."""
    fake = FakeCuda(devices=1)
    monkeypatch.setattr(device, "CUDA", fake)
    real_empty = fake.empty
    refuse = [True]

    def empty(shape, dtype, dev):
        if refuse[0] and dtype == torch.uint8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real_empty(shape, dtype, dev)

    monkeypatch.setattr(fake, "empty", empty)
    src = place(make_caches("NHD"), fake)
    tokens = tokens_of(2 * BS + 1)
    worker = WorkerJournal(str(tmp_path / "j"), LAYOUT, threads=2)
    worker.register(src)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})], saves=saves_for("e-r0", tokens, [1])))
    assert worker.counters()["blocks_skipped"] == 1 and "no room" in caplog.text
    refuse[0] = False  # memory came back: the next step's blocks are journaled
    worker.step(StepPlan(saves=saves_for("e-r0", tokens, [1, 2])[1:], finishes=[Finish("r0", "e-r0", "ok", [])]))
    assert worker.poll()[0] == {"r0"}
    worker.close()
    req = kvj.replay(str(tmp_path / "j")).requests["e-r0"]
    assert req.ended and sorted(req.segments) == [1]
    assert fake.violations == []


def test_an_fp8_cache_round_trips_as_bytes(tmp_path):
    """vLLM 0.32 keeps an fp8 KV cache as uint8 (its CPU backend runs fp8 only with AVX-512 or AMX,
    which this machine lacks: the engine is not run with one here)."""
    layout = KVBlockLayout("test-model", "uint8", L, H, D, BS, LHNC, quant="fp8_e4m3")
    gen = torch.Generator().manual_seed(3)
    src = [torch.randint(0, 256, (NB, H, BS, 2 * D), generator=gen, dtype=torch.uint8) for _ in range(L)]
    tokens = tokens_of(BS + 1)
    chain = kvblock.chain_keys(layout.seed(), tokens, BS)[0]
    worker = WorkerJournal(str(tmp_path / "j"), layout, threads=2)
    worker.register(src)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})], saves=[Save("e-r0", 0, 6, chain, tokens)]))
    worker.close()
    dst = [torch.zeros_like(c) for c in src]
    again = WorkerJournal(str(tmp_path / "j"), layout, threads=2)
    again.register(dst)
    again.start_loads(StepPlan(loads=[Load("r1", [(2, chain)])]))
    wait_for(lambda: "r1" in again.poll()[1], "the load")
    assert torch.equal(block_of(dst, 2), block_of(src, 6))
    again.close()


EXIT = """
import sys, torch
from kvj.integrations.vllm_worker import Finish, Save, Start, StepPlan, WorkerJournal
from kvj.segments import kvblock
from kvj.segments.kvblock import LHNC, KVBlockLayout
layout = KVBlockLayout("test-model", "float32", 2, 2, 8, 4, LHNC)
caches = [torch.randn(8, 2, 4, 16) for _ in range(2)]
tokens = list(range(13))
chains = kvblock.chain_keys(layout.seed(), tokens, 4)
worker = WorkerJournal(sys.argv[1], layout, threads=1)
worker.register(caches)
for r in range(4):
    jid = f"e-r{r}"
    worker.step(StepPlan(starts=[Start(str(r), jid, tokens, {})],
                         saves=[Save(jid, b, b, chains[b], tokens[4 * b:4 * b + 5]) for b in range(3)],
                         finishes=[Finish(str(r), jid, "ok", [])]))
sys.exit(0)  # no close(): the engine process exits without vLLM's shutdown
"""


def test_a_process_that_exits_without_shutdown_drains_what_it_queued(tmp_path):
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", EXIT, str(tmp_path / "j")], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    state = kvj.replay(str(tmp_path / "j"))
    assert len(state.requests) == 4 and not state.in_flight(), "finished requests were left looking in flight"
    assert all(sorted(r.segments) == [0, 1, 2] for r in state.requests.values())
