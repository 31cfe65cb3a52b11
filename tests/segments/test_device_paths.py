"""The CUDA paths of flush, load and restore, run under the strict CUDA stand-in
(tests/support/fakecuda.py), where copies run late, poison sits in a download's destination
until the host waits, and a stream touching memory another wrote without a wait raises: nothing
returns while a copy from or into a buffer it hands back (or reuses) is in flight; the host
waits on events after its own copies, never on a whole stream; the caller's stream is ordered
after kvj's copies on the GPU; memory crossing streams is record_stream-ed; a bare "cuda" is
the caller's device; pinned staging is reused, not rebuilt.

Every test here takes only the ``gpu``, ``tmp_path`` and ``monkeypatch`` fixtures (and
parametrize): tests/segments/test_mutations.py runs them against kvj with a wait deleted."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from support.fakecuda import POISON, gpu  # noqa: F401

from kvj.segments import device
from kvj.segments.flusher import Flusher
from kvj.segments.kvblock import gather_block, paged_layout, restore_paged
from kvj.segments.load import load, load_many
from kvj.segments.staging import StagingPool
from kvj.segments.store import SegmentStore

L, NB, BS, H, D = 2, 8, 4, 2, 8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_get_onto_cuda_returns_only_once_the_copy_from_out_is_done(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        x = torch.randn(5000)
        key = store.put(x).key
        out = torch.empty(x.numel() * 4, dtype=torch.uint8, pin_memory=True)
        got = store.get(key, device="cuda:1", out=out)
        assert not gpu.in_flight(out)  # the caller may reuse out at once ...
        assert gpu.syncs == {"event": 1}  # ... the host waited on the copy's event, not a stream
        out.fill_(0)  # ... and does
        assert got.device == torch.device("cuda", 1) and torch.equal(got.cpu(), x)


def test_a_segment_loaded_onto_the_device_can_be_used_and_dropped_on_the_callers_stream(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        key = store.put(torch.arange(64.0)).key
        got = store.get(key, device="cuda:0")  # made on kvj's h2d stream
        total = (got * 2).sum()  # used on the caller's stream, which the host has not waited for
        del got  # freed while that use may still run: the allocator must know of it
        gc.collect()
        assert total.item() == 2 * sum(range(64))


def test_load_waits_on_its_copy_not_the_stream_and_reuses_one_pinned_pool(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        xs = [torch.randn(1000) + i for i in range(6)]
        keys = [store.put(x).key for x in xs]
        for x, key in zip(xs, keys):
            got = load(store, key, "cuda:0")
            assert got.device == torch.device("cuda", 0) and torch.equal(got.cpu(), x)
        assert gpu.pinned_allocs == 1  # no new pinned pool (or buffer) per segment
        assert gpu.syncs["event"] == len(keys) and gpu.syncs["stream"] == gpu.syncs["device"] == 0


def test_a_bare_cuda_is_the_callers_device_in_load_many_and_load_manifest(gpu, tmp_path):
    from kvj.ops import recover

    with SegmentStore(tmp_path / "s") as store:
        xs = [torch.randn(100) * i for i in range(4)]
        keys = [store.put(x).key for x in xs]
        torch.cuda.set_device(1)
        got = load_many(store, keys, "cuda")
        assert {t.device for t in got} == {torch.device("cuda", 1)}
        assert all(torch.equal(t.cpu(), x) for t, x in zip(got, xs))
    manifest = {"requests": [{"segments": [{"key": k} for k in keys]}], "training": {"checkpoint": None, "deltas": []}}
    result = recover.load_manifest(manifest, str(tmp_path / "s"), "cuda")
    assert result["device"] == "cuda:1" and result["segments"] == 4 and not result["failed"]


def test_load_many_threads_do_not_resolve_the_device_themselves(gpu, tmp_path, monkeypatch):
    with SegmentStore(tmp_path / "s") as store:
        keys = [store.put(torch.randn(10)).key for _ in range(3)]
        seen = []
        real = device.CUDA.resolve

        def resolve(d):
            seen.append((threading.current_thread() is threading.main_thread(), str(d)))
            return real(d)

        monkeypatch.setattr(device.CUDA, "resolve", resolve)
        torch.cuda.set_device(1)
        load_many(store, keys, "cuda")
    assert seen[0] == (True, "cuda")  # resolved once by the caller; workers get cuda:1
    assert all(d == "cuda:1" for main, d in seen if not main)


@pytest.mark.parametrize("fail", ["record", "synchronize"])
def test_an_error_after_the_copy_never_frees_a_buffer_still_in_flight(gpu, tmp_path, fail):
    with SegmentStore(tmp_path / "s") as store:
        x = torch.randn(4096)
        key = store.put(x).key
        pool = StagingPool(1 << 20, pinned=True)
        gpu.fail_next = fail
        with pytest.raises(RuntimeError, match="injected"):
            load(store, key, "cuda:0", staging=pool)
        assert pool.in_use == 0 and not gpu.pool_in_flight(pool)
        assert torch.equal(load(store, key, "cuda:0", staging=pool).cpu(), x)


def _blocks(gpu, n, dev="cuda:0"):
    src = [torch.randn(2, 16, 2, 8).to(torch.bfloat16) for _ in range(n)]
    return [gpu.fresh(s, dev) for s in src], src


@pytest.mark.parametrize("dev", ["cuda:0", "cuda:1"])
def test_flush_from_cuda_reads_the_staging_buffer_only_after_its_copy(gpu, tmp_path, dev):
    blocks, expected = _blocks(gpu, 6, dev)
    with SegmentStore(tmp_path / "s") as store:
        with Flusher(store, workers=2, staging_bytes=1 << 20) as fl:
            futures = [fl.submit(b, {"model": "m"}) for b in blocks]
            for b in blocks:
                b.fill_(float("nan"))  # the caller overwrites its blocks at once, no wait
            infos = [f.result(timeout=60) for f in futures]
        for info, want in zip(infos, expected):
            got = store.get(info.key)
            assert torch.equal(_bits(got), _bits(want))  # not poison, not NaN
            assert not (_bits(got) == POISON).all()
    side = device.CUDA.side_stream(torch.device(dev), "d2h")
    assert all(e.blocking for e in gpu.events) and gpu.syncs["stream"] == gpu.syncs["device"] == 0
    assert {c.stream for c in gpu.copies if c.kind == "d2h" and c.asynchronous} == {side}


def test_flushing_a_block_of_a_permuted_cache_view(gpu, tmp_path):
    src = torch.randn(NB, BS, H, D).to(torch.bfloat16)
    cache = gpu.fresh(src).permute(0, 2, 1, 3)  # FlashAttention's NHD layout: cache[b] is not contiguous
    assert not cache[3].is_contiguous()
    with SegmentStore(tmp_path / "s") as store:
        with Flusher(store, workers=1, staging_bytes=1 << 20) as fl:
            info = fl.submit(cache[3]).result(timeout=60)
        assert torch.equal(_bits(store.get(info.key)), _bits(src.permute(0, 2, 1, 3)[3]))


def test_a_tensor_made_on_another_stream_is_flushed_and_dropped_safely(gpu, tmp_path):
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        block = gpu.fresh(torch.arange(256.0))  # a model computing on its own stream
    torch.cuda.current_stream().wait_stream(producer)
    with SegmentStore(tmp_path / "s") as store:
        with Flusher(store, workers=1, staging_bytes=1 << 20) as fl:
            future = fl.submit(block)
            del block  # freed at once: its memory returns to the producer's stream
            gc.collect()
            info = future.result(timeout=60)
        assert torch.equal(store.get(info.key), torch.arange(256.0))


def test_a_failed_copy_event_in_the_flusher_frees_no_buffer_in_flight(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        fl = Flusher(store, workers=1, staging_bytes=1 << 20)
        gpu.fail_next = "record"
        with pytest.raises(RuntimeError, match="injected"):
            fl.submit(_blocks(gpu, 1)[0][0])
        assert fl.staging.in_use == 0 and not gpu.pool_in_flight(fl.staging)
        gpu.fail_next = "synchronize"
        with pytest.raises(RuntimeError, match="injected"):
            fl.submit(_blocks(gpu, 1)[0][0]).result(timeout=60)
        assert fl.staging.in_use == 0 and not gpu.pool_in_flight(fl.staging)
        fl.close()


def test_mixed_cpu_and_cuda_flushes_reuse_their_staging(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        with Flusher(store, workers=1, staging_bytes=1 << 20) as fl:
            for i in range(8):
                t = torch.randn(2, 16, 2, 8).to(torch.bfloat16)
                want = t.clone()
                info = fl.submit(gpu.fresh(t) if i % 2 else t).result(timeout=60)
                assert torch.equal(_bits(store.get(info.key)), _bits(want))
    assert gpu.pinned_allocs == 1


def test_staging_pool_keeps_pinned_and_pageable_buffers_apart(gpu):
    pool = StagingPool(1 << 20)
    pinned = pool.acquire(1000, pinned=True)
    assert pinned.is_pinned()
    pool.release(pinned)
    for _ in range(5):
        pageable = pool.acquire(1000)
        assert not pageable.is_pinned()
        pool.release(pageable)
        b = pool.acquire(1000, pinned=True)
        assert b.data_ptr() == pinned.data_ptr()
        pool.release(b)
    assert gpu.pinned_allocs == 1


def _paged(gpu, tmp_path, store, dst_dev):
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(NB, 2, BS, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    layout = paged_layout("m", src)
    keys = [store.put(gather_block(src, b), layout=layout).key for b in (1, 4, 6)]
    dst = [gpu.fresh(torch.zeros(NB, 2, BS, H, D, dtype=torch.bfloat16), dst_dev) for _ in range(L)]
    return src, keys, dst


def test_restore_paged_onto_cuda_scatters_and_waits_for_its_copy_only(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        src, keys, dst = _paged(gpu, tmp_path, store, "cuda:1")
        pool = StagingPool(1 << 20, pinned=True)
        syncs = dict(gpu.syncs)
        restore_paged(store, keys, dst, [7, 0, 3], model="m", staging=pool)
        assert not gpu.pool_in_flight(pool) and gpu.syncs["event"] == syncs.get("event", 0) + 1
        assert gpu.syncs["stream"] == gpu.syncs["device"] == 0
        side = device.CUDA.side_stream(torch.device("cuda", 1), "h2d")
        assert {c.stream for c in gpu.copies if c.asynchronous} == {side}
        for layer in range(L):  # the caller's stream reads the slots with no wait of its own
            got = dst[layer][[7, 0, 3]].cpu()
            assert torch.equal(_bits(got), _bits(src[layer][[1, 4, 6]]))
            assert not dst[layer][[1, 2, 4, 5, 6]].cpu().any()


def test_restore_paged_waits_for_what_the_callers_stream_still_does_with_the_old_slots(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        src, keys, dst = _paged(gpu, tmp_path, store, "cuda:0")
        old = [c.clone() for c in dst]  # queued work reading the slots restore overwrites
        restore_paged(store, keys, dst, [2, 5, 1], model="m")
        assert not old[0].cpu().any()
        assert torch.equal(_bits(dst[1][[2, 5, 1]].cpu()), _bits(src[1][[1, 4, 6]]))


def test_two_restores_in_a_row_through_one_staging_pool(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        src, keys, dst = _paged(gpu, tmp_path, store, "cuda:0")
        pool = StagingPool(1 << 20, pinned=True)
        restore_paged(store, keys[:2], dst, [0, 1], model="m", staging=pool)
        restore_paged(store, keys[2:] + keys[:1], dst, [2, 3], model="m", staging=pool)  # reuses the buffer
        assert gpu.pinned_allocs == 1
        for layer in range(L):
            want = src[layer][[1, 4, 6, 1]]
            assert torch.equal(_bits(dst[layer][[0, 1, 2, 3]].cpu()), _bits(want))


def test_a_restore_larger_than_the_staging_goes_in_chunks_through_it(gpu, tmp_path):
    """Pinned and device memory bounded by the staging pool, whatever the request's length: three
    blocks through a pool that holds one (one pinned buffer, device buffers for one block: the
    device has no room for more), each in its slot, bit for bit."""
    with SegmentStore(tmp_path / "s") as store:
        src, keys, dst = _paged(gpu, tmp_path, store, "cuda:0")
        block_bytes = src[0][0].numel() * 2 * L
        pool = StagingPool(block_bytes + 8, pinned=True)
        before = gpu.allocated[0]
        gpu.memory_limit[0] = before + block_bytes + 64  # room for one block's device buffers only
        restore_paged(store, keys, dst, [7, 0, 3], model="m", staging=pool)
        del gpu.memory_limit[0]
        assert gpu.pinned_allocs == 1
        for layer in range(L):
            assert torch.equal(_bits(dst[layer][[7, 0, 3]].cpu()), _bits(src[layer][[1, 4, 6]]))


def test_segments_loaded_by_worker_threads_are_fenced_for_the_callers_own_stream(gpu, tmp_path):
    with SegmentStore(tmp_path / "s") as store:
        keys = [store.put(torch.arange(64.0) + i).key for i in range(3)]
        mine = torch.cuda.Stream()
        mine.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(mine):  # the caller computes on its own stream
            got = load_many(store, keys, "cuda:0", workers=2)
            totals = [(t * 2).sum() for t in got]
            del got  # freed while that stream may still use them: the allocator must know of it
            gc.collect()
            assert [t.item() for t in totals] == [2 * sum(range(64)) + 128 * i for i in range(3)]
