"""The vllm-blocks check: a step's KV blocks saved and loaded on caches shaped as vLLM allocates
them, and the connector's worker (kvj.integrations.vllm.worker, which needs no vLLM)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Sequence

from gpu import common
from gpu.common import (SEED, Ctx, Parts, expect, gbps, journal_blocks, kv_layout, model_id, nhd_layer, pinned,
                        poll_until, same)

def check_vllm_blocks(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    """A step's KV blocks saved and loaded on caches shaped as vLLM 0.32 allocates them."""
    import random

    import torch

    from kvj.segments.device import BlockRing, gather_blocks, scatter_blocks
    from kvj.segments.flusher import Flusher
    from kvj.segments.store import SegmentStore

    L, nb, N, H, C, step = ctx.sizes.vllm
    dt = ctx.dtype
    caches = [nhd_layer(ctx, nb, N, H, C) for _ in range(L)]
    torch.manual_seed(SEED)
    ctx.delay()
    for c in caches:
        c.normal_()  # the forward pass that wrote them, late
    pick = random.Random(SEED)
    ids = pick.sample(range(nb), step)
    new_ids = pick.sample([i for i in range(nb) if i not in set(ids)], step)
    block_bytes = L * H * N * C * torch.empty((), dtype=dt).element_size()
    ring = BlockRing(caches, max_blocks=step, slots=2)
    host = pinned((step, L, H, N, C), dt)
    details: Dict[str, Any] = {"caches": f"{L} x [{nb}, {H}, {N}, {C}] {ctx.sizes.dtype}, NHD-permuted",
                               "blocks_per_step": step, "block_bytes": block_bytes}

    def read(which: Sequence[int]) -> Any:
        index = torch.tensor(list(which), device=ctx.device)
        return torch.stack([c.index_select(0, index) for c in caches], dim=1)

    with parts.part("a step's blocks gathered to the host are the cache's, bit for bit"):
        t0 = time.perf_counter()
        moved = gather_blocks(caches, ids, host, ring.take())
        enqueued = time.perf_counter() - t0
        moved.wait()
        landed = time.perf_counter() - t0
        torch.cuda.synchronize(ctx.device)
        readback = read(ids).cpu()  # a synchronized readback
        expect(same(host, readback), "the gathered blocks differ from a synchronized readback of the cache")
        details.update(gather_host_us_per_block=round(enqueued / step * 1e6, 2), gather_gbps=gbps(step * block_bytes,
                                                                                                landed))

    saved = pinned((step, L, H, N, C), dt)
    with parts.part("saved through the flusher and read back from the store: the same bits"):
        with SegmentStore(os.path.join(ctx.tmp, "vllm-store")) as store, Flusher(store) as fl:
            t0 = time.perf_counter()
            futures = [fl.submit(host[i]) for i in range(step)]
            infos = [f.result() for f in futures]
            details["flush_s"] = round(time.perf_counter() - t0, 3)
            for i, info in enumerate(infos):
                saved[i].copy_(store.get(info.key))
        expect(same(saved, readback), "a block read back from the store differs from the cache's")

    with parts.part("loaded into other blocks: what was saved, and no other block touched"):
        before = [c.clone() for c in caches]
        t0 = time.perf_counter()
        moved = scatter_blocks(caches, new_ids, saved, ring.take())
        enqueued = time.perf_counter() - t0
        moved.fence()
        moved.wait()
        landed = time.perf_counter() - t0
        expect(same(read(new_ids), saved), "the loaded blocks differ from what was saved")
        keep = torch.tensor([i for i in range(nb) if i not in set(new_ids)], device=ctx.device)
        expect(all(torch.equal(c.index_select(0, keep), b.index_select(0, keep)) for c, b in zip(caches, before)),
               "a block the load was not given changed")
        details.update(scatter_host_us_per_block=round(enqueued / step * 1e6, 2),
                       scatter_gbps=gbps(step * block_bytes, landed))

    with parts.part("the connector's worker: a step journaled, a restarted worker loads it into other blocks"):
        details.update(worker_journal(ctx, caches, ids, new_ids, read))
    for dtype, quant in ((ctx.sizes.dtype, ""), ("uint8", "fp8_e4m3")):
        with parts.part(f"caches as vLLM 0.33+ builds them ({quant or dtype}): one int8 allocation of more than "
                        "2^31 elements, strided per-layer views; one indexed copy a round, the same bits"):
            details[f"one_allocation_{quant or dtype}"] = one_allocation(ctx, dtype, quant)
    return details


def one_allocation(ctx: Ctx, dtype: str, quant: str) -> Dict[str, Any]:
    """The worker saves blocks at both ends of one int8 allocation (byte offsets past 2^31) and a
    restarted one loads them into other blocks: one gather (``index_select``) per round, one
    scatter (``index_copy_``) per chunk, bit for bit. For fp8, the device layer also moves the
    same blocks viewed as ``float8_e4m3fn``."""
    import torch

    from kvj.integrations.vllm.plan import Load, Save, Start, StepPlan
    from kvj.integrations.vllm.worker import WorkerJournal
    from kvj.segments import device as kd

    layers, heads, dim, block = ctx.sizes.kv
    tdtype = getattr(torch, dtype)
    elem = torch.empty((), dtype=tdtype).element_size()
    nb = ctx.sizes.fused_blocks * (2 if elem == 1 else 1)
    per_layer = block * heads * 2 * dim  # elements of one layer's block
    base = torch.empty(nb * layers * per_layer * elem, dtype=torch.int8, device=ctx.device)
    whole = base.view(tdtype).view(nb, layers, block, heads, 2 * dim)
    caches = [whole[:, layer].permute(0, 2, 1, 3) for layer in range(layers)]
    torch.manual_seed(SEED)
    base.random_(-128, 128)
    torch.cuda.synchronize(ctx.device)
    expect(kd.fused_view(caches) is not None, "kvj does not see the layers as one allocation")
    layout = kv_layout(ctx, "one-allocation", dtype=dtype, quant=quant)
    n = 4
    ids, new_ids = [0, 1, nb - 2, nb - 1], [2, 3, nb - 4, nb - 3]
    tokens, chains = journal_blocks(n, block, layout.seed())
    want = [torch.stack([c[i] for c in caches]).cpu() for i in ids]
    counts = {"index_select": 0, "index_copy_": 0}
    select, copy_in = torch.index_select, torch.Tensor.index_copy_

    def counted_select(*a: Any, **k: Any) -> Any:
        counts["index_select"] += 1
        return select(*a, **k)

    def counted_copy(self: Any, *a: Any, **k: Any) -> Any:
        counts["index_copy_"] += 1
        return copy_in(self, *a, **k)

    journal = os.path.join(ctx.tmp, f"one-allocation-{dtype}")
    torch.index_select, torch.Tensor.index_copy_ = counted_select, counted_copy
    try:
        worker = WorkerJournal(journal, layout)
        worker.register(caches)
        worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})],
                             saves=[Save("e-r0", b, ids[b], chains[b], tokens[b * block:(b + 1) * block + 1])
                                    for b in range(n)]))
        worker.close()
        rounds, gathers = worker.counters()["rounds"], counts["index_select"]
        again = WorkerJournal(journal, layout)
        again.register(caches)
        again.start_loads(StepPlan(loads=[Load("r1", list(zip(new_ids, chains)))]))
        poll_until(again, "r1")
        again.close()
    finally:
        torch.index_select, torch.Tensor.index_copy_ = select, copy_in
    expect(gathers == rounds, f"{gathers} index_select for {rounds} gather rounds (one per layer?)")
    expect(counts["index_copy_"] == 1, f"{counts['index_copy_']} index_copy_ for one chunk")
    for b, i in enumerate(new_ids):
        expect(same(torch.stack([c[i] for c in caches]), want[b]), f"block {b} loaded at {i} differs")
    out = {"allocation_elements": base.numel(), "last_block_byte": (nb - 1) * layers * per_layer * elem,
           "gathers": gathers, "rounds": rounds}
    if elem == 1 and hasattr(torch, "float8_e4m3fn"):
        fp8 = [c.view(torch.float8_e4m3fn) for c in caches]
        host = pinned((2, layers, heads, block, 2 * dim), torch.float8_e4m3fn)
        kd.gather_blocks(fp8, [nb - 1, 0], host, kd.block_buffers(fp8, 2)).wait()
        moved = kd.scatter_blocks(fp8, [5, nb - 6], host, kd.block_buffers(fp8, 2))
        moved.fence()
        moved.wait()
        expect(same(torch.stack([c[5] for c in caches]), want[3]) and
               same(torch.stack([c[nb - 6] for c in caches]), want[0]), "fp8 blocks moved as float8_e4m3fn differ")
        out["float8_e4m3fn"] = True
    del base, whole, caches
    torch.cuda.empty_cache()
    return out


def worker_journal(ctx: Ctx, caches: List[Any], ids: List[int], new_ids: List[int],
                   read: Callable[[Sequence[int]], Any]) -> Dict[str, Any]:
    """The vLLM connector's worker side (``WorkerJournal``, vLLM not needed) on these caches: one
    step's saves with the blocks overwritten right after, a finish, then a restarted worker's
    asynchronous load polled to completion: the loaded blocks are what the cache held."""

    from kvj.integrations.vllm.plan import Finish, Load, Save, Start, StepPlan
    from kvj.integrations.vllm.worker import WorkerJournal
    from kvj.segments import kvblock

    L, _nb, N, H, C, step = ctx.sizes.vllm
    layout = kvblock.KVBlockLayout(model_id("vllm"), ctx.sizes.dtype, L, H, C // 2, N, kvblock.LHNC)
    tokens = [i % 1000 for i in range(step * N + 1)]
    chains = kvblock.chain_keys(layout.seed(), tokens, N)
    want = read(ids).cpu()
    journal = os.path.join(ctx.tmp, "vllm-journal")
    worker = WorkerJournal(journal, layout)
    worker.register(caches)
    saves = [Save("e-r0", b, ids[b], chains[b], tokens[b * N:(b + 1) * N + 1]) for b in range(step)]
    t0 = time.perf_counter()
    ctx.delay()
    for c in caches:
        c.mul_(1)  # the step's forward pass, still running when the connector saves
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {"prompt_len": len(tokens)})], saves=saves))
    enqueued = time.perf_counter() - t0
    for c in caches:
        c.zero_()  # vLLM reuses the blocks as soon as the step's save is enqueued
    worker.step(StepPlan(finishes=[Finish("r0", "e-r0", "length", [])]))
    worker.close()
    durable = time.perf_counter() - t0
    again = WorkerJournal(journal, layout)
    again.register(caches)
    again.step(StepPlan())
    t0 = time.perf_counter()
    ctx.delay(ctx.side("h2d"), long=True)  # kvj's copies run late: a load reported before they land is caught
    again.start_loads(StepPlan(loads=[Load("r1", list(zip(new_ids, chains[:step])))]))
    done: set = set()
    while "r1" not in done:
        expect(time.perf_counter() - t0 < 120, "the load was not reported done within 120 s")
        if common.SIM is not None:
            common.SIM.advance()  # the stand-in runs queued work only when asked; a GPU runs it meanwhile
        done.update(again.poll()[1])
        time.sleep(0.001)
    loaded = time.perf_counter() - t0
    expect(again.load_errors() == set(), f"blocks failed to load: {sorted(again.load_errors())}")
    # read on the compute stream, as the request's next forward pass would, with no host sync first
    expect(same(read(new_ids).cpu(), want), "the blocks the restarted worker loaded differ from the cache's")
    again.close()
    return {"worker_step_host_ms": round(enqueued * 1e3, 2), "worker_durable_s": round(durable, 3),
            "worker_load_s": round(loaded, 3)}
