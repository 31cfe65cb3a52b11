"""Training benchmark (``python -m kvj.bench.training``): one run, side by side.

1. The LoRA fine-tune of the tests (tiny Llama, PEFT on q/v, CPU) three ways: no
   checkpointing, kvj's ``KvjCallback`` journaling every step, and Trainer's own
   checkpointing every 50 steps (safetensors adapter + optimizer.pt + scheduler + RNG):
   seconds per step, bytes written per step, and what a crash loses.
2. DCP on one process: the same state saved and loaded through kvj's ``JournalWriter``/
   ``JournalReader`` and through DCP's ``FileSystemWriter``/``FileSystemReader``; GB/s.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Dict, List

import torch


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if os.path.isfile(os.path.join(d, f)))


def trainer_rows(steps: int, root: str) -> List[Dict[str, object]]:
    from kvj.demo.hf_training import LoraRun, build_trainer
    from kvj.integrations.hf_trainer import KvjCallback

    torch.set_num_threads(1)
    run = LoraRun(steps=steps, samples=256)
    rows = []
    for name in ("no checkpoints", "kvj every step", "Trainer save_steps=50"):
        out = os.path.join(root, name.replace(" ", "_"))
        cbs = [KvjCallback(journal=os.path.join(out, "journal"), full_every=50)] if name.startswith("kvj") else []
        trainer = build_trainer(run, out, cbs, save_steps=50 if name.startswith("Trainer") else None)
        t0 = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - t0
        rows.append({"method": name, "s/step": elapsed / steps, "bytes/step": _bytes_under(out) / steps,
                     "crash loses": {"no checkpoints": "everything", "kvj every step": "<= 1 step",
                                     "Trainer save_steps=50": "<= 50 steps"}[name]})
    base = rows[0]["s/step"]
    for r in rows:
        r["overhead"] = f"{(r['s/step'] / base - 1) * 100:+.1f}%"  # type: ignore[operator]
    return rows


def dcp_rows(mib: int, root: str) -> List[Dict[str, object]]:
    import torch.distributed.checkpoint as dcp

    from kvj.integrations.dcp import JournalReader, JournalWriter

    gen = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) // 4 // 4
    state = {f"layer{i}": torch.randn(n, generator=gen) * 0.02 for i in range(4)}
    size = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    for name in ("kvj JournalWriter", "DCP FileSystemWriter"):
        path = os.path.join(root, name.split()[0])
        writer = JournalWriter(path, step=1) if name.startswith("kvj") else dcp.FileSystemWriter(path, sync_files=True)
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        save = time.perf_counter() - t0
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = JournalReader(path) if name.startswith("kvj") else dcp.FileSystemReader(path)
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader, no_dist=True)
        load = time.perf_counter() - t0
        exact = all(torch.equal(target[k], state[k]) for k in state)
        rows.append({"method": name, "MiB": size >> 20, "save GB/s": size / save / 1e9,
                     "load GB/s": size / load / 1e9, "on disk MiB": _bytes_under(path) / (1 << 20),
                     "exact": "yes" if exact else "NO"})
    return rows


def _table(rows: List[Dict[str, object]]) -> str:
    cols = list(rows[0])
    cells = [[f"{r[c]:.4f}" if isinstance(r[c], float) and r[c] < 1 else f"{r[c]:,.2f}" if isinstance(r[c], float)
              else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(steps: int = 200, mib: int = 256) -> None:
    root = tempfile.mkdtemp(prefix="kvj-bench-training-", dir=os.environ.get("KVJ_BENCH_DIR"))
    try:
        print(f"LoRA fine-tune through transformers.Trainer, {steps} steps, CPU, 1 thread")
        print(_table(trainer_rows(steps, os.path.join(root, "trainer"))))
        print(f"\nDCP, one process, {mib} MiB of float32 state, durable saves, warm-cache loads")
        print(_table(dcp_rows(mib, os.path.join(root, "dcp"))))
        print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} after the run")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
