"""The serving check: what vLLM's serving thread pays for kvj. kvj's side streams are never the
compute stream (even when torch's stream pool hands that one out again); a decode loop with
fixed GPU work per step and a prefill burst, with and without kvj's saves: step time p50/p99,
time in kvj's hooks, GPU idle between steps, blocks not journaled (under the stand-in, also
the serving thread's host waits inside kvj's hooks, which must be none); warm gather and
scatter timings per block."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Dict, Iterator, List, Optional

from gpu import common
from gpu.common import DELAY_MS, Ctx, Parts, expect, journal_blocks, kv_caches, kv_layout, median, pinned

#: The longest time kvj's hooks may take in one step on a GPU before the check calls it a wait.
HOOK_LIMIT_MS = 50.0


def check_serving(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    details: Dict[str, Any] = {}
    with parts.part("kvj's side streams are never the compute stream, though torch's pool hands it out again"):
        details["streams"] = streams(ctx)
    requests, steps, burst, cache_blocks = ctx.sizes.decode
    caches = kv_caches(ctx, cache_blocks)
    loops: Dict[str, Dict[str, Any]] = {}
    for with_kvj in (False, True):
        name = "with kvj" if with_kvj else "without kvj"
        with parts.part(f"a decode loop of {steps} steps ({requests} requests, a {burst}-block prefill), {name}"):
            loops[name] = decode_loop(ctx, caches, with_kvj)
    details["decode"] = loops
    if "with kvj" in loops:
        kvj_loop = loops["with kvj"]
        with parts.part("the serving thread never waits on kvj (its hooks' time; the stand-in counts waits)"):
            waits = kvj_loop.get("host_waits_in_hooks")
            expect(not waits, f"the serving thread waited in kvj's hooks: {waits}")
            expect(ctx.standin or kvj_loop["hook_ms_max"] < HOOK_LIMIT_MS,
                   f"kvj's hooks took {kvj_loop['hook_ms_max']:.1f} ms in one step (limit {HOOK_LIMIT_MS} ms)")
    with parts.part("warm gather and scatter timings per block"):
        details["per_block"] = per_block(ctx, caches)
    report(ctx, details)
    return details


def streams(ctx: Ctx) -> Dict[str, Any]:
    """The compute stream is a pooled one; the pool is turned until its next stream is that one
    again; kvj's streams are made then (a fresh ``kvj.segments.device.CUDA``), by a gather and a
    scatter on the compute stream: neither may be it."""
    import torch

    from kvj.segments import device as kd

    compute = torch.cuda.Stream(ctx.device)
    for turned in range(1, 130):  # torch's pool: 32 streams a priority, handed out round-robin
        if torch.cuda.Stream(ctx.device) == compute:
            break
    expect(turned < 129, "torch.cuda.Stream() never handed out the compute stream again")
    for _ in range(turned - 1):
        torch.cuda.Stream(ctx.device)  # the pool's next stream is the compute stream now
    before, kd.CUDA = kd.CUDA, kd.Cuda()
    try:
        with torch.cuda.stream(compute):
            layers, heads, dim, block = ctx.sizes.kv
            caches = kv_caches(ctx, 4)
            host = pinned((2, layers, heads, block, 2 * dim), caches[0].dtype)
            kd.gather_blocks(caches, [0, 1], host, kd.block_buffers(caches, 2)).wait()
            moved = kd.scatter_blocks(caches, [2, 3], host, kd.block_buffers(caches, 2))
            moved.fence()
            moved.wait()
        sides = dict(kd.CUDA._streams)
    finally:
        kd.CUDA = before
    expect(len(sides) == 2 and all(s != compute for s in sides.values()),
           "kvj's side stream is the compute stream: its copies would run in line with the forward pass")
    return {"pool_turned": turned, "side_streams": [str(s) for s in sides.values()], "compute": str(compute)}


def decode_loop(ctx: Ctx, caches: List[Any], with_kvj: bool) -> Dict[str, Any]:
    """Steps of fixed GPU work (``step_ms`` of torch.cuda._sleep and the blocks it completes
    written), a host sync per step (the sampled tokens), kvj's hooks between steps as vLLM calls
    them; halfway, a prefill of ``burst`` blocks. Per step: wall time, time in kvj's hooks, and
    (on a GPU) the GPU's idle time between the end of one step's work and the start of the next."""
    import torch

    from kvj.integrations.vllm.plan import Finish, Save, Start, StepPlan
    from kvj.integrations.vllm.worker import WorkerJournal

    requests, steps, burst, cache_blocks = ctx.sizes.decode
    layout = kv_layout(ctx, "serving")
    bs = layout.block_size
    per_req = max(2, steps // bs + 2)
    expect(requests * per_req + burst <= cache_blocks, "the decode loop's blocks do not fit the cache")
    prompts = {f"r{r}": journal_blocks(per_req, bs, layout.seed(), first=100 * r) for r in range(requests)}
    burst_tokens, burst_chains = journal_blocks(burst, bs, layout.seed(), first=99_999)
    worker: Optional[WorkerJournal] = None
    if with_kvj:
        buffers = ctx.sizes.serving_buffers
        worker = WorkerJournal(os.path.join(ctx.tmp, "serving-journal"), layout,
                               **({"gather_bytes": buffers[0], "staging_bytes": buffers[1]} if buffers else {}))
        worker.register(caches)
    cycles = int(ctx.cycles * ctx.sizes.step_ms / DELAY_MS)
    token = torch.zeros(1, device=ctx.device)
    timing = not ctx.standin
    walls: List[float] = []
    hooks: List[float] = []
    idles: List[float] = []
    waits: Dict[str, int] = {}
    saved = {r: 0 for r in prompts}
    last_end: Any = None
    for step in range(steps):
        plan = StepPlan()
        known = 1 * bs + 1 + step  # each request: its first block prefilled, then a token a step
        for r, (tokens, chains) in prompts.items():
            if step == 0:
                plan.starts.append(Start(r, f"e-{r}", tokens[:known], {}))
            else:
                plan.tokens.append((f"e-{r}", known - 1, tokens[known - 1:known]))
            while (saved[r] + 1) * bs + 1 <= known and saved[r] + 1 < per_req:
                b = saved[r]
                plan.saves.append(Save(f"e-{r}", b, int(r[1:]) * per_req + b, chains[b],
                                       tokens[b * bs:(b + 1) * bs + 1]))
                saved[r] += 1
        if step == steps // 2 + 1:  # the prefill's blocks, computed by the step before
            first = requests * per_req
            plan.starts.append(Start("burst", "e-burst", burst_tokens, {}))
            plan.saves += [Save("e-burst", b, first + b, burst_chains[b], burst_tokens[b * bs:(b + 1) * bs + 1])
                           for b in range(burst)]
        t0 = time.perf_counter()
        if worker is not None:
            with counted(waits):
                worker.step(plan)
                worker.start_loads(plan)
        t1 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=timing)
        start.record()
        torch.cuda._sleep(cycles)  # the forward pass
        for layer in caches:
            layer[step % cache_blocks].mul_(1)  # the KV it writes
        end = torch.cuda.Event(enable_timing=timing)
        end.record()
        sampled = float(token.sum().item())  # vLLM's host sync for the sampled tokens
        t2 = time.perf_counter()
        if worker is not None:
            with counted(waits):
                worker.poll()
                worker.load_errors()
                worker.news()
        t3 = time.perf_counter()
        walls.append(t3 - t0)
        hooks.append((t1 - t0) + (t3 - t2))
        if timing and last_end is not None:
            idles.append(last_end.elapsed_time(start) / 1e3)
        last_end = end
        del sampled
    out: Dict[str, Any] = {"step_ms_p50": ms(median(walls)), "step_ms_p99": ms(quantile(walls, 0.99)),
                           "hook_ms_p50": ms(median(hooks)), "hook_ms_p99": ms(quantile(hooks, 0.99)),
                           "hook_ms_max": ms(max(hooks)), "gpu_idle_ms_p50": ms(median(idles)) if idles else None,
                           "gpu_idle_ms_p99": ms(quantile(idles, 0.99)) if idles else None}
    if worker is not None:
        worker.step(StepPlan(finishes=[Finish(r, f"e-{r}", "length", []) for r in prompts]
                             + [Finish("burst", "e-burst", "length", [])]))
        worker.close()
        stats = worker.counters()
        out.update(blocks_saved=stats["blocks_saved"], blocks_skipped=stats["blocks_skipped"],
                   steps_skipping=stats["steps_skipping"], rounds=stats["rounds"])
        if common.SIM is not None:
            out["host_waits_in_hooks"] = waits
    return out


@contextlib.contextmanager
def counted(waits: Dict[str, int]) -> Iterator[None]:
    """Add the calling thread's host waits in the block, by kind, to ``waits`` (under the stand-in,
    which counts them; on a GPU nothing is counted)."""
    before = common.SIM.host_waits() if common.SIM is not None else None
    yield
    if before is not None:
        for kind, count in (common.SIM.host_waits() - before).items():
            waits[kind] = waits.get(kind, 0) + count


def per_block(ctx: Ctx, caches: List[Any]) -> Dict[str, Any]:
    """gather_blocks and scatter_blocks of a ring slot's worth of blocks, warm (the best of
    five): host time to enqueue, and time until the copy is done, per block."""
    import torch

    from kvj.segments import device as kd

    layers, heads, dim, block = ctx.sizes.kv
    n = min(32, caches[0].shape[0] // 2)
    host = pinned((n, layers, heads, block, 2 * dim), caches[0].dtype)
    bufs = kd.block_buffers(caches, n)
    out: Dict[str, Any] = {"blocks": n}
    for name, move in (("gather", kd.gather_blocks), ("scatter", kd.scatter_blocks)):
        enqueue, total = [], []
        for _ in range(5):
            torch.cuda.synchronize(ctx.device)
            t0 = time.perf_counter()
            moved = move(caches, list(range(n, 2 * n)) if name == "scatter" else list(range(n)), host, bufs)
            t1 = time.perf_counter()
            moved.wait()
            enqueue.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        out[f"{name}_host_us_per_block"] = round(min(enqueue) / n * 1e6, 2)
        out[f"{name}_us_per_block"] = round(min(total) / n * 1e6, 2)
    return out


def report(ctx: Ctx, details: Dict[str, Any]) -> None:
    note = " (the CUDA stand-in: not a measurement)" if ctx.standin else ""
    for name, loop in details.get("decode", {}).items():
        line = (f"  decode {name:12}: step p50 {loop['step_ms_p50']} ms, p99 {loop['step_ms_p99']} ms; kvj's hooks "
                f"p50 {loop['hook_ms_p50']} ms, p99 {loop['hook_ms_p99']} ms; GPU idle p50 {loop['gpu_idle_ms_p50']} "
                f"ms, p99 {loop['gpu_idle_ms_p99']} ms")
        if "blocks_saved" in loop:
            line += f"; blocks journaled {loop['blocks_saved']}, not journaled {loop['blocks_skipped']}"
        print(line + note, flush=True)
    if "per_block" in details:
        print(f"  per block{note}: {details['per_block']}", flush=True)


def ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1e3, 3)


def quantile(values: List[float], q: float) -> Optional[float]:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else None
