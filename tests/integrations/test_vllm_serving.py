"""The vLLM connector's worker never makes the serving thread wait (issue 39 item 3), under the
strict CUDA stand-in, whose GPU runs only when the host waits or a test advances it (as a real
GPU runs meanwhile): a decode loop goes on while the disk holds the flusher back (blocks not
journaled, counted, every request still durable up to its last journaled block, which resume
loads bit for bit), with zero host waits on the serving thread (the stand-in counts every
synchronization, blocking copy, pinned allocation and lock wait, per thread); a prompt whose
KV exceeds the staging loads in chunks; kvj's streams are never the compute stream, even when
torch's stream pool hands that one out; caches in one allocation gather and scatter in one
indexed copy; an allocation failure costs journaling, never the worker.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
from typing import Dict, List, Tuple

import pytest
import torch
from support import fakecuda
from support.fakecuda import gpu  # noqa: F401 - the fixture
from support.wait import wait_for

import kvj
from kvj.fileio import CountedFS
from kvj.integrations.vllm.plan import Finish, Load, Save, Start, StepPlan
from kvj.integrations.vllm.worker import WorkerJournal
from kvj.ops.status import status
from kvj.segments import device, kvblock
from kvj.segments.kvblock import LHNC, KVBlockLayout

L, H, BS, D, NB = 2, 2, 4, 8, 40
LAYOUT = KVBlockLayout("test-model", "bfloat16", L, H, D, BS, LHNC)
SEED = LAYOUT.seed()
#: How long the slow disk holds an fsync at most: a test that fails midway opens it itself.
HOLD_S = 60.0


def nhd_caches(seed: int, dev: str = "cuda:0") -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per-layer caches as FlashAttention's NHD view on ``dev``, filled by a kernel the host has
    not waited for, and the CPU values they hold."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16) for _ in range(L)]
    caches = []
    for v in values:
        cache = torch.zeros(NB, BS, H, 2 * D, dtype=torch.bfloat16, device=dev).permute(0, 2, 1, 3)
        cache.copy_(fakecuda._ACTIVE.fresh(v, dev) if dev != "cpu" else v)
        caches.append(cache)
    return caches, values


def block_of(values: List[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([v[block_id] for v in values])


def readback(caches: List[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([c[block_id].cpu() for c in caches])


def slow_disk(monkeypatch: pytest.MonkeyPatch, journal: str) -> threading.Event:
    """The segment store's fsyncs wait until the returned gate opens: a disk far slower than the
    engine (the journal's own log is not held back)."""
    gate = threading.Event()
    segments = os.path.realpath(os.path.join(journal, "segments"))

    def held(path: str) -> None:
        if os.path.realpath(path).startswith(segments):
            gate.wait(HOLD_S)

    for name in ("fsync", "fdatasync"):
        def slow(fs: CountedFS, fd: int, _orig=getattr(CountedFS, name)) -> None:
            held(os.readlink(f"/proc/self/fd/{fd}"))
            _orig(fs, fd)
        monkeypatch.setattr(CountedFS, name, slow)

    def slow_dir(fs: CountedFS, path, _orig=CountedFS.fsync_dir) -> None:
        held(str(path))
        _orig(fs, path)
    monkeypatch.setattr(CountedFS, "fsync_dir", slow_dir)
    return gate


def loaded(worker: WorkerJournal, vllm_id: str) -> None:
    """Poll until ``vllm_id`` is loaded, the simulated GPU running between polls."""
    done: set = set()

    def poll() -> bool:
        fakecuda._ACTIVE.advance()
        done.update(worker.poll()[1])
        return vllm_id in done

    wait_for(poll, f"the load of {vllm_id}")


PROMPT, STEPS, REQUESTS = 2 * BS + 1, 16, 3


def decode(worker: WorkerJournal, caches: List[torch.Tensor], values: List[torch.Tensor],
           tokens: Dict[str, List[int]], ids: Dict[str, List[int]]) -> Dict[str, int]:
    """An engine's decode loop: each step's plan (its blocks computed by the end of the previous
    step), then its forward (writing the blocks it completes, on the compute stream), then the
    GPU runs while the host polls. Returns each request's blocks planned for saving."""
    dev_values = [fakecuda._ACTIVE.fresh(v) for v in values]  # the "model" writes these
    saved: Dict[str, int] = {r: 0 for r in tokens}
    written: Dict[str, int] = {r: 0 for r in tokens}  #: blocks whose KV a forward wrote
    for step in range(STEPS):
        known = PROMPT + step  # tokens of each request when this step starts (its forward runs them)
        plan = StepPlan()
        for r in tokens:
            jid = f"e-{r}"
            if step == 0:
                plan.starts.append(Start(r, jid, tokens[r][:PROMPT], {"prompt_len": PROMPT}))
            else:
                plan.tokens.append((jid, known - 1, tokens[r][known - 1:known]))
            chains = kvblock.chain_keys(SEED, tokens[r][:known], BS)  # of whole blocks with a next token
            while saved[r] < written[r] and (saved[r] + 1) * BS + 1 <= known:
                b = saved[r]
                plan.saves.append(Save(jid, b, ids[r][b], chains[b], tokens[r][b * BS:(b + 1) * BS + 1]))
                saved[r] += 1
        worker.step(plan)
        worker.start_loads(plan)
        for r in tokens:  # the forward: the blocks this step completes
            while (written[r] + 1) * BS <= known:
                bid = ids[r][written[r]]
                for layer, cache in enumerate(caches):
                    cache[bid].copy_(dev_values[layer][bid])
                written[r] += 1
        fakecuda._ACTIVE.advance()  # the GPU runs the step (and kvj's copies) meanwhile
        worker.poll()
        worker.load_errors()
        worker.news()
    return saved


def test_a_slow_disk_costs_journaled_blocks_never_a_wait_on_the_serving_thread(gpu, tmp_path, monkeypatch):
    """Serving goes on at the engine's speed while the disk holds every segment fsync: the steps'
    blocks that find no free ring slot or staging are not journaled (counted, in kvj status),
    nor any later block of their request; the serving thread records zero host waits (a wait on
    a ring slot, on staging or on kvj's thread, or a pinned allocation, reintroduced, fails
    this: tests/support/mutants.py). Afterwards each request is durable up to its last
    journaled block, and a restarted worker loads those bit for bit."""
    sim = gpu
    journal = str(tmp_path / "j")
    gate = slow_disk(monkeypatch, journal)
    tokens = {f"r{i}": [(100 * i + 7 * t) % 1000 for t in range(PROMPT + STEPS)] for i in range(REQUESTS)}
    ids = {f"r{i}": list(range(i * 8, i * 8 + 8)) for i in range(REQUESTS)}
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        caches, _ = nhd_caches(0)
        _, values = nhd_caches(1, "cpu")  # what the forward writes
        # one block a round, four ring slots, staging for six rounds
        worker = WorkerJournal(journal, LAYOUT, threads=2, gather_bytes=4 * LAYOUT.nbytes,
                               staging_bytes=6 * LAYOUT.nbytes)
        worker.register(caches)
        try:
            before = sim.host_waits()
            planned = decode(worker, caches, values, tokens, ids)
            waits = sim.host_waits() - before
            stats = worker.counters()
        finally:
            gate.set()
        assert waits == collections.Counter(), f"the serving thread waited: {dict(waits)}"
        assert all(c.stream is not compute for c in sim.copies if c.kind == "d2h")
        assert stats["blocks_skipped"] > 0 and stats["steps_skipping"] > 0
        worker.step(StepPlan(finishes=[Finish(r, f"e-{r}", "length", []) for r in tokens]))
        worker.close()
        stats = worker.counters()
        assert stats["blocks_saved"] + stats["blocks_skipped"] == sum(planned.values())

    state = kvj.replay(journal)
    journaled = {}
    for r in tokens:
        req = state.requests[f"e-{r}"]
        n = len(req.segments)
        assert sorted(req.segments) == list(range(n)), f"{r}: journaled blocks are not a prefix"
        assert req.resume_position == n * BS
        journaled[r] = n
    assert sum(journaled.values()) == stats["blocks_saved"] and max(journaled.values()) > 0
    shown = status(journal, os.path.join(journal, "segments"))["connector"]
    assert shown["blocks_skipped"] == stats["blocks_skipped"] and shown["steps"] == STEPS + 1
    text = subprocess.run([sys.executable, "-m", "kvj.cli.main", "status", "-j", journal], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert f"{stats['blocks_skipped']} not journaled in {stats['steps_skipping']} steps (kvj was behind" in text, text

    again = WorkerJournal(journal, LAYOUT, threads=2)
    dst, _ = nhd_caches(2)
    again.register(dst)
    new_ids = iter(range(NB - 1, -1, -1))
    for r, n in journaled.items():
        chains = kvblock.chain_keys(SEED, tokens[r], BS)[:n]
        where = [next(new_ids) for _ in range(n)]
        again.start_loads(StepPlan(loads=[Load(f"{r}'", list(zip(where, chains)))]))
        loaded(again, f"{r}'")
        for b, bid in enumerate(where):
            assert torch.equal(readback(dst, bid), block_of(values, ids[r][b])), f"{r} block {b}"
    assert again.load_errors() == set()
    again.close()


def test_a_prompt_larger_than_the_staging_loads_in_chunks_bit_for_bit(gpu, tmp_path):
    """A prompt whose KV is four times the load staging: loaded chunk by chunk through it (no
    allocation, no wait on the serving thread), bit for bit; the scatters run on kvj's stream,
    never the compute stream, though torch's pool (two streams here) hands that one out."""
    sim = gpu
    sim.stream_pool = 2
    journal = str(tmp_path / "j")
    tokens = [(7 * t) % 1000 for t in range(8 * BS + 1)]
    chains = kvblock.chain_keys(SEED, tokens, BS)
    src, values = nhd_caches(0)
    worker = WorkerJournal(journal, LAYOUT, threads=2)
    worker.register(src)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})],
                         saves=[Save("e-r0", b, 3 + b, chains[b], tokens[b * BS:(b + 1) * BS + 1]) for b in range(8)]))
    worker.close()

    compute = torch.cuda.Stream()
    torch.cuda.Stream()  # the pool's other stream: the next one handed out is the compute stream
    with torch.cuda.stream(compute):
        dst, _ = nhd_caches(1)
        again = WorkerJournal(journal, LAYOUT, threads=2, gather_bytes=4 * 2 * LAYOUT.nbytes,
                              staging_bytes=2 * LAYOUT.nbytes)  # one slot of two blocks
        again.register(dst)
        sim.copies.clear()
        before = sim.host_waits()
        where = [30, 2, 17, 5, 11, 39, 0, 22]
        again.start_loads(StepPlan(loads=[Load("r1", list(zip(where, chains)))]))
        done: set = set()
        polls = 0
        while "r1" not in done:
            sim.advance()
            done.update(again.poll()[1])
            polls += 1
        assert sim.host_waits() - before == collections.Counter()
        assert polls >= 4  # four chunks, one after the other through the one slot
        h2d = [c for c in sim.copies if c.kind == "h2d"]
        assert h2d and all(c.stream is not compute for c in h2d)
        assert device.CUDA.side_stream(torch.device("cuda:0"), "h2d") is not compute
        assert again.load_errors() == set()
        for b, bid in enumerate(where):
            assert torch.equal(readback(dst, bid), block_of(values, 3 + b)), f"block {b}"
        again.close()


def test_on_the_cpu_a_prompt_larger_than_the_staging_loads_in_chunks_bit_for_bit(tmp_path):
    """vLLM's CPU backend: the loader threads put each block in; still chunk by chunk through
    one staging slot of two blocks, bit for bit."""
    journal = str(tmp_path / "j")
    tokens = [(7 * t) % 1000 for t in range(8 * BS + 1)]
    chains = kvblock.chain_keys(SEED, tokens, BS)
    src, values = nhd_caches(0, "cpu")
    worker = WorkerJournal(journal, LAYOUT, threads=2)
    worker.register(src)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})],
                         saves=[Save("e-r0", b, 3 + b, chains[b], tokens[b * BS:(b + 1) * BS + 1]) for b in range(8)]))
    worker.close()
    dst, _ = nhd_caches(1, "cpu")
    again = WorkerJournal(journal, LAYOUT, threads=2, gather_bytes=2 * LAYOUT.nbytes, staging_bytes=2 * LAYOUT.nbytes)
    again.register(dst)
    where = [30, 2, 17, 5, 11, 39, 0, 22]
    again.start_loads(StepPlan(loads=[Load("r1", list(zip(where, chains)))]))
    wait_for(lambda: "r1" in again.poll()[1], "the load of r1")
    assert again.load_errors() == set() and again.counters()["blocks_loaded"] == 8
    for b, bid in enumerate(where):
        assert torch.equal(readback(dst, bid), block_of(values, 3 + b)), f"block {b}"
    again.close()


def test_no_pinned_memory_costs_journaling_never_the_worker(gpu, tmp_path):
    """The host cannot pin the staging at register: a warning; the steps' blocks are not
    journaled (counted), loads are load errors (vLLM recomputes them), the worker lives."""
    sim = gpu
    src, _ = nhd_caches(0)
    tokens = [(7 * t) % 1000 for t in range(2 * BS + 1)]
    chains = kvblock.chain_keys(SEED, tokens, BS)
    worker = WorkerJournal(str(tmp_path / "j"), LAYOUT, threads=2)
    sim.fail_next = "pin"
    worker.register(src)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})],
                         saves=[Save("e-r0", b, b, chains[b], tokens[b * BS:(b + 1) * BS + 1]) for b in range(2)]))
    assert worker.counters()["blocks_skipped"] == 2
    worker.start_loads(StepPlan(loads=[Load("r1", [(5, chains[0]), (6, chains[1])])]))
    assert worker.poll()[1] == {"r1"} and worker.load_errors() == {5, 6}
    worker.step(StepPlan(finishes=[Finish("r0", "e-r0", "ok", [])]))
    worker.close()
    req = kvj.replay(str(tmp_path / "j")).requests["e-r0"]
    assert req.ended and req.segments == {}


def one_allocation(dtype: torch.dtype, dev: str) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Caches as vLLM 0.33+ builds them: one int8 allocation, every layer a strided view of it
    ([blocks, layers, BS, H, 2D] in memory, each layer's logical view NHD-permuted)."""
    elem = torch.empty((), dtype=dtype).element_size()
    base = torch.zeros(NB * L * BS * H * 2 * D * elem, dtype=torch.int8, device=dev)
    whole = base.view(dtype).view(NB, L, BS, H, 2 * D)
    return base, [whole[:, layer].permute(0, 2, 1, 3) for layer in range(L)]


@pytest.mark.parametrize("dtype", ["bfloat16", "uint8"])
def test_caches_in_one_allocation_move_in_one_indexed_copy_a_round(gpu, tmp_path, monkeypatch, dtype):
    """One gather (index_select) per round and one scatter (index_copy_) per chunk, not one per
    layer; the bytes round-trip exactly (uint8: vLLM's fp8 cache)."""
    layout = KVBlockLayout("test-model", dtype, L, H, D, BS, LHNC,
                           **({"quant": "fp8_e4m3"} if dtype == "uint8" else {}))
    seed = layout.seed()
    tdtype = getattr(torch, dtype)
    base, caches = one_allocation(tdtype, "cuda:0")
    gen = torch.Generator().manual_seed(5)
    raw = torch.randint(-128, 128, tuple(base.shape), generator=gen, dtype=torch.int8)
    base.copy_(sim_fresh(raw))
    calls = collections.Counter()
    for name in ("index_select",):
        orig = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _o=orig, _n=name, **k: (calls.update([_n]), _o(*a, **k))[1])
    orig_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_",
                        lambda self, *a, **k: (calls.update(["index_copy_"]), orig_copy(self, *a, **k))[1])
    tokens = [(7 * t) % 1000 for t in range(3 * BS + 1)]
    chains = kvblock.chain_keys(seed, tokens, BS)
    journal = str(tmp_path / "j")
    worker = WorkerJournal(journal, layout, threads=2)
    worker.register(caches)
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})],
                         saves=[Save("e-r0", b, 4 + b, chains[b], tokens[b * BS:(b + 1) * BS + 1]) for b in range(3)]))
    assert calls == {"index_select": 1} and worker.counters()["rounds"] == 1
    worker.close()
    want = [torch.stack([c[4 + b].cpu() for c in caches]) for b in range(3)]

    _, dst = one_allocation(tdtype, "cuda:0")
    again = WorkerJournal(journal, layout, threads=2)
    again.register(dst)
    calls.clear()
    again.start_loads(StepPlan(loads=[Load("r1", [(9, chains[0]), (0, chains[1]), (7, chains[2])])]))
    loaded(again, "r1")
    assert calls["index_copy_"] == 1
    for b, bid in enumerate([9, 0, 7]):
        got = torch.stack([c[bid].cpu() for c in dst])
        assert torch.equal(got.view(torch.uint8), want[b].view(torch.uint8)), f"block {b}"
    again.close()


def sim_fresh(t: torch.Tensor) -> torch.Tensor:
    return fakecuda._ACTIVE.fresh(t)
