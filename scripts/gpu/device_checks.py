"""The device check: kvj.segments.device's primitives and their callers, each with a race that a
missing wait loses (made deterministic with torch.cuda._sleep)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

from gpu.common import SEED, Ctx, Parts, expect, nhd_layer, on_device, pinned, rand, same

def check_device(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    """kvj's device primitives and their callers, each with a race that a missing wait loses."""
    import torch

    from kvj.segments import device as kd
    from kvj.segments.device import BlockRing, block_buffers, gather_blocks, scatter_blocks
    from kvj.segments.flusher import Flusher
    from kvj.segments.kvblock import paged_layout, restore_paged
    from kvj.segments.load import load, load_many
    from kvj.segments.staging import StagingPool
    from kvj.segments.store import SegmentStore

    L, nb, N, H, C = ctx.sizes.micro
    dt = ctx.dtype
    store = SegmentStore(os.path.join(ctx.tmp, "device-store"))
    seed = iter(range(SEED, SEED + 10_000))

    def layer_with(values: Any) -> Any:
        cache = nhd_layer(ctx, nb, N, H, C)
        cache.copy_(on_device(ctx, values))
        torch.cuda.synchronize(ctx.device)
        return cache

    with parts.part("download: kvj's copy waits for the block's producer"):
        cache = layer_with(torch.zeros(nb, H, N, C, dtype=dt))
        want = rand((H, N, C), next(seed), dt)
        src = on_device(ctx, want)
        ctx.delay()
        cache[1].copy_(src)  # the producer, late on the caller's stream
        dest = pinned((H, N, C), dt)
        kd.CUDA.wait(kd.CUDA.download(cache[1], dest))
        expect(same(dest, want), "the copy read the block before its producer wrote it: kvj's d2h stream did "
               "not wait for the caller's stream")

    with parts.part("download: the caller's overwrite waits for kvj's copy"):
        want = rand((nb, H, N, C), next(seed), dt)
        cache = layer_with(want)
        dest = pinned((H, N, C), dt)
        ctx.delay(ctx.side("d2h"))  # kvj's copy starts late ...
        event = kd.CUDA.download(cache[2], dest)
        cache.zero_()  # ... and the caller overwrites the block at once
        kd.CUDA.wait(event)
        expect(same(dest, want[2]), "the caller's stream overwrote the block before kvj's copy read it: it did "
               "not wait for the copy's event")
        expect(same(cache, torch.zeros(nb, H, N, C, dtype=dt)), "the caller's overwrite is lost")

    with parts.part("flusher: saves each block as it was at submit (late producer, overwritten and freed at once)"):
        k = min(nb, 4)
        wants = [rand((H, N, C), next(seed), dt) for _ in range(k)]
        srcs = [on_device(ctx, w) for w in wants]
        cache = layer_with(torch.zeros(nb, H, N, C, dtype=dt))
        with Flusher(store, workers=2, staging_bytes=4 * k * wants[0].numel() * 2 + (1 << 16)) as fl:
            ctx.delay()
            for b, s in enumerate(srcs):
                cache[b].copy_(s)  # producers, late
            ctx.delay(ctx.side("d2h"))
            futures = [fl.submit(cache[b]) for b in range(k)]
            cache.zero_()  # overwritten ...
            del cache  # ... and freed, its memory handed to the next allocation on this stream
            torch.empty(nb, N, H, C, dtype=dt, device=ctx.device).fill_(1.0)
            infos = [f.result() for f in futures]
            fl.drain()
        for b, (info, want) in enumerate(zip(infos, wants)):
            expect(same(store.get(info.key), want), f"block {b} was saved as something else than it held at submit")

    a, b = rand((L, H, N, C), next(seed), dt), rand((L, H, N, C), next(seed), dt)
    ka, kb = store.put(a).key, store.put(b).key
    one = StagingPool._size_class(a.numel() * a.element_size())  # room for one staging buffer: reused each load

    with parts.part("load / load_many: a tensor they return is read at once on the caller's stream"):
        pool = StagingPool(one, pinned=True)
        ctx.delay(ctx.side("h2d"))
        got = load(store, ka, ctx.device, staging=pool).clone()
        ctx.delay(ctx.side("h2d"))
        many = [t.clone() for t in load_many(store, [ka, kb], ctx.device)]
        expect(same(got, a), "the caller's stream read the loaded tensor before its copy landed")
        expect(same(many[0], a) and same(many[1], b), "load_many's tensors were read before their copies landed")

    with parts.part("load: its pinned staging buffer is reused only once its copy is done"):
        pool = StagingPool(one, pinned=True)
        ctx.delay(ctx.side("h2d"))
        first = load(store, ka, ctx.device, staging=pool)
        ctx.delay(ctx.side("h2d"))
        second = load(store, kb, ctx.device, staging=pool)
        expect(same(first, a), "the first load's copy read its staging buffer after the second load had reused it")
        expect(same(second, b), "the second load is wrong")

    with parts.part("load: memory the caller's stream still reads is not handed out again (record_stream)"):
        pool = StagingPool(one, pinned=True)
        first = load(store, ka, ctx.device, staging=pool)
        ctx.delay()  # the caller's stream is busy ...
        got = first.clone()  # ... so this read of the loaded tensor runs late
        del first  # the caller drops it: its memory must wait for that read
        second = load(store, kb, ctx.device, staging=pool)  # the next allocation on kvj's h2d stream
        expect(same(got, a), "the caller's late read saw the next load's bytes: the loaded tensor's memory was "
               "reused while the caller's stream still read it")
        expect(same(second, b), "the second load is wrong")

    ids = [nb - 1, 0, min(3, nb - 2)]
    n = len(ids)
    values = [rand((nb, H, N, C), next(seed), dt) for _ in range(L)]
    expected = torch.stack([v[ids] for v in values], dim=1)

    def caches_with(vals: Sequence[Any]) -> List[Any]:
        return [layer_with(v) for v in vals]

    with parts.part("gather_blocks: kvj's copy waits for the blocks' producer"):
        caches = caches_with([torch.zeros(nb, H, N, C, dtype=dt)] * L)
        srcs = [on_device(ctx, v) for v in values]
        host = pinned((n, L, H, N, C), dt)
        ctx.delay()
        for c, s in zip(caches, srcs):
            c.copy_(s)  # producers, late
        gather_blocks(caches, ids, host, block_buffers(caches, n)).wait()
        expect(same(host, expected), "the blocks were copied to the host before their producer wrote them")

    with parts.part("gather_blocks: the caller may overwrite the blocks as soon as it returns"):
        caches = caches_with(values)
        host = pinned((n, L, H, N, C), dt)
        ctx.delay(ctx.side("d2h"))
        moved = gather_blocks(caches, ids, host, block_buffers(caches, n))
        for c in caches:
            c.zero_()  # the engine reuses the blocks at once
        moved.wait()
        expect(same(host, expected), "blocks overwritten right after gather_blocks returned were saved overwritten")

    with parts.part("gather_blocks: the caller's stream never waits for the copy to the host"):
        caches = caches_with(values)
        host = pinned((n, L, H, N, C), dt)
        ctx.delay(ctx.side("d2h"), long=True)
        moved = gather_blocks(caches, ids, host, block_buffers(caches, n))
        after = torch.cuda.Event()
        after.record(ctx.stream)
        after.synchronize()
        expect(not moved.done(), "the caller's stream waited for kvj's copy to the host")
        moved.wait()
        expect(same(host, expected), "the gathered blocks are wrong")

    with parts.part("BlockRing: a slot whose copy is in flight is never handed out, nor waited for"):
        caches = caches_with(values)
        ring = BlockRing(caches, max_blocks=n, slots=2)
        hosts = [pinned((n, L, H, N, C), dt) for _ in range(3)]
        ctx.delay(ctx.side("d2h"), long=True)
        moves = [gather_blocks(caches, ids, hosts[i], ring.take()) for i in range(2)]
        expect(ring.busy == 0, "the ring said busy with a free slot")
        expect(ring.take() is None and ring.busy == 1 and not moves[0].done(),
               "the ring handed out a slot whose copy was still in flight (or waited for it)")
        moves[0].wait()
        third = ring.take()
        expect(third is not None and third.transfer is not None and third.transfer.done(),
               "the ring did not hand out the slot whose copy is done")
        moves.append(gather_blocks(caches, ids, hosts[2], third))
        for m in moves:
            m.wait()
        expect(all(same(h, expected) for h in hosts), "a gather through the ring saved wrong blocks")

    news = rand((n, L, H, N, C), next(seed), dt)

    def read_blocks(caches: Sequence[Any], which: Sequence[int]) -> Any:
        index = torch.tensor(list(which), device=ctx.device)
        return torch.stack([c.index_select(0, index) for c in caches], dim=1)

    with parts.part("scatter_blocks: waits for the caller's earlier reads of the old blocks"):
        caches = caches_with(values)
        host = pinned((n, L, H, N, C), dt)
        host.copy_(news)
        index = on_device(ctx, torch.tensor(ids))
        ctx.delay()
        old = torch.stack([c.index_select(0, index) for c in caches], dim=1)  # the caller's read, late
        moved = scatter_blocks(caches, ids, host, block_buffers(caches, n))
        moved.fence()
        moved.wait()
        now = read_blocks(caches, ids)
        expect(same(old, expected), "the scatter overwrote the blocks before the caller's earlier read of them: "
               "kvj's h2d stream did not wait for the caller's stream")
        expect(same(now, news), "the scattered blocks are wrong")

    with parts.part("scatter_blocks: fence() orders the caller's reads after the scatter"):
        caches = caches_with(values)
        host = pinned((n, L, H, N, C), dt)
        host.copy_(news)
        ctx.delay(ctx.side("h2d"), long=True)
        moved = scatter_blocks(caches, ids, host, block_buffers(caches, n))
        moved.fence()
        got = read_blocks(caches, ids)  # ordered after the scatter by the fence alone
        moved.wait()
        expect(same(got, news), "the caller's stream read the blocks before the scatter landed: fence() did not "
               "order it")

    with parts.part("restore_paged: two restores through one staging buffer, each block in its slot"):
        pc = [torch.empty(nb, N, 2, H, C, dtype=dt, device=ctx.device).permute(0, 2, 1, 3, 4) for _ in range(L)]
        for c in pc:
            c.zero_()
        torch.cuda.synchronize(ctx.device)
        layout = paged_layout("gpu-check", pc)
        blocks = [rand((L, 2, N, H, C), next(seed), dt) for _ in range(4)]
        keys = [store.put(blk, layout=layout).key for blk in blocks]
        slots = [nb - 1, 1, 0, nb - 2]
        need = -(-2 * blocks[0].numel() * 2 // 8) * 8 + 16
        pool = StagingPool(StagingPool._size_class(need), pinned=True)
        ctx.delay(ctx.side("h2d"))
        restore_paged(store, keys[:2], pc, slots[:2], model="gpu-check", staging=pool)
        ctx.delay(ctx.side("h2d"))
        restore_paged(store, keys[2:], pc, slots[2:], model="gpu-check", staging=pool)
        got = read_blocks(pc, slots)  # at once, on the caller's stream
        expect(same(got, torch.stack(blocks)), "a restored block is not the stored one (staging reused before "
               "its copy, or read before the scatter landed)")
        rest = [i for i in range(nb) if i not in slots]
        expect(same(read_blocks(pc, rest), torch.zeros(len(rest), L, 2, N, H, C, dtype=dt)),
               "restore_paged wrote into slots it was not given")
    store.close()
    return {"sizes": {"layers": L, "blocks": nb, "block": N, "heads": H, "width": C}}
