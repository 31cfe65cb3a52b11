"""The bandwidth check, first after the environment (fast, and what a first run must tell): GB/s
device-to-host and host-to-device through kvj against plain and pinned copies, each result
checked; host time per saved block."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

from gpu import common
from gpu.common import Ctx, Parts, expect, gbps, journal_blocks, kv_caches, kv_layout, pinned, poll_until, same


def check_bandwidth(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    """GB/s through kvj against plain copies, each result checked; the connector's worker's load
    and flush; host time per saved block."""
    import torch

    from kvj.segments import device as kd
    from kvj.segments.flusher import Flusher
    from kvj.segments.load import load
    from kvj.segments.staging import StagingPool
    from kvj.segments.store import SegmentStore

    nbytes = ctx.sizes.transfer_mib << 20
    dt = ctx.dtype
    numel = nbytes // torch.empty((), dtype=dt).element_size()
    src = torch.empty(numel, dtype=dt, device=ctx.device).normal_()
    torch.cuda.synchronize(ctx.device)
    want = src.cpu()
    pin = pinned((numel,), dt)
    pageable = want.clone()
    rows: List[Dict[str, Any]] = []

    def measure(direction: str, how: str, fn: Callable[[], Any], expected: Any) -> None:
        with parts.part(f"{direction} {how}"):
            expect(same(fn(), expected), "the copy's result is wrong")
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize(ctx.device)
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            rows.append({"direction": direction, "how": how, "MiB": ctx.sizes.transfer_mib, "GB/s": gbps(nbytes, best)})

    def pinned_d2h() -> Any:
        pin.copy_(src, non_blocking=True)
        torch.cuda.synchronize(ctx.device)
        return pin

    def kvj_d2h() -> Any:
        kd.CUDA.wait(kd.CUDA.download(src, pin))
        return pin

    def pinned_h2d() -> Any:
        out = pin.cuda(non_blocking=True)
        torch.cuda.synchronize(ctx.device)
        return out

    def kvj_h2d() -> Any:
        out, event = kd.CUDA.upload(pin, ctx.device)
        kd.CUDA.finish(event, kd.CUDA.side_stream(ctx.device, "h2d"))
        return out

    def pageable_h2d() -> Any:
        out = pageable.cuda()
        torch.cuda.synchronize(ctx.device)
        return out

    measure("D2H", "tensor.cpu() (pageable)", lambda: src.cpu(), want)
    measure("D2H", "copy_ into pinned memory, non_blocking, then synchronize", pinned_d2h, want)
    measure("D2H", "kvj: CUDA.download into pinned memory, then its event", kvj_d2h, want)
    pin.copy_(want)
    measure("H2D", "tensor.cuda() (pageable)", pageable_h2d, want)
    measure("H2D", "pinned .cuda(non_blocking=True), then synchronize", pinned_h2d, want)
    measure("H2D", "kvj: CUDA.upload from pinned memory, then its event", kvj_h2d, want)
    with SegmentStore(os.path.join(ctx.tmp, "timing-store")) as store:
        key = store.put(want, codec="raw").key
        pool = StagingPool(2 * nbytes, pinned=True)
        measure("H2D", "kvj: segments.load.load of a stored segment (read, CRC-checked, copied)",
                lambda: load(store, key, ctx.device, staging=pool), want)
        block = torch.empty(ctx.sizes.flushed_block, dtype=dt, device=ctx.device).normal_()
        count = ctx.sizes.submits
        with parts.part("host time per Flusher.submit of a device block"), Flusher(store) as fl:
            for _ in range(2):  # the first round allocates the pinned staging; the second is timed
                t0 = time.perf_counter()
                futures = [fl.submit(block) for _ in range(count)]
                submit_s = time.perf_counter() - t0
                infos = [f.result() for f in futures]
            expect(all(same(store.get(i.key), block) for i in infos[:2]), "a submitted block was saved wrong")
            rows.append({"direction": "D2H", "how": f"kvj: Flusher.submit of a {tuple(block.shape)} block "
                         f"({block.numel() * block.element_size() >> 10} KiB), host time", "us/block":
                         round(submit_s / count * 1e6, 1)})
    worker_rows(ctx, parts, rows)
    width = max(len(r["how"]) for r in rows)
    note = "   (the CUDA stand-in: not a measurement)" if ctx.standin else ""
    print(f"  {'':3} {'how':{width}}  {'GB/s':>8}{note}")
    for r in rows:
        value = (f"{r['GB/s']:8.2f}" + (f"   ({r['vs']})" if "vs" in r else "") if "GB/s" in r
                 else f"{r['us/block']:8.1f} us per block")
        print(f"  {r['direction']:3} {r['how']:{width}}  {value}", flush=True)
    return {"rows": rows, "measured_on": "the CUDA stand-in (not a measurement)" if ctx.standin else "GPU"}


def worker_rows(ctx: Ctx, parts: Parts, rows: List[Dict[str, Any]]) -> None:
    """The vLLM connector's worker: ``load_blocks`` KV blocks (4 GiB on a GPU) journaled (codec
    raw: the pipeline, not a codec) paced by its backlog, then loaded by a restarted worker into
    the zeroed cache, chunk by chunk through its staging; against pinned ``copy_`` of as many bytes."""
    import torch

    from kvj.integrations.vllm.plan import Save, Start, StepPlan
    from kvj.integrations.vllm.worker import WorkerJournal

    n = ctx.sizes.load_blocks
    layout = kv_layout(ctx, "bandwidth")
    gather, staging = ctx.sizes.buffers
    caches = kv_caches(ctx, n)
    want = [c.clone() for c in caches]
    tokens, chains = journal_blocks(n, layout.block_size, layout.seed())
    nbytes, bs = n * layout.nbytes, layout.block_size
    journal = os.path.join(ctx.tmp, "bandwidth-journal")
    per_step = max(1, gather // layout.nbytes)  # as many blocks as the ring holds
    with parts.part(f"the connector's worker journals {nbytes / 2**30:.2f} GiB (codec raw), paced by its backlog"):
        worker = WorkerJournal(journal, layout, codec="raw", gather_bytes=gather, staging_bytes=staging)
        worker.register(caches)
        t0 = time.perf_counter()
        slots = -(-per_step // worker.buffers.per_round)  # staging slots a step's rounds take
        for at in range(0, n, per_step):
            while worker.buffers.saves.free < slots:  # the backlog: slots the flusher still holds
                if common.SIM is not None:
                    common.SIM.advance()
                time.sleep(0.0005)
            torch.cuda.synchronize(ctx.device)  # the ring's copies are done: a step per ring's worth
            worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})] if at == 0 else [],
                                 saves=[Save("e-r0", b, b, chains[b], tokens[b * bs:(b + 1) * bs + 1])
                                        for b in range(at, min(n, at + per_step))]))
        worker.drain()
        flush_s = time.perf_counter() - t0
        stats = worker.counters()
        worker.close()
        expect(stats["blocks_saved"] == n, f"{stats['blocks_skipped']} blocks were not journaled")
        rows.append({"direction": "D2H", "how": f"kvj: the connector's worker, {n} blocks gathered, written, fsynced",
                     "MiB": nbytes >> 20, "GB/s": gbps(nbytes, flush_s)})
    with parts.part(f"a restarted worker loads them ({nbytes / 2**30:.2f} GiB) in chunks: the same bits"):
        for c in caches:
            c.zero_()
        again = WorkerJournal(journal, layout, gather_bytes=gather, staging_bytes=staging)
        again.register(caches)
        torch.cuda.synchronize(ctx.device)
        load_s = poll_until_loaded(again, chains, n)
        expect(again.load_errors() == set(), f"{len(again.load_errors())} blocks failed to load")
        again.close()
        expect(all(torch.equal(c, w) for c, w in zip(caches, want)), "the loaded blocks differ from the saved ones")
        del want
        host = pinned((nbytes,), torch.uint8)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        best = float("inf")
        for _ in range(2):
            torch.cuda.synchronize(ctx.device)
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(ctx.device)
            best = min(best, time.perf_counter() - t0)
        rows.append({"direction": "H2D", "how": f"pinned copy_ of {nbytes >> 20} MiB, then synchronize",
                     "MiB": nbytes >> 20, "GB/s": gbps(nbytes, best)})
        rows.append({"direction": "H2D", "how": f"kvj: the connector's worker loads {n} blocks (read, checked, "
                     "copied in)", "MiB": nbytes >> 20, "GB/s": gbps(nbytes, load_s),
                     "vs": f"{best / load_s:.2f}x pinned copy_"})


def poll_until_loaded(worker: Any, chains: List[str], n: int) -> float:
    """Seconds for ``worker`` to load blocks 0..n-1 back into the same ids, polled."""
    from kvj.integrations.vllm.plan import Load, StepPlan

    t0 = time.perf_counter()
    worker.start_loads(StepPlan(loads=[Load("r1", [(b, chains[b]) for b in range(n)])]))
    poll_until(worker, "r1")
    return time.perf_counter() - t0
