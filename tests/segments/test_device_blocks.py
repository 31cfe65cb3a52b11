"""Paged KV blocks between per-layer caches and pinned host memory (kvj.segments.device
gather_blocks / scatter_blocks), the vLLM connector's device work, under the strict CUDA
stand-in and on the CPU, with vLLM's two cache layouts: the CPU backend's contiguous
[num_blocks, H, N, C] and FlashAttention's NHD view, a permutation where cache[b] is not
contiguous."""

from __future__ import annotations

import pytest
import torch
from support.fakecuda import Hazard, gpu  # noqa: F401

from kvj.errors import DeviceOutOfMemory, InvalidArgument
from kvj.segments import device
from kvj.segments.device import BlockRing, block_buffers, blocks_shape, gather_blocks, scatter_blocks

L, NB, H, N, C = 3, 10, 2, 4, 8
LAYOUTS = ["contiguous", "nhd"]


def _caches(layout: str, dev: str, seed: int):
    """Per-layer caches and the CPU values they hold (written by a pending kernel on ``dev``)."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(NB, H, N, C, generator=g).to(torch.bfloat16) for _ in range(L)]
    caches = []
    for v in values:
        if layout == "nhd":
            c = torch.zeros(NB, N, H, C, dtype=torch.bfloat16, device=dev).permute(0, 2, 1, 3)
            assert not c[0].is_contiguous()
        else:
            c = torch.zeros(NB, H, N, C, dtype=torch.bfloat16, device=dev)
        c.copy_(v.to(dev))  # a device-side copy: a kernel the host has not waited for
        caches.append(c)
    return caches, values


def _host(n: int, pinned: bool = True) -> torch.Tensor:
    return torch.empty((n, L, H, N, C), dtype=torch.bfloat16, pin_memory=pinned)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_saves_the_blocks_bit_for_bit_as_a_synchronized_readback(gpu, layout):
    caches, _ = _caches(layout, "cuda:0", 1)
    ring = BlockRing(caches, max_blocks=4)
    host, ids = _host(4), [7, 0, 3]
    moved = gather_blocks(caches, ids, host, ring.take())
    assert not moved.done()  # the host never waited ...
    assert not gpu.waited(torch.cuda.current_stream(), moved.event)  # ... nor did the compute stream
    moved.wait()
    torch.cuda.synchronize()
    readback = torch.stack([c.cpu()[ids] for c in caches], dim=1)
    assert torch.equal(_bits(host[:3]), _bits(readback))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_compute_stream_may_reuse_the_blocks_as_soon_as_the_gather_is_enqueued(gpu, layout):
    caches, values = _caches(layout, "cuda:0", 2)
    host, ids = _host(2), [9, 4]
    moved = gather_blocks(caches, ids, host, block_buffers(caches, 2))
    for c in caches:
        c.fill_(float("nan"))  # the next step overwrites the freed blocks, no wait
    moved.wait()
    assert torch.equal(_bits(host), _bits(torch.stack([v[ids] for v in values], dim=1)))


def test_the_ring_hands_out_buffers_whose_copy_is_done_and_never_waits(gpu):
    """All slots busy: ``take`` says so (None) at once; the host never waits for a copy."""
    caches, values = _caches("nhd", "cuda:0", 3)
    ring = BlockRing(caches, max_blocks=2, slots=2)
    hosts = [_host(2) for _ in range(3)]
    syncs = sum(gpu.syncs.values())
    first = gather_blocks(caches, [1, 2], hosts[0], ring.take())
    second = gather_blocks(caches, [3, 4], hosts[1], ring.take())
    assert sum(gpu.syncs.values()) == syncs and ring.slots[0] is not ring.slots[1]
    with pytest.raises(InvalidArgument, match="still in use"):
        gather_blocks(caches, [5], hosts[2], ring.slots[0])
    assert ring.take() is None and ring.busy == 1  # both busy: no wait, no slot
    assert sum(gpu.syncs.values()) == syncs and not first.done()
    gpu.advance()  # the GPU catches up: polling finds the buffers free again
    third = gather_blocks(caches, [5, 6], hosts[2], ring.take())
    assert ring.busy == 1
    for moved, host, ids in ((first, hosts[0], [1, 2]), (second, hosts[1], [3, 4]), (third, hosts[2], [5, 6])):
        moved.wait()
        assert torch.equal(_bits(host), _bits(torch.stack([v[ids] for v in values], dim=1)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_loads_what_gather_saved_into_other_blocks(gpu, layout):
    src, values = _caches(layout, "cuda:0", 4)
    saved = _host(3)
    gather_blocks(src, [2, 5, 8], saved, block_buffers(src, 3)).wait()
    dst = [(torch.zeros(NB, N, H, C, dtype=torch.bfloat16, device="cuda:0").permute(0, 2, 1, 3) if layout == "nhd"
            else torch.zeros(NB, H, N, C, dtype=torch.bfloat16, device="cuda:0")) for _ in range(L)]
    loaded = scatter_blocks(dst, [0, 9, 4], saved, block_buffers(dst, 3))
    assert not loaded.done() and not gpu.waited(torch.cuda.current_stream(), loaded.event)
    loaded.fence()  # the compute stream waits on the GPU, the host goes on
    assert not loaded.done()
    for layer in range(L):
        got = dst[layer].cpu()
        assert torch.equal(_bits(got[[0, 9, 4]]), _bits(values[layer][[2, 5, 8]]))
        assert not got[[1, 2, 3, 5, 6, 7, 8]].any()


def test_reading_scattered_blocks_needs_the_fence_or_a_completed_poll(gpu):
    saved = _host(1)
    saved.fill_(1.0)
    dst, _ = _caches("nhd", "cuda:0", 5)
    loaded = scatter_blocks(dst, [3], saved, block_buffers(dst, 1))
    with pytest.raises(Hazard):
        dst[0].sum()  # the compute stream reads the block while the load may still run
    gpu.violations.clear()
    while not loaded.done():  # a load across steps: poll, and the GPU gets on meanwhile
        gpu.advance()
    assert bool((dst[0][3] == 1.0).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_the_cpu_the_same_functions_move_the_blocks_at_once(layout):
    src, values = _caches(layout, "cpu", 6)
    saved = _host(2, pinned=False)
    assert gather_blocks(src, [6, 1], saved, block_buffers(src, 2)).done()
    assert torch.equal(_bits(saved), _bits(torch.stack([v[[6, 1]] for v in values], dim=1)))
    dst, _ = _caches(layout, "cpu", 7)
    scatter_blocks(dst, [0, 8], saved, block_buffers(dst, 2))
    for layer in range(L):
        assert torch.equal(_bits(dst[layer][[0, 8]]), _bits(values[layer][[6, 1]]))


def test_blocks_on_the_second_device_move_on_its_streams(gpu):
    caches, values = _caches("nhd", "cuda:1", 8)
    host = _host(1)
    moved = gather_blocks(caches, [2], host, block_buffers(caches, 1))
    assert moved.stream.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
    moved.wait()
    assert torch.equal(_bits(host[0]), _bits(torch.stack([v[2] for v in values])))


def test_a_failed_device_allocation_is_reported_and_keeps_nothing(gpu):
    caches, _ = _caches("contiguous", "cuda:0", 9)
    before = torch.cuda.memory_allocated(0)
    gpu.memory_limit[0] = before + 1024
    with pytest.raises(DeviceOutOfMemory, match="no room on cuda:0"):
        block_buffers(caches, 64)
    assert torch.cuda.memory_allocated(0) == before
    gpu.fail_next = "pin"
    with pytest.raises(DeviceOutOfMemory, match="pinned host memory"):
        block_buffers(caches, 1)


def test_bad_arguments_are_refused_before_anything_moves(gpu):
    caches, _ = _caches("contiguous", "cuda:0", 10)
    bufs = block_buffers(caches, 2)
    with pytest.raises(InvalidArgument, match="do not fit"):
        gather_blocks(caches, [0, 1, 2], _host(3), bufs)
    with pytest.raises(InvalidArgument, match="must lie in"):
        gather_blocks(caches, [NB], _host(1), bufs)
    with pytest.raises(InvalidArgument, match="pinned"):
        gather_blocks(caches, [0], _host(1, pinned=False), bufs)
    with pytest.raises(InvalidArgument, match="host blocks must be"):
        gather_blocks(caches, [0], torch.empty((1, L, H, N, C + 1), dtype=torch.bfloat16, pin_memory=True), bufs)
    with pytest.raises(InvalidArgument, match="distinct"):
        scatter_blocks(caches, [1, 1], _host(2), bufs)
    assert blocks_shape(caches, 5) == (5, L, H, N, C) and device.CUDA.is_pinned(_host(1))
