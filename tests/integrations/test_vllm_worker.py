"""The vLLM connector's worker side (``kvj.integrations.vllm.worker``), driven directly: no engine.

Caches are laid out as vLLM 0.32 allocates them: the CPU backend's contiguous
``[num_blocks, kv_heads, block, 2*head_dim]`` and FlashAttention's NHD-ordered cache seen
through the same logical view (``cache[block_id]`` is not contiguous). Under the strict CUDA
stand-in (``tests/support/fakecuda.py``) they live on ``cuda:0``, written by kernels the host
has not waited for: saves go gather -> pinned staging on kvj's side stream, loads pinned
staging -> one copy -> scatter, through ``kvj.segments.device``; device mixing raises, a read
before its copy is done sees poison, a race between streams raises.
"""

from __future__ import annotations

import os
from typing import Dict, List

import pytest
import torch
from support import fakecuda
from support.damage import flip_a_bit
from support.fakecuda import gpu  # noqa: F401 - the fixture
from support.wait import wait_for

import kvj
from kvj.integrations.vllm import buffers
from kvj.integrations.vllm.plan import Finish, Load, Save, Start, StepPlan
from kvj.integrations.vllm.worker import WorkerJournal
from kvj.segments import kvblock
from kvj.segments.kvblock import LHNC, KVBlockLayout
from kvj.segments.store import SegmentStore

L, H, BS, D, NB = 2, 2, 4, 8, 12
LAYOUT = KVBlockLayout("test-model", "bfloat16", L, H, D, BS, LHNC)
SEED = LAYOUT.seed()


def make_caches(order: str, seed: int = 0, dev: str = "cpu") -> List[torch.Tensor]:
    """Per-layer caches of logical shape [NB, H, BS, 2D] on ``dev``: contiguous (CPU backend) or a
    view of an [NB, BS, H, 2D] allocation (FlashAttention's NHD order); on a device, their values
    come from a copy the host has not waited for."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(L):
        values = torch.randn(NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16)
        if order == "HNC":
            cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16, device=dev)
        else:
            cache = torch.zeros(NB, BS, H, 2 * D, dtype=torch.bfloat16, device=dev).permute(0, 2, 1, 3)
            assert not cache[0].is_contiguous()
        cache.copy_(values.to(dev))
        caches.append(cache)
    return caches


def tokens_of(n: int, base: int = 0) -> List[int]:
    return [(base + 7 * i) % 1000 for i in range(n)]


def saves_for(jid: str, tokens: List[int], block_ids: List[int]) -> List[Save]:
    chains = kvblock.chain_keys(SEED, tokens, BS)
    return [Save(jid, b, block_ids[b], chains[b], tokens[b * BS:(b + 1) * BS + 1]) for b in range(len(block_ids))]


def block_of(caches: List[torch.Tensor], block_id: int) -> torch.Tensor:
    """A synchronized readback of one block of every layer."""
    return torch.stack([c[block_id].cpu() for c in caches])


def loaded(worker: WorkerJournal, vllm_id: str) -> None:
    """Poll until the worker reports ``vllm_id`` loaded; a simulated GPU runs its queued work
    between polls (it runs only when asked), as a real one does meanwhile."""
    done: set = set()

    def poll() -> bool:
        if fakecuda._ACTIVE is not None:
            fakecuda._ACTIVE.advance()
        done.update(worker.poll()[1])
        return vllm_id in done

    wait_for(poll, f"the load of {vllm_id}")


@pytest.mark.parametrize("order", ["HNC", "NHD"])
def test_a_step_saves_its_blocks_and_a_restart_loads_them_bit_for_bit(tmp_path, order):
    """On the CPU, as vLLM's CPU backend holds its caches."""
    save_then_load(tmp_path, order, "cpu")


@pytest.mark.parametrize("order", ["HNC", "NHD"])
def test_on_a_device_a_step_saves_its_blocks_and_a_restart_loads_them_bit_for_bit(gpu, tmp_path, order):
    """On the strict stand-in's cuda:0 (leaving out the wait for a save's copy, or reporting a
    load before its copy is done, fails this)."""
    save_then_load(tmp_path, order, "cuda:0")


def save_then_load(tmp_path, order: str, dev: str) -> None:
    journal = str(tmp_path / "j")
    src = make_caches(order, dev=dev)
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
    dst = make_caches(order, seed=1, dev=dev)
    again = WorkerJournal(journal, LAYOUT, threads=2)
    again.register(dst)
    chains = kvblock.chain_keys(SEED, tokens, BS)
    new_ids = [3, 11, 1]
    again.step(StepPlan())
    again.start_loads(StepPlan(loads=[Load("r1", list(zip(new_ids, chains)))]))
    loaded(again, "r1")
    assert again.load_errors() == set()
    for b, block_id in enumerate(new_ids):
        assert torch.equal(block_of(dst, block_id), want[b]), f"block {b}"
    news = again.news()
    assert news is not None and news.loaded == {"r1": {0: 3 * BS}}
    again.close()


def test_a_damaged_block_is_reported_with_every_block_after_it(tmp_path):
    journal = str(tmp_path / "j")
    src = make_caches("HNC")
    tokens = tokens_of(3 * BS + 1)
    worker = WorkerJournal(journal, LAYOUT, threads=2)
    worker.register(src)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})], saves=saves_for("e-r0", tokens, [1, 2, 3])))
    worker.close()
    state = kvj.replay(journal)
    flip_a_bit(os.path.join(journal, "segments"), state.requests["e-r0"].segments[1].key)

    dst = [torch.zeros_like(c) for c in src]
    again = WorkerJournal(journal, LAYOUT, threads=2)
    again.register(dst)
    chains = kvblock.chain_keys(SEED, tokens, BS)
    again.start_loads(StepPlan(loads=[Load("r1", [(4, chains[0]), (5, chains[1]), (6, chains[2])])]))
    loaded(again, "r1")
    assert again.load_errors() == {5, 6}  # the damaged block and the one after it: recomputed
    assert torch.equal(block_of(dst, 4), block_of(src, 1)) and not block_of(dst, 5).any()
    news = again.news()
    assert news.loaded == {"r1": {0: BS}} and news.lost == [chains[1]]
    again.close()


def test_no_room_for_the_gather_buffer_skips_the_steps_journaling_never_the_step(gpu, tmp_path, monkeypatch):
    """The device buffers are made once, outside vLLM's memory profile: when the device has no
    room for them, the step's blocks are not journaled (a warning) and the step goes on; the
    request's finish is still reported, so vLLM frees its blocks; once there is room (tried
    again after ROOM_RETRY seconds), the blocks of later steps are journaled, but never one
    after a request's skipped block: its journaled blocks stay a prefix."""
    sim = gpu
    monkeypatch.setattr(buffers, "ROOM_RETRY", 0.0)
    src = make_caches("NHD", dev="cuda:0")
    tokens, other = tokens_of(2 * BS + 1), tokens_of(BS + 1, base=300)
    worker = WorkerJournal(str(tmp_path / "j"), LAYOUT, threads=2)
    worker.register(src)
    sim.memory_limit[0] = sim.allocated[0] + 1024
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})], saves=saves_for("e-r0", tokens, [1])))
    assert worker.counters()["blocks_skipped"] == 1
    del sim.memory_limit[0]
    worker.step(StepPlan(starts=[Start("r1", "e-r1", other, {})],
                         saves=saves_for("e-r0", tokens, [1, 2])[1:] + saves_for("e-r1", other, [4]),
                         finishes=[Finish("r0", "e-r0", "ok", [])]))
    assert worker.poll()[0] == {"r0"}
    worker.close()
    assert worker.counters()["blocks_skipped"] == 2 and worker.counters()["blocks_saved"] == 1
    state = kvj.replay(str(tmp_path / "j"))
    assert state.requests["e-r0"].ended and state.requests["e-r0"].segments == {}
    assert sorted(state.requests["e-r1"].segments) == [0]


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
    loaded(again, "r1")
    assert torch.equal(block_of(dst, 2), block_of(src, 6))
    again.close()


EXIT = """
import sys, torch
from kvj.integrations.vllm.plan import Finish, Save, Start, StepPlan
from kvj.integrations.vllm.worker import WorkerJournal
from kvj.segments import kvblock
from kvj.segments.kvblock import LHNC, KVBlockLayout
from kvj.segments.store import SegmentStore
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


def test_a_steps_blocks_leave_the_device_in_one_copy_the_compute_stream_never_waits_for(gpu, tmp_path):
    """Not a copy per block per layer (defect 2): a step's blocks go through one gather and one
    device-to-host copy on kvj's side stream; the compute stream does not wait for it."""
    sim = gpu
    src = make_caches("NHD", dev="cuda:0")
    tokens = tokens_of(5 * BS + 1)
    worker = WorkerJournal(str(tmp_path / "j"), LAYOUT, threads=2)
    worker.register(src)
    sim.copies.clear()
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})], saves=saves_for("e-r0", tokens, [1, 2, 3, 4, 5])))
    d2h = [c for c in sim.copies if c.kind == "d2h"]
    assert len(d2h) == 1 and d2h[0].stream is not torch.cuda.current_stream()
    assert d2h[0].host.numel() * d2h[0].host.element_size() == 5 * LAYOUT.nbytes
    assert worker.counters()["rounds"] == 1
    worker.close()
    assert sorted(kvj.replay(str(tmp_path / "j")).requests["e-r0"].segments) == [0, 1, 2, 3, 4]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to bind to")
def test_kvj_threads_leave_the_cores_the_engines_compute_is_bound_to(tmp_path):
    """vLLM's CPU worker binds its compute threads to some cores and reserves the others for
    helpers such as a connector; kvj's threads, made by the bound thread, would share its core
    (decode measured 0.70x of no connector that way, 0.94x once they moved)."""
    import threading

    cpus = sorted(os.sched_getaffinity(0))
    seen: Dict[str, set] = {}

    def bound_worker() -> None:
        os.sched_setaffinity(0, {cpus[0]})  # this thread only, as vLLM binds its compute thread
        worker = WorkerJournal(str(tmp_path / "j"), LAYOUT, threads=2)
        worker.register(make_caches("HNC"))
        tokens = tokens_of(2 * BS + 1)
        worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})], saves=saves_for("e-r0", tokens, [1, 2])))
        worker.drain()
        worker.step(StepPlan())
        for t in threading.enumerate():
            if t.name.startswith("kvj-"):
                seen[t.name] = os.sched_getaffinity(t.native_id)
        worker.close()

    runner = threading.Thread(target=bound_worker)
    runner.start()
    runner.join()
    assert any(n.startswith("kvj-flush") for n in seen) and any(n.startswith("kvj-save") for n in seen)
    assert all(cpus[0] not in mask for mask in seen.values()), seen


def test_a_byte_budget_evicts_ended_requests_blocks_never_an_in_flight_ones(tmp_path):
    """``max_store_bytes`` (the connector's extra config): the worker compacts in the background
    and evicts what no in-flight request needs; the in-flight request's blocks still load."""
    journal = str(tmp_path / "j")
    src = make_caches("HNC")
    ended, live = tokens_of(2 * BS + 1, base=1), tokens_of(2 * BS + 1, base=500)
    worker = WorkerJournal(journal, LAYOUT, threads=2, max_store_bytes=0, budget_every=0.05)
    worker.register(src)
    worker.step(StepPlan(starts=[Start("a", "e-a", ended, {}), Start("b", "e-b", live, {})],
                         saves=saves_for("e-a", ended, [0, 1]) + saves_for("e-b", live, [2, 3])))
    worker.step(StepPlan(finishes=[Finish("a", "e-a", "length", [])]))
    worker.drain()  # every record durable
    for root, _dirs, files in os.walk(os.path.join(journal, "segments")):  # stored an hour ago: past any grace
        for f in files:
            os.utime(os.path.join(root, f), (os.path.getmtime(os.path.join(root, f)) - 3600,) * 2)
    wait_for(lambda: worker.stats["segments_collected"] >= 2, "the background compaction to remove request a's blocks")
    worker.close()
    state = kvj.replay(journal)
    with SegmentStore(os.path.join(journal, "segments")) as store:
        keys = set(store.keys())
    assert {s.key for s in state.requests["e-b"].segments.values()} <= keys  # in flight: kept
    assert not {s.key for s in state.requests["e-a"].segments.values()} & keys  # ended: gone

    dst = make_caches("HNC", seed=1)
    again = WorkerJournal(journal, LAYOUT, threads=2)
    again.register(dst)
    chains = kvblock.chain_keys(SEED, live, BS)
    again.start_loads(StepPlan(loads=[Load("b2", [(7, chains[0]), (8, chains[1])])]))
    loaded(again, "b2")
    assert again.load_errors() == set()
    assert torch.equal(block_of(dst, 7), block_of(src, 2)) and torch.equal(block_of(dst, 8), block_of(src, 3))
    again.close()
