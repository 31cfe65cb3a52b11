#!/usr/bin/env python3
"""GPU self-check for kvj's flush and restore paths.

Exercises, on a real CUDA device: pinned staging buffers and side-stream copies in the
Flusher (device tensors snapshotted while the caller goes on overwriting them), restore of a
request's blocks into a paged KV cache on the GPU at new block ids, a large single-segment
load onto the device, and the throughput of each. Exits 0 with a message when no CUDA device
is available (the CPU tests run the same code with the CUDA branches off).

    python scripts/gpu_selfcheck.py [--device N] [--layers 28] [--blocks 256] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvj.segments.device import CUDA  # noqa: E402
from kvj.segments.flusher import Flusher  # noqa: E402
from kvj.segments.restore import gather_block, load, paged_layout, restore_paged  # noqa: E402
from kvj.segments.staging import StagingPool
from kvj.segments.store import SegmentStore  # noqa: E402


def _check(cond: bool, what: str) -> None:
    print(f"  [{'ok' if cond else 'FAIL'}] {what}")
    if not cond:
        raise SystemExit(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--blocks", type=int, default=256, help="blocks flushed and restored")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--root", default=None, help="store directory (default: a temp dir)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_selfcheck: no CUDA device available; nothing to check "
              "(the CPU test suite exercises the same code paths)")
        return 0
    dev = torch.device("cuda", args.device)
    print(f"gpu_selfcheck on {torch.cuda.get_device_name(dev)} (torch {torch.__version__})")
    shape = (args.blocks * 2, 2, args.block_size, args.heads, args.head_dim)
    g = torch.Generator(device=dev).manual_seed(0)
    src = [torch.randn(shape, device=dev, generator=g).to(torch.bfloat16) for _ in range(args.layers)]
    layout = paged_layout("selfcheck-model", src)
    old_ids = list(range(0, 2 * args.blocks, 2))
    block_bytes = src[0][0].numel() * 2 * args.layers
    total = block_bytes * args.blocks
    with tempfile.TemporaryDirectory() as tmp, SegmentStore(args.root or tmp) as store:
        # 1. flush from the GPU through pinned staging on a side stream
        fl = Flusher(store, workers=2, staging_bytes=64 << 20)
        t0 = time.perf_counter()
        futures = []
        expected = {}
        for b in old_ids:
            block = gather_block(src, b)
            expected[b] = block.cpu()
            futures.append(fl.submit(block, layout))
            block.fill_(float("nan"))  # caller overwrites at once; the snapshot must not see it
        submit_s = time.perf_counter() - t0
        infos = [f.result() for f in futures]
        fl.drain()
        flush_s = time.perf_counter() - t0
        _check(fl.staging.peak_in_use <= fl.staging.capacity, "staging stayed within its bound")
        probe = fl.staging.acquire(block_bytes, pinned=True)
        _check(probe.is_pinned(), "staging buffers are pinned")
        fl.staging.release(probe)
        _check([k for k in CUDA._streams if k[1] == "d2h"] == [(dev, "d2h")], "copies ran on one side stream")
        ok = all(torch.equal(store.get(i.key), expected[b]) for i, b in zip(infos, old_ids))
        _check(ok, "flushed blocks equal the GPU data at submit time (later overwrite not seen)")
        fl.close()
        print(f"  flush: {args.blocks} blocks, {total / 1e6:.1f} MB, submit {submit_s * 1e3:.1f} ms, "
              f"durable {flush_s * 1e3:.1f} ms ({total / flush_s / 1e9:.2f} GB/s)")

        # 2. restore into a fresh paged cache at new block ids (reusable pinned staging)
        staging = StagingPool(2 * max(total, 64 << 20) + (64 << 20), pinned=True)
        dst = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
        new_ids = torch.randperm(shape[0], generator=torch.Generator().manual_seed(1))[:args.blocks].tolist()
        keys = [i.key for i in infos]
        restore_paged(store, keys, dst, new_ids, model="selfcheck-model", staging=staging)  # warm-up
        for c in dst:
            c.zero_()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        restore_paged(store, keys, dst, new_ids, model="selfcheck-model", staging=staging)
        torch.cuda.synchronize(dev)
        restore_s = time.perf_counter() - t0
        ok = all(torch.equal(dst[layer][n].cpu(), expected[o][layer])
                 for layer in range(args.layers) for o, n in zip(old_ids, new_ids))
        _check(ok, "every block restored into its new slot on the GPU")
        others = [i for i in range(shape[0]) if i not in set(new_ids)]
        _check(all(int(torch.count_nonzero(c[others].float())) == 0 for c in dst), "other slots untouched")
        print(f"  restore_paged: {total / 1e6:.1f} MB in {restore_s * 1e3:.1f} ms "
              f"({total / restore_s / 1e9:.2f} GB/s, verified, decompressed, H2D)")

        # 3. one large segment straight onto the device
        big = torch.randn(64 << 20 >> 1, device=dev, generator=g).to(torch.bfloat16)
        info = store.put(big.cpu())
        load(store, info.key, dev, staging=staging)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        got = load(store, info.key, dev, staging=staging)
        torch.cuda.synchronize(dev)
        load_s = time.perf_counter() - t0
        _check(got.device == dev and torch.equal(got, big), "large segment loads bit-exact onto the device")
        print(f"  load: {info.raw_size / 1e6:.1f} MB ({info.codec}, ratio "
              f"{info.raw_size / info.stored_size:.3f}) in {load_s * 1e3:.1f} ms "
              f"({info.raw_size / load_s / 1e9:.2f} GB/s)")
    print("gpu_selfcheck: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
