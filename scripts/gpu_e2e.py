#!/usr/bin/env python3
"""GPU end-to-end check: SIGKILL generation on cuda:0, recover, resume, compare, and time it.

For each cache (transformers DynamicCache, paged): an uninterrupted reference run on the
GPU, then the workload process (``--device cuda:0``) killed twice at random points,
``kvj fsck`` + ``kvj recover`` through the CLI, and resumed. Prints, per request: tokens
identical or not, KV positions at the kill, restored from the journal, recomputed, and
the time to restore the KV against re-prefilling the same tokens on the GPU.

    python scripts/gpu_e2e.py [--size small|demo] [--kills 2] [--seed N]

Exit status 0 when every request matches its reference, 1 otherwise, 2 without CUDA.
``--device cpu`` runs the same check on the CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch  # noqa: E402

from kvj.demo import crashrun  # noqa: E402
from kvj.demo.worker import read_results  # noqa: E402
from kvj.demo.workload import GenerationWorkload, ModelSpec  # noqa: E402


def run(backend: str, work: GenerationWorkload, kills: int, seed: int, device: str) -> bool:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    expected, total = crashrun.uninterrupted_generation(work, backend, device)
    with tempfile.TemporaryDirectory(prefix="kvj-gpu-e2e-") as tmp:
        argv = crashrun.worker("generate", "--backend", backend, "--device", device, "--journal",
                               os.path.join(tmp, "j"), "--results", os.path.join(tmp, "out"), "--pace-ms", "10",
                               *work.argv())
        cycles = crashrun.generation_kill_cycles(argv, kills, total, random.Random(seed))
        got = read_results(os.path.join(tmp, "out"))
    ok = got == expected
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    print(f"\n== {backend} cache on {where}: {len(cycles)} kill(s), "
          f"{'ALL TOKENS IDENTICAL' if ok else 'MISMATCH'} ({time.perf_counter() - t0:.1f} s)")
    print(f"{'kill':>4} {'request':8} {'identical':9} {'at kill':>7} {'restored':>8} {'recomputed':>10} "
          f"{'first computed':>14} {'restore ms':>10} {'re-prefill ms':>13}")
    for n, cycle in enumerate(cycles, 1):
        summary = cycle.get("summary") or {}
        for req in cycle["manifest"]["requests"]:
            rid, pos = req["id"], req["resume_position"]
            at_kill = cycle["progress"].get(rid, 0)
            entry = summary.get(rid, {})
            restore = cycle["resumed"].get(rid, {}).get("restore_s")
            prefill = entry.get("prefill_s")
            print(f"{n:>4} {rid:8} {str(got.get(rid) == expected[rid]):9} {at_kill:>7} {pos:>8} {at_kill - pos:>10} "
                  f"{str(cycle['first_start'].get(rid, '-')):>14} "
                  f"{'-' if restore is None else f'{restore * 1e3:.2f}':>10} "
                  f"{'-' if prefill is None else f'{prefill * 1e3:.2f}':>13}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="demo", choices=["tiny", "small", "demo"])
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--seed", type=int, default=random.randrange(1_000_000))
    p.add_argument("--device", default="cuda:0", help="cuda:N (cpu runs the same check without a GPU)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_e2e: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, seed {args.seed}, model size {args.size}")
    work = GenerationWorkload(ModelSpec("llama", args.size), requests=4, max_new_tokens=48, stagger=3)
    results = [run(backend, work, args.kills, args.seed, args.device) for backend in ("hf", "paged")]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
