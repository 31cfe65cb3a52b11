"""The CUDA stand-in itself (tests/support/fakecuda.py): each rule it enforces fires where CUDA
would fail, and stays quiet where CUDA is fine, so a device-path test that passes under it
means the code waits where it must."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from support.fakecuda import POISON, FakeCuda, FakeCudaTensor, Hazard, StandInError, gpu  # noqa: F401

from kvj.segments import device


def _poisoned(t: torch.Tensor) -> bool:
    return bool((t.contiguous().view(torch.uint8) == POISON).all())


# -- devices --------------------------------------------------------------------------------


def test_device_tensors_look_like_cuda_and_kvj_runs_its_real_cuda_class(gpu):
    x = torch.zeros(3, device="cuda")
    assert isinstance(x, FakeCudaTensor) and x.is_cuda and x.device == torch.device("cuda", 0)
    assert type(device.CUDA) is device.Cuda  # kvj's own logic, not a replacement
    assert torch.cuda.is_available() and torch.cuda.device_count() == 2


def test_an_op_mixing_a_cuda_and_a_cpu_tensor_raises_as_on_cuda(gpu):
    cache = torch.zeros(4, 3, device="cuda:0")
    with pytest.raises(RuntimeError, match="same device.*cuda:0 and cpu"):
        cache.index_copy_(0, torch.tensor([1]), torch.ones(1, 3))  # the vLLM connector's old defect
    with pytest.raises(RuntimeError, match="same device"):
        cache.index_copy_(0, torch.tensor([1], device="cuda:0"), torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="same device"):
        cache + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.index_select(cache, 0, torch.tensor([0]))


def test_what_cuda_accepts_from_the_cpu_works(gpu):
    cache = torch.zeros(4, 3, device="cuda:0")
    cache.add_(torch.tensor(2.0))  # a 0-dim CPU scalar
    picked = cache[torch.tensor([0, 2])]  # CPU indices of advanced indexing
    cache[torch.tensor([1])] = torch.ones(1, 3, device="cuda:0")
    assert picked.cpu().tolist() == [[2.0] * 3] * 2
    assert cache.cpu()[1].tolist() == [1.0] * 3


def test_two_devices_do_not_mix_and_each_thread_starts_on_device_0(gpu):
    a, b = torch.ones(2, device="cuda:0"), torch.ones(2, device="cuda:1")
    with pytest.raises(RuntimeError, match="cuda:0 and cuda:1"):
        a + b
    assert (a + b.to("cuda:0")).cpu().tolist() == [2.0, 2.0]
    torch.cuda.set_device(1)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(torch.zeros(1, device="cuda").device))
    worker.start()
    worker.join()
    assert torch.zeros(1, device="cuda").device == torch.device("cuda", 1)
    assert seen == [torch.device("cuda", 0)]
    assert torch.cuda.current_stream(0) is not torch.cuda.current_stream(1)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.zeros(1, device="cuda:2")


def test_numpy_raises_and_host_reads_synchronize(gpu):
    x = torch.arange(4.0, device="cuda")
    with pytest.raises(TypeError, match="can't convert cuda:0"):
        x.numpy()
    before = sum(gpu.syncs.values())
    assert x[1].item() == 1.0 and x.tolist() == [0.0, 1.0, 2.0, 3.0] and bool(x[3] > 2)
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0] and torch.equal(x, x)
    assert sum(gpu.syncs.values()) - before == 5


def test_pinned_memory_is_known_and_views_of_it_are_pinned(gpu):
    buf = torch.empty(64, dtype=torch.uint8, pin_memory=True)
    assert buf.is_pinned() and buf[8:16].is_pinned() and not torch.empty(4).is_pinned()
    assert torch.ones(4).pin_memory().is_pinned() and gpu.pinned_allocs == 2
    assert not torch.zeros(1, device="cuda").is_pinned()


# -- copies run late ---------------------------------------------------------------------


def test_a_download_into_pinned_memory_holds_poison_until_the_host_waits_on_its_event(gpu):
    x = torch.arange(16.0, device="cuda")
    host = torch.empty(16, pin_memory=True)
    host.copy_(x, non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record()
    assert _poisoned(host) and gpu.in_flight(host) and not event.query()
    torch.cuda.Event().synchronize()  # an unrecorded event: no wait at all
    assert _poisoned(host)
    event.synchronize()
    assert host.tolist() == list(range(16)) and not gpu.in_flight(host) and event.query()


@pytest.mark.parametrize("sync", ["event", "stream", "device"])
def test_each_host_synchronization_completes_the_copies_before_it(gpu, sync):
    x = torch.full((8,), 7.0, device="cuda")
    host = torch.empty(8, pin_memory=True)
    host.copy_(x, non_blocking=True)
    if sync == "event":
        torch.cuda.current_stream().record_event().synchronize()
    elif sync == "stream":
        torch.cuda.current_stream().synchronize()
    else:
        torch.cuda.synchronize()
    assert host.tolist() == [7.0] * 8 and gpu.syncs[sync] == 1


def test_an_upload_from_pinned_memory_reads_its_source_when_it_runs(gpu):
    host = torch.full((8,), 1.0, pin_memory=True)
    dev = torch.empty(8, device="cuda")
    dev.copy_(host, non_blocking=True)
    host.fill_(2.0)  # reused before the copy ran: the new bytes arrive
    assert dev.cpu().tolist() == [2.0] * 8


def test_copies_from_or_into_pageable_memory_are_synchronous(gpu):
    host = torch.full((8,), 1.0)
    dev = torch.empty(8, device="cuda")
    dev.copy_(host, non_blocking=True)
    host.fill_(2.0)  # staged when copy_ returned: the old bytes arrive
    assert dev.cpu().tolist() == [1.0] * 8
    out = torch.empty(8)
    out.copy_(dev, non_blocking=True)
    assert out.tolist() == [1.0] * 8  # filled before copy_ returned, no wait needed
    late = dev.to("cpu", non_blocking=True)  # torch pins a non-blocking download's result
    assert late.is_pinned() and _poisoned(late)


def test_ops_on_one_stream_see_each_others_results_in_order(gpu):
    host = torch.arange(6.0, pin_memory=True)
    dev = torch.empty(6, device="cuda")
    dev.copy_(host, non_blocking=True)
    doubled = dev * 2
    out = torch.empty(6, pin_memory=True)
    out.copy_(doubled, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


# -- hazards between streams ---------------------------------------------------------------


def test_a_side_stream_reading_what_the_compute_stream_wrote_must_wait_for_it(gpu):
    x = torch.randn(8, device="cuda")
    host = torch.empty(8, pin_memory=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with pytest.raises(Hazard, match="no wait between them"):
            host.copy_(x, non_blocking=True)
    gpu.violations.clear()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        side.record_event().synchronize()
    assert torch.equal(host, x.cpu())


def test_overwriting_what_a_side_stream_still_reads_needs_a_wait_on_its_event(gpu):
    x = torch.full((8,), 1.0, device="cuda")
    host = torch.empty(8, pin_memory=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        done = side.record_event()
    with pytest.raises(Hazard, match="writes .* reads"):
        x.fill_(2.0)  # the compute stream's next step, racing the copy
    gpu.violations.clear()
    torch.cuda.current_stream().wait_event(done)
    x.fill_(3.0)
    done.synchronize()
    assert host.tolist() == [1.0] * 8  # the copy ran before the overwrite


def test_a_host_wait_in_one_thread_orders_nothing_for_another(gpu):
    x = torch.full((4,), 1.0, device="cuda")
    host = torch.empty(4, pin_memory=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        done = side.record_event()
    waiter = threading.Thread(target=done.synchronize)
    waiter.start()
    waiter.join()
    with pytest.raises(Hazard):
        x.fill_(2.0)  # this thread never waited
    gpu.violations.clear()
    done.synchronize()
    x.fill_(2.0)


def test_a_hazard_also_fails_the_test_at_its_end_if_code_swallowed_it(monkeypatch):
    sim = FakeCuda(2).install(monkeypatch)
    x = torch.ones(2, device="cuda")
    side = torch.cuda.Stream()
    try:
        with torch.cuda.stream(side):
            x.mul_(2)
    except Hazard:
        pass
    with pytest.raises(StandInError, match="no wait between them"):
        sim.check()


# -- the caching allocator -----------------------------------------------------------------


def _use_on_side(gpu, record: bool, wait: bool):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        scratch = torch.ones(16, device="cuda")  # allocated on the side stream
    torch.cuda.current_stream().wait_stream(side)
    (scratch * 2).sum()  # used on the compute stream
    if record:
        scratch.record_stream(torch.cuda.current_stream())
    if wait:
        torch.cuda.current_stream().synchronize()
    del scratch
    gc.collect()


def test_memory_used_on_another_stream_and_freed_without_record_stream_is_reported(monkeypatch):
    sim = FakeCuda(2).install(monkeypatch)
    _use_on_side(sim, record=False, wait=False)
    with pytest.raises(StandInError, match="freed without record_stream"):
        sim.check()


@pytest.mark.parametrize("record, wait", [(True, False), (False, True)])
def test_record_stream_or_a_host_wait_before_the_free_is_enough(gpu, record, wait):
    _use_on_side(gpu, record, wait)
    gpu.check()


# -- failures ------------------------------------------------------------------------------


def test_device_memory_runs_out_where_told_and_failures_can_be_injected(gpu):
    gpu.memory_limit[0] = 1024
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(2048, dtype=torch.uint8, device="cuda:0")
    torch.empty(2048, dtype=torch.uint8, device="cuda:1")  # another device's memory
    gpu.fail_next = "record"
    with pytest.raises(RuntimeError, match="injected"):
        torch.cuda.Event().record()
    torch.cuda.Event().record()  # once


def test_a_thread_learns_what_another_waited_for_through_a_future_it_completed(gpu):
    from concurrent.futures import ThreadPoolExecutor

    x = torch.full((4,), 1.0, device="cuda")
    host = torch.empty(4, pin_memory=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        done = side.record_event()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(done.synchronize).result()  # the worker waited, then handed the result over
    x.fill_(2.0)  # ordered after the copy for this thread now
    assert host.tolist() == [1.0] * 4


def test_an_op_with_a_data_dependent_shape_waits_for_its_inputs(gpu):
    x = gpu.fresh(torch.tensor([0.0, 3.0, 0.0, 5.0]))
    syncs = sum(gpu.syncs.values())
    assert x.nonzero().cpu().flatten().tolist() == [1, 3]
    assert sum(gpu.syncs.values()) > syncs


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_resizing_a_device_tensor_in_place_is_refused_loudly(gpu):
    out = torch.empty(2, device="cuda")
    with pytest.raises(StandInError, match="resizes a device tensor"):
        torch.index_select(torch.ones(4, device="cuda"), 0, torch.tensor([0, 1, 2], device="cuda"), out=out)
