"""The CUDA branches of flush and restore, run on CPU through a stand-in that models
asynchronous copies (tests/support/fakecuda.py): nothing returns while a copy from or into
a buffer it hands back (or reuses) is in flight; the host waits on events after its own
copies, never on a whole stream; a bare "cuda" is the caller's device; pinned staging is
reused, not rebuilt."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from support.fakecuda_legacy import POISON, FakeCuda, any_in_flight

from kvj.segments import device
from kvj.segments.flusher import Flusher
from kvj.segments.restore import gather_block, load, load_many, paged_layout, restore_paged
from kvj.segments.staging import StagingPool
from kvj.segments.store import SegmentStore

L, NB, BS, H, D = 2, 8, 4, 2, 8


@pytest.fixture
def fake(monkeypatch):
    f = FakeCuda(devices=2)
    monkeypatch.setattr(device, "CUDA", f)
    return f


@pytest.fixture
def store(tmp_path):
    with SegmentStore(tmp_path / "s") as s:
        yield s


def test_get_onto_cuda_returns_only_once_the_copy_from_out_is_done(fake, store):
    x = torch.randn(5000)
    key = store.put(x).key
    out = fake.pinned(x.numel() * 4)
    got = store.get(key, device="cuda:1", out=out)
    assert not fake.in_flight(out)  # the caller may reuse out at once ...
    out.fill_(0)  # ... and does
    fake.finish_all()
    assert fake.violations == []
    assert fake.device_of(got) == torch.device("cuda", 1) and torch.equal(got, x)
    assert fake.stream_waits == 0 and fake.event_waits == 1


def test_load_waits_on_its_copy_not_the_stream_and_reuses_one_pinned_pool(fake, store):
    xs = [torch.randn(1000) + i for i in range(6)]
    keys = [store.put(x).key for x in xs]
    for x, key in zip(xs, keys):
        got = load(store, key, "cuda:0")
        assert torch.equal(got, x) and fake.device_of(got) == torch.device("cuda", 0)
    assert fake.pinned_allocs == 1  # no new pinned pool (or buffer) per segment
    assert fake.stream_waits == 0 and fake.event_waits == len(keys)
    assert fake.violations == []


def test_a_bare_cuda_is_the_callers_device_in_load_many_and_load_manifest(fake, store, monkeypatch):
    from kvj.ops import recover

    keys = [store.put(torch.randn(100) * i).key for i in range(4)]
    fake.set_device(1)
    got = load_many(store, keys, "cuda")
    assert {fake.device_of(t) for t in got} == {torch.device("cuda", 1)}
    monkeypatch.setattr(recover, "check_device", torch.device)  # it would allocate on the device
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    manifest = {"requests": [{"segments": [{"key": k} for k in keys]}],
                "training": {"checkpoint": None, "deltas": []}}
    result = recover.load_manifest(manifest, store, "cuda")
    assert result["device"] == "cuda:1" and result["segments"] == 4 and not result["failed"]


@pytest.mark.parametrize("fail", ["record", "wait"])
def test_an_error_after_the_copy_never_frees_a_buffer_still_in_flight(fake, store, fail):
    key = store.put(torch.randn(4096)).key
    pool = StagingPool(1 << 20, pinned=True)
    fake.fail_next = fail
    with pytest.raises(RuntimeError, match="injected"):
        load(store, key, "cuda:0", staging=pool)
    assert pool.in_use == 0 and not any_in_flight(fake, pool)
    assert torch.equal(load(store, key, "cuda:0", staging=pool), store.get(key))


def _device_blocks(fake, n, index=0):
    return [fake.adopt(torch.randn(2, 16, 2, 8).to(torch.bfloat16), index) for _ in range(n)]


def test_flush_from_cuda_reads_the_staging_buffer_only_after_its_copy(fake, store):
    blocks = _device_blocks(fake, 6)
    expected = [b.clone() for b in blocks]
    with Flusher(store, workers=2, staging_bytes=1 << 20) as fl:
        futures = [fl.submit(b, {"model": "m"}) for b in blocks]
        for b in blocks:
            b.fill_(float("nan"))  # the caller overwrites its blocks at once
        infos = [f.result(timeout=60) for f in futures]
    for info, want in zip(infos, expected):
        got = store.get(info.key)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # not poison, not NaN
        assert not (got.view(torch.uint8) == POISON).all()
    assert all(e.blocking for e in fake.events) and fake.stream_waits == 0
    assert {op.stream.name for op in fake.copies} == {"d2h"}


def test_a_failed_copy_event_in_the_flusher_frees_no_buffer_in_flight(fake, store):
    fl = Flusher(store, workers=1, staging_bytes=1 << 20)
    fake.fail_next = "record"
    with pytest.raises(RuntimeError, match="injected"):
        fl.submit(_device_blocks(fake, 1)[0])
    assert fl.staging.in_use == 0 and not any_in_flight(fake, fl.staging)
    fake.fail_next = "wait"
    with pytest.raises(RuntimeError, match="injected"):
        fl.submit(_device_blocks(fake, 1)[0]).result(timeout=60)
    assert fl.staging.in_use == 0 and not any_in_flight(fake, fl.staging)
    fl.close()


def test_mixed_cpu_and_cuda_flushes_reuse_their_staging(fake, store):
    with Flusher(store, workers=1, staging_bytes=1 << 20) as fl:
        for i in range(8):
            t = torch.randn(2, 16, 2, 8).to(torch.bfloat16)
            if i % 2:
                fake.adopt(t)
            fl.submit(t).result(timeout=60)
    assert fake.pinned_allocs == 1


def test_staging_pool_keeps_pinned_and_pageable_buffers_apart(fake):
    pool = StagingPool(1 << 20)
    pinned = pool.acquire(1000, pinned=True)
    pool.release(pinned)
    for _ in range(5):
        pool.release(pool.acquire(1000))
        b = pool.acquire(1000, pinned=True)
        assert b.data_ptr() == pinned.data_ptr()
        pool.release(b)
    assert fake.pinned_allocs == 1


def test_restore_paged_onto_cuda_scatters_and_waits_for_its_copy_only(fake, store):
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(NB, 2, BS, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    layout = paged_layout("m", src)
    keys = [store.put(gather_block(src, b), layout=layout).key for b in (1, 4, 6)]
    dst = [fake.adopt(torch.zeros(NB, 2, BS, H, D, dtype=torch.bfloat16), 1) for _ in range(L)]
    pool = StagingPool(1 << 20, pinned=True)
    restore_paged(store, keys, dst, [7, 0, 3], model="m", staging=pool)
    assert not any_in_flight(fake, pool) and fake.stream_waits == 0 and fake.event_waits == 1
    for layer in range(L):
        for old, new in zip((1, 4, 6), (7, 0, 3)):
            assert torch.equal(dst[layer][new], src[layer][old])
    assert fake.violations == [] and {op.stream.name for op in fake.copies} == {"h2d"}


def test_the_real_primitives_use_blocking_events_and_wait_on_them(monkeypatch):
    made = []

    class Event:
        def __init__(self, **kwargs):
            self.kwargs, self.recorded, self.synced = kwargs, None, False
            made.append(self)

        def record(self, stream):
            self.recorded = stream

        def synchronize(self):
            self.synced = True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    cuda = device.Cuda()
    stream = types.SimpleNamespace(synchronize=lambda: pytest.fail("waited on a whole stream"))
    event = cuda.record(stream)
    cuda.wait(event)
    assert made == [event] and event.kwargs == {"blocking": True}
    assert event.recorded is stream and event.synced


def test_load_many_threads_do_not_resolve_the_device_themselves(fake, store):
    keys = [store.put(torch.randn(10)).key for _ in range(3)]
    seen = []
    real = fake.resolve

    def resolve(d):
        seen.append((threading.current_thread() is threading.main_thread(), str(d)))
        return real(d)

    fake.resolve = resolve
    fake.set_device(1)
    load_many(store, keys, "cuda")
    assert seen[0] == (True, "cuda")  # resolved once by the caller; workers get cuda:1
    assert all(d == "cuda:1" for main, d in seen if not main)
