"""Training benchmark (``kvj bench training``, or ``python -m benchmarks.training``), side by side.

1. The LoRA fine-tune of the tests (random Llama, tiny by default; PEFT LoRA on q/v; CPU,
   one torch thread) four ways: no checkpointing; kvj's ``KvjCallback`` journaling every
   step (a full save every 50 steps, deltas between); Trainer's own checkpointing every 50
   steps (``save_steps=50``: safetensors adapter, ``optimizer.pt``, scheduler, RNG, trainer
   state); and Trainer every step (``save_steps=1``, what Trainer needs to lose as little
   as kvj). Per method: the median seconds per step over ``rounds`` interleaved runs, the
   overhead against no checkpointing, CPU time per step (every thread of the process: on a
   busy machine a steadier measure of the work than wall time), bytes written per step,
   and the steps a crash loses, measured at every step boundary (maximum and mean): for kvj
   the steps after ``durable_step``, for Trainer those after its last checkpoint (which
   Trainer does not fsync).
2. Taking a snapshot on the training thread, for a state shaped like a LoRA of an 8B model
   (``tensors`` adapter matrices, rank 16, with AdamW's two moments and step counters: four
   times as many tensors; smaller matrices than a real 8B model's, since the cost measured
   here is per tensor): milliseconds per save for kvj's ``StateBuffers.capture`` (its buffers
   kept for the run, as ``StateJournal`` keeps them) against cloning every tensor (what a
   loop without kvj would do to keep a copy), median of ``rounds`` interleaved repeats.
3. DCP in one process: the same state saved and loaded through kvj's ``JournalWriter`` /
   ``JournalReader`` (its automatic codec, and no compression) and through DCP's
   ``FileSystemWriter`` / ``FileSystemReader``
   (``sync_files=True``, its other defaults): save GB/s (durable), load GB/s (from the page
   cache), bytes on disk, and whether the load is bit-exact.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from kvj.errors import InvalidArgument

METHODS = ("no checkpoints", "kvj every step", "Trainer save_steps=50", "Trainer save_steps=1")


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if os.path.isfile(os.path.join(d, f)))


def _crash_probe(held: Optional[Callable[[], Optional[int]]], lags: List[int]) -> Any:
    """A callback noting, before every step, how many steps a crash at that moment would lose:
    those after ``held()`` (kvj), or without ``held``, after Trainer's last checkpoint."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.saved = 0

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.saved = state.global_step

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            lags.append(state.global_step - ((held() if held is not None else self.saved) or 0))

    return Probe()


def _one_run(method: str, steps: int, size: str, out: str) -> Dict[str, Any]:
    from kvj.demo.hf_training import LoraRun, build_trainer
    from kvj.demo.workload import ModelSpec
    from kvj.integrations.hf_trainer import KvjCallback

    run = LoraRun(model=ModelSpec("llama", size), steps=steps, samples=256)
    lags: List[int] = []
    callbacks: List[Any] = [_crash_probe(None, lags)]
    if method == "kvj every step":
        kvj_cb = KvjCallback(journal=os.path.join(out, "journal"), full_every=50)
        callbacks = [kvj_cb, _crash_probe(lambda: kvj_cb.durable_step, lags)]
    save_steps = int(method.split("=")[1]) if method.startswith("Trainer") else None
    trainer = build_trainer(run, out, callbacks, save_steps=save_steps)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"s/step": elapsed / steps, "cpu/step": cpu / steps, "bytes/step": _bytes_under(out) / steps, "lags": lags}


def trainer_rows(steps: int, rounds: int, size: str, root: str) -> List[Dict[str, Any]]:
    """The four methods, ``rounds`` times each, interleaved (so a change in machine load
    hits them alike); medians of seconds per step."""
    torch.set_num_threads(1)
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        for method in METHODS:
            out = os.path.join(root, f"{method.replace(' ', '_').replace('=', '')}-{r}")
            runs[method].append(_one_run(method, steps, size, out))
            shutil.rmtree(out, ignore_errors=True)
    base = statistics.median(x["s/step"] for x in runs[METHODS[0]])
    rows = []
    for method in METHODS:
        s_step = statistics.median(x["s/step"] for x in runs[method])
        lags = [lag for x in runs[method] for lag in x["lags"]]
        rows.append({"method": method, "s/step": s_step, "overhead": f"{(s_step / base - 1) * 100:+.1f}%",
                     "CPU ms/step": statistics.median(x["cpu/step"] for x in runs[method]) * 1e3,
                     "KiB written/step": statistics.median(x["bytes/step"] for x in runs[method]) / 1024,
                     "crash loses (max, mean steps)": f"{max(lags)}, {statistics.fmean(lags):.1f}"})
    return rows


def snapshot_rows(tensors: int, repeats: int) -> List[Dict[str, Any]]:
    """kvj's capture against cloning each tensor, on a LoRA-shaped AdamW state (CPU)."""
    from kvj.integrations.training import StateBuffers, training_state

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn((16, 512) if i % 2 == 0 else (512, 16), generator=gen) * 0.02)
              for i in range(tensors)]
    model = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    buffers = StateBuffers(2)

    def kvj_capture() -> None:
        snap = buffers.capture(training_state(model, opt, step=1, rng=False))
        snap.wait()
        snap.release()

    def clone_each() -> None:
        state = training_state(model, opt, step=1, rng=False)
        state["model"] = {n: t.detach().clone() for n, t in state["model"].items()}
        state["optimizer"]["state"] = {i: {k: v.clone() for k, v in s.items()}
                                       for i, s in state["optimizer"]["state"].items()}

    methods = {"kvj StateBuffers.capture": kvj_capture, "clone every tensor": clone_each}
    times: Dict[str, List[float]] = {m: [] for m in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    n = tensors + sum(len(s) for s in opt.state.values())
    nbytes = sum(p.numel() * p.element_size() * 3 for p in params)  # the matrices and two moments
    return [{"method": name, "tensors": n, "MiB": nbytes / (1 << 20), "ms/save": statistics.median(ts) * 1e3}
            for name, ts in times.items()]


def dcp_rows(mib: int, root: str) -> List[Dict[str, Any]]:
    """One state of ``mib`` MiB (four float32 tensors) through kvj and DCP's file system storage."""
    import torch.distributed.checkpoint as dcp

    from kvj.integrations.dcp import JournalReader, JournalWriter

    gen = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) // 4 // 4
    state = {f"layer{i}": torch.randn(n, generator=gen) * 0.02 for i in range(4)}
    size = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    for name in ("kvj JournalWriter", "kvj JournalWriter codec=raw", "DCP FileSystemWriter"):
        path = os.path.join(root, name.replace(" ", "_").replace("=", ""))
        kvj_side = name.startswith("kvj")
        writer = (JournalWriter(path, step=1, codec="raw" if name.endswith("raw") else "auto") if kvj_side
                  else dcp.FileSystemWriter(path, sync_files=True))
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        save = time.perf_counter() - t0
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = JournalReader(path) if kvj_side else dcp.FileSystemReader(path)
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader, no_dist=True)
        load = time.perf_counter() - t0
        exact = all(torch.equal(target[k], state[k]) for k in state)
        rows.append({"method": name, "MiB": size >> 20, "save GB/s": size / save / 1e9,
                     "load GB/s": size / load / 1e9, "on disk MiB": _bytes_under(path) / (1 << 20),
                     "bit-exact": "yes" if exact else "NO"})
    return rows


def run(directory: Optional[str] = None, steps: int = 200, rounds: int = 3, size: str = "tiny",
        mib: int = 256, tensors: int = 448) -> Dict[str, Any]:
    """The three comparisons, in a temporary directory under ``directory`` (removed afterwards)."""
    from kvj.demo.workload import SIZES

    if size not in SIZES:
        raise InvalidArgument(f"model size must be one of {', '.join(sorted(SIZES))}, not {size!r}")
    root = tempfile.mkdtemp(prefix="kvj-bench-training-", dir=directory)
    try:
        trainer = trainer_rows(steps, rounds, size, os.path.join(root, "trainer"))
        snapshot = snapshot_rows(tensors, max(5, 5 * rounds))
        dcp = dcp_rows(mib, os.path.join(root, "dcp"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"steps": steps, "rounds": rounds, "size": size, "mib": mib, "tensors": tensors, "trainer": trainer,
            "snapshot": snapshot, "dcp": dcp, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}


def _table(rows: List[Dict[str, Any]]) -> str:
    cols = list(rows[0])
    cells = [[f"{r[c]:.4f}" if isinstance(r[c], float) and r[c] < 1 else f"{r[c]:,.2f}" if isinstance(r[c], float)
              else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def format_table(result: Dict[str, Any]) -> str:
    return "\n".join([
        f"LoRA fine-tune ({result['size']} Llama) through transformers.Trainer, {result['steps']} steps, "
        f"CPU, 1 thread; median of {result['rounds']} interleaved rounds",
        _table(result["trainer"]),
        "",
        f"Snapshot on the training thread, LoRA-shaped AdamW state ({result['tensors']} adapter matrices), CPU; "
        "median of interleaved repeats",
        _table(result["snapshot"]),
        "",
        f"DCP, one process, {result['mib']} MiB of float32 state; durable saves, loads from the page cache",
        _table(result["dcp"]),
        "",
        f"{result['cpus']} CPUs, load average {result['load_average']:.2f} after the run"])


if __name__ == "__main__":
    print(format_table(run(os.environ.get("KVJ_BENCH_DIR"))))
