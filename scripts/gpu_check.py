#!/usr/bin/env python3
"""kvj's GPU check: one prepared command that runs kvj's CUDA paths on a GPU and says PASS or FAIL.

    python3 scripts/gpu_check.py --out DIR               a GPU machine (sized for one H200; the whole
                                                         run is bounded by --budget, 450 s by default)
    python3 scripts/gpu_check.py --standin --out DIR     a CPU: the same checks, small, under the
                                                         strict CUDA stand-in (tests/support/fakecuda.py)

Checks, in order (each prints PASS or FAIL with its reason, per part; each is timed and bounded:
one that outlives its limit is killed, with its Python stacks on stderr, and the rest go on):

environment    GPU, driver, torch, CUDA, the Python packages found; calibrates torch.cuda._sleep.
device         kvj.segments.device's download, upload, gather and scatter, the flusher's downloads,
               load.load / load_many / restore_paged, on NHD-permuted caches
               (``torch.empty(nb, N, H, C).permute(0, 2, 1, 3)``) under a non-default current stream.
               Races are made deterministic with ``torch.cuda._sleep`` (about 20 ms): before each
               producer (so a copy that does not wait for it reads stale bytes) and, on the other
               stream, before each overwrite or reuse (so an overwrite that does not wait for the
               copy lands first). Each part fails if one of kvj's waits is missing.
vllm-blocks    The vLLM connector's device work on caches shaped as vLLM 0.32 allocates them with
               FlashAttention for a ~1B Llama (16 layers, 8 KV heads, head 128, block 16: per layer
               [blocks, 8, 16, 256], an NHD-permuted view): a step's blocks gathered and saved
               (compared bit for bit with a synchronized readback of the cache), then loaded back
               into other blocks (compared with what was saved; other blocks untouched); then the
               connector's worker itself (kvj.integrations.vllm.worker.WorkerJournal, which needs
               no vLLM): a step's saves with the blocks overwritten at once, a restarted worker's
               asynchronous load polled to completion, compared with the cache's blocks.
hf-generation  Greedy generation of a random-weight Llama (tiny, and ~1B with a 4096-token prompt)
               journaled with kvj.integrations.hf.CacheJournal in a child process, SIGKILLed
               mid-decode, recovered (kvj.ops.recover), restored onto cuda:0 and resumed: tokens
               identical to an uninterrupted run, restored KV bit-identical to its KV; restore time
               against re-prefilling the same context.
lora           A LoRA fine-tune (PEFT) through transformers.Trainer with KvjCallback and fused
               AdamW on the GPU, in a child process SIGKILLed mid-run (its saves' races made
               deterministic: each optimizer step runs late, and so does kvj's gather of the state
               after it), recovered and resumed: adapter and optimizer state bit-identical to an
               uninterrupted run; ms per step with and without kvj.
timing         GB/s device-to-host and host-to-device through kvj against plain ``tensor.cpu()`` /
               ``.cuda()`` and pinned non-blocking copies, each result checked; host time per saved
               block (Flusher.submit here; gather_blocks and scatter_blocks in vllm-blocks).

Writes DIR/gpu_check.json (every check, part, reason, timing and the environment; DIR defaults to
$OUT) and DIR/gpu_check.progress.jsonl as it goes. Exit status 0 when every check passed, 1 when
one failed or did not run, 2 for bad arguments. ``--small`` shrinks every size (the 1B model is
skipped); ``--standin`` implies it: on a CPU the timings are not measurements.

On the GPU machine (Python 3.12, torch, transformers, peft, accelerate, safetensors, numpy, msgpack
installed; no network, no vLLM) kvj runs from this checkout; its binary dependencies that are
missing there travel as wheels (not committed; exactly one version of each). Here, in the repo:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \\
        -d .whl zstandard==0.25.0 msgspec==0.23.0 crc32c==2.9.post0 blake3==1.0.11

and there (carrying .whl):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && PYTHONPATH=/tmp/site python3 scripts/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # kvj from this checkout

#: The checks in the order they run, and how long each may take on one H200 before it is killed.
LIMITS: Dict[str, float] = {"environment": 60, "device": 120, "vllm-blocks": 180, "hf-generation": 300,
                            "lora": 300, "timing": 120}
CHECKS = tuple(LIMITS)
#: The whole run's default bound on a GPU (the lease's command limit is 10 minutes).
BUDGET_S = 450.0
#: Under the stand-in every op runs in Python on a CPU: limits stretch by this much.
STANDIN_SLOWER = 10
#: torch.cuda._sleep's length in milliseconds; the long one outlasts a whole burst of enqueues,
#: the training one a forward and backward pass of the 1B model.
DELAY_MS, LONG_DELAY_MS, TRAINING_DELAY_MS = 20.0, 200.0, 500.0
SEED = 20261201

#: Llama configurations built from transformers configs with random weights (nothing downloaded).
MODELS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2),
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, initializer_range=0.02),
}


@dataclass(frozen=True)
class Sizes:
    """Every size the checks use: ``FULL`` on a GPU, ``SMALL`` for ``--small`` and the stand-in."""

    micro: Tuple[int, int, int, int, int]  #: layers, blocks, block size, heads, width (per block: [H, N, C])
    vllm: Tuple[int, int, int, int, int, int]  #: layers, blocks, block size, heads, width, blocks per step
    generation: Tuple[Tuple[str, int, int, int], ...]  #: (model, prompt tokens, new tokens, block size)
    lora: Tuple[str, int, int, int, int, int]  #: model, steps, kill once this step is durable, batch, seq, rank
    transfer_mib: int  #: MiB each transfer timing moves
    flushed_block: Tuple[int, int, int, int, int]  #: a transformers KV block: layers, 2, block size, heads, head dim
    submits: int  #: blocks Flusher.submit is timed on
    dtype: str = "bfloat16"


FULL = Sizes(micro=(3, 16, 16, 8, 128), vllm=(16, 1024, 16, 8, 256, 256),
             generation=(("tiny", 512, 160, 16), ("llama-1b", 4096, 256, 16)),
             lora=("llama-1b", 24, 12, 4, 256, 8), transfer_mib=1024, flushed_block=(16, 2, 16, 8, 128), submits=64)
SMALL = Sizes(micro=(2, 8, 4, 2, 8), vllm=(2, 12, 16, 2, 16, 4), generation=(("tiny", 20, 24, 8),),
              lora=("tiny", 6, 3, 2, 8, 4), transfer_mib=1, flushed_block=(2, 2, 8, 2, 16), submits=8)


class CheckFailed(Exception):
    """A part of a check found kvj doing the wrong thing; the message is the reason."""


def expect(ok: bool, reason: str) -> None:
    if not ok:
        raise CheckFailed(reason)


# ================================================================================ orchestrator


@dataclass
class Result:
    """One check's outcome, as the JSON and the summary report it."""

    name: str
    status: str = "FAIL"
    reason: str = ""
    seconds: float = 0.0
    parts: List[Dict[str, Any]] = field(default_factory=list)
    details: Dict[str, Any] = field(default_factory=dict)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_check.json (default: $OUT)")
    p.add_argument("--small", action="store_true", help="small sizes everywhere (no 1B model)")
    p.add_argument("--standin", action="store_true", help="run on a CPU under tests/support/fakecuda.py "
                   "(implies --small)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--budget", type=float, help=f"seconds for the whole run (default {BUDGET_S:.0f}; "
                   "unbounded under --standin); checks left when it is spent do not run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["generate", "train"], help=argparse.SUPPRESS)
    p.add_argument("--journal", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    checks = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)}: choose from {', '.join(CHECKS)}")
    if args.child:
        return child_main(args)
    if args.worker:
        return worker_main(args, checks)
    if not args.out:
        p.error("--out DIR is needed (or $OUT)")
    return orchestrate(args, checks)


def orchestrate(args: argparse.Namespace, checks: List[str]) -> int:
    return Run(args, checks).run()


class Run:
    """The checks of one run, in worker processes: a check that outlives its limit (or the run's
    budget) is killed and fails, and a fresh worker runs the rest. The JSON is rewritten after
    every check, so a run cut short still leaves what it found."""

    def __init__(self, args: argparse.Namespace, checks: List[str]):
        self.args, self.checks = args, checks
        self.out = os.path.abspath(args.out)
        self.progress = os.path.join(self.out, "gpu_check.progress.jsonl")
        self.scale = STANDIN_SLOWER if args.standin else 1
        self.budget = args.budget if args.budget is not None else (None if args.standin else BUDGET_S)
        self.t_start = time.monotonic()
        self.deadline = None if self.budget is None else self.t_start + self.budget
        self.results: Dict[str, Result] = {}
        self.pending = list(checks)
        self.seen = 0  # lines of the progress file read so far

    def run(self) -> int:
        os.makedirs(self.out, exist_ok=True)
        open(self.progress, "w").close()
        scratch = tempfile.mkdtemp(prefix="kvj-gpu-check-")  # journals and stores: never under --out
        try:
            return self._run(scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run(self, scratch: str) -> int:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            [ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
        if self.args.standin:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from support.fakecuda import autograd_env  # builds its library here, once per machine
            env.update(autograd_env(devices=1))
        while self.pending:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                for name in self.pending:
                    self.results[name] = Result(name, reason=f"not run: the run's budget of {self.budget:.0f} s "
                                                "was spent")
                break
            argv = [sys.executable, SCRIPT, "--worker", "--progress", self.progress, "--scratch", scratch,
                    "--checks", ",".join(self.pending)]
            argv += ["--standin"] if self.args.standin else ["--small"] if self.args.small else []
            proc = subprocess.Popen(argv, env=env, process_group=0)  # its own group, to kill it whole
            try:
                self.watch(proc)
            finally:
                if proc.poll() is None:  # this process is going down: the worker and its children too
                    _kill_worker(proc)
        doc = self.report()
        ordered = [Result(**c) for c in doc["checks"]]
        print(f"\ngpu_check: {sum(r.status == 'PASS' for r in ordered)} of {len(ordered)} checks passed in "
              f"{doc['seconds']:.0f} s{' (the CUDA stand-in, on a CPU)' if self.args.standin else ''}; "
              f"{os.path.join(self.out, 'gpu_check.json')}")
        for r in ordered:
            print(f"  {r.status:4}  {r.name:13} {r.seconds:7.1f} s  {r.reason}")
        return 0 if doc["passed"] else 1

    def watch(self, proc: subprocess.Popen) -> None:
        """Follow one worker until it exits, or kill it when its check runs out of time."""
        current: Optional[Tuple[str, float]] = None  # the check it runs, since when
        while True:
            with open(self.progress, encoding="utf-8") as f:
                lines = f.read().splitlines()
            for line in lines[self.seen:]:
                msg = json.loads(line)
                if "start" in msg:
                    current = (msg["start"], time.monotonic())
                else:
                    self.finished(Result(**msg["result"]))
                    current = None
            self.seen = len(lines)
            code = proc.poll()
            if code is not None:
                if current is not None:  # it died inside a check: that one fails, a fresh worker runs the rest
                    self.finished(Result(current[0], reason=f"the worker process exited with status {code} "
                                         "during this check; see its output above"))
                else:
                    for name in list(self.pending):
                        self.finished(Result(name, reason=f"not run: the worker exited with status {code}"))
                return
            now = time.monotonic()
            over_budget = self.deadline is not None and now > self.deadline
            if current is not None and (over_budget or now - current[1] > LIMITS[current[0]] * self.scale):
                _kill_worker(proc)
                spent = now - current[1]
                why = (f"the run's budget of {self.budget:.0f} s was spent" if over_budget
                       else f"its limit is {LIMITS[current[0]] * self.scale:.0f} s")
                self.finished(Result(current[0], reason=f"killed after {spent:.0f} s ({why}); its Python stacks "
                                     "are on stderr above", seconds=round(spent, 1)))
                return
            if over_budget:  # between checks
                _kill_worker(proc)
                return
            time.sleep(0.2)

    def finished(self, result: Result) -> None:
        self.results[result.name] = result
        self.pending.remove(result.name)
        self.report()

    def report(self) -> Dict[str, Any]:
        """``gpu_check.json`` as it stands (replaced atomically); it passes once every check has."""
        ordered = [self.results[name] for name in self.checks if name in self.results]
        env = self.results.get("environment")
        doc = {"passed": len(ordered) == len(self.checks) and all(r.status == "PASS" for r in ordered),
               "standin": bool(self.args.standin), "sizes": "small" if self.args.small or self.args.standin else "full",
               "seconds": round(time.monotonic() - self.t_start, 1), "argv": sys.argv,
               "environment": env.details if env is not None else None, "checks": [asdict(r) for r in ordered]}
        path = os.path.join(self.out, "gpu_check.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True, default=str)
        os.replace(path + ".tmp", path)
        return doc


def _kill_worker(proc: subprocess.Popen) -> None:
    """Ask the worker for its Python stacks (faulthandler), then kill its whole process group."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)  # time to write them; it does not exit
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ================================================================================ worker

#: The CUDA stand-in, when this process runs under it (--standin).
SIM: Any = None
RID = "gpu-check-0"


def install_standin() -> None:
    """Put the strict CUDA stand-in in place for this whole process (before transformers loads)."""
    global SIM
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import pytest

    from support.fakecuda import FakeCuda
    SIM = FakeCuda(devices=1).install(pytest.MonkeyPatch())  # never undone: the process is the run


def setup_process(standin: bool) -> None:
    """What the worker and its children do first: deterministic cuBLAS (read when CUDA starts),
    the stand-in if asked, stacks dumped on SIGUSR1 (the orchestrator's kill)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if standin:
        install_standin()


@dataclass
class Ctx:
    """What every check runs with: the sizes, the device, the non-default stream the checks run
    under, how many cycles torch.cuda._sleep spins for DELAY_MS, and a scratch directory."""

    sizes: Sizes
    device: Any
    stream: Any
    cycles: int
    tmp: str
    standin: bool

    def delay(self, stream: Any = None, long: bool = False) -> None:
        """A kernel that only takes time (DELAY_MS, or LONG_DELAY_MS), on ``stream`` (default: the
        checks' stream), so that what is enqueued behind it runs late."""
        import torch

        with torch.cuda.stream(stream if stream is not None else self.stream):
            torch.cuda._sleep(int(self.cycles * (LONG_DELAY_MS / DELAY_MS if long else 1)))

    def side(self, purpose: str) -> Any:
        from kvj.segments import device as kd

        return kd.CUDA.side_stream(self.device, purpose)

    @property
    def dtype(self) -> Any:
        import torch

        return getattr(torch, self.sizes.dtype)


def calibrate_sleep(device: Any) -> int:
    """torch.cuda._sleep cycles that last DELAY_MS on this GPU (after a warm-up: clocks ramp)."""
    import torch

    if SIM is not None:
        return 1
    torch.cuda.synchronize(device)
    for _ in range(3):
        torch.cuda._sleep(1_000_000)
        torch.cuda.synchronize(device)
    n = 50_000_000
    t0 = time.perf_counter()
    torch.cuda._sleep(n)
    torch.cuda.synchronize(device)
    return max(1, int(n / (time.perf_counter() - t0) * DELAY_MS / 1e3))


def worker_main(args: argparse.Namespace, checks: List[str]) -> int:
    """Run ``checks`` in order, each under the checks' stream, reporting to ``--progress``."""
    setup_process(args.standin)
    import torch

    sizes = SMALL if args.small or args.standin else FULL

    def report(msg: Dict[str, Any]) -> None:
        with open(args.progress, "a", encoding="utf-8") as f:
            f.write(json.dumps(msg, sort_keys=True) + "\n")

    tmp = tempfile.mkdtemp(dir=args.scratch)
    try:
        ctx: Optional[Ctx] = None
        why = ""
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
            ctx = Ctx(sizes, device, torch.cuda.Stream(device), calibrate_sleep(device), tmp, SIM is not None)
        else:
            why = "no CUDA device (torch.cuda.is_available() is False); on a CPU run with --standin"
        for name in checks:
            report({"start": name})
            if ctx is None:
                res = Result(name, reason=why if name == "environment" else f"not run: {why}",
                             details=environment_details() if name == "environment" else {})
            else:
                res = run_check(name, ctx)
            print(f"{res.status:4} {name} ({res.seconds:.1f} s){': ' + res.reason if res.reason else ''}", flush=True)
            report({"result": json.loads(json.dumps(asdict(res), default=str))})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


class Parts:
    """The parts of one check: each runs, is checked against the stand-in's rules when it is
    installed, and is recorded PASS or FAIL with its reason; the GPU settles after each."""

    def __init__(self, check: str):
        self.check = check
        self.rows: List[Dict[str, Any]] = []

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        import torch

        t0 = time.perf_counter()
        status, reason = "PASS", ""
        try:
            yield
            standin_verdict()
        except CheckFailed as exc:
            status, reason = "FAIL", str(exc)
        except Exception as exc:  # noqa: BLE001 - any error fails the part, with its reason
            status, reason = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            if SIM is not None:
                SIM.violations.clear()
        row = {"name": name, "status": status, "reason": reason, "seconds": round(time.perf_counter() - t0, 3)}
        self.rows.append(row)
        print(f"  {status:4} {self.check}: {name}{' -- ' + reason if reason else ''}", flush=True)


def standin_verdict() -> None:
    """Under the stand-in: what it found wrong (memory used on another stream and freed without
    record_stream...) fails the part."""
    if SIM is not None:
        gc.collect()
        SIM.check()


def run_check(name: str, ctx: Ctx) -> Result:
    import torch

    parts = Parts(name)
    res = Result(name)
    t0 = time.perf_counter()
    try:
        with torch.cuda.stream(ctx.stream):
            res.details = CHECK_FUNCTIONS[name](ctx, parts) or {}
        failed = [r for r in parts.rows if r["status"] != "PASS"]
        res.status = "FAIL" if failed or not parts.rows else "PASS"
        res.reason = "; ".join(f"{r['name']}: {r['reason']}" for r in failed)
    except Exception as exc:  # noqa: BLE001 - the check could not go on: it fails with the reason
        traceback.print_exc()
        res.reason = f"{type(exc).__name__}: {exc}"
    res.parts = parts.rows
    res.seconds = round(time.perf_counter() - t0, 2)
    return res


# ------------------------------------------------------------------------------- helpers


def same(a: Any, b: Any) -> bool:
    """Whether two tensors (either side on the device) hold the same shape and bits."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool((a.view(-1).view(_bits_dtype(a)) == b.view(-1).view(_bits_dtype(b))).all())


def _bits_dtype(t: Any) -> Any:
    """An integer dtype of the same width, to compare bits (NaNs included)."""
    import torch

    return torch.uint8 if t.element_size() == 1 else {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def rand(shape: Sequence[int], seed: int, dtype: Any) -> Any:
    """A seeded random CPU tensor."""
    import torch

    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)).to(dtype)


def on_device(ctx: Ctx, cpu: Any) -> Any:
    """``cpu`` on the device, the host having waited for it (a value every stream may read)."""
    import torch

    out = cpu.to(ctx.device)
    torch.cuda.synchronize(ctx.device)
    return out


def pinned(shape: Sequence[int], dtype: Any) -> Any:
    import torch

    return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)


def nhd_layer(ctx: Ctx, blocks: int, block: int, heads: int, width: int) -> Any:
    """One layer of a paged cache in FlashAttention's NHD order, viewed [blocks, heads, block, width]."""
    import torch

    return torch.empty(blocks, block, heads, width, dtype=ctx.dtype, device=ctx.device).permute(0, 2, 1, 3)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / max(seconds, 1e-9) / 1e9, 3)


def median(values: Sequence[float]) -> Optional[float]:
    v = sorted(values)
    return v[len(v) // 2] if v else None


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels (cuBLAS, attention) while a run is compared with another bit for bit."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


# ================================================================================ environment


REQUIRED = ("numpy", "msgpack", "zstandard", "msgspec", "crc32c", "blake3", "transformers", "peft", "accelerate",
            "safetensors")


def environment_details() -> Dict[str, Any]:
    """What this machine is: GPU, driver, torch, CUDA, Python and the packages kvj needs."""
    from importlib import metadata

    import torch

    info: Dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
                            "standin": SIM is not None, "packages": {}}
    for name in ("torch", *REQUIRED):
        try:
            info["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["packages"][name] = None
    if torch.cuda.is_available():
        info["devices"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
    if SIM is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
                              "pcie.link.width.current", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"not available ({exc})"
    return info


def check_environment(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    import torch

    info = environment_details()
    info["sleep_cycles_per_ms"] = round(ctx.cycles / DELAY_MS)
    where = "the CUDA stand-in" if ctx.standin else f"{info.get('gpu')}, {info.get('nvidia_smi')}"
    print(f"  {where}; torch {torch.__version__}, CUDA {torch.version.cuda}, Python {info['python']}", flush=True)
    with parts.part("a CUDA device"):
        expect(torch.cuda.device_count() >= 1, "torch sees no CUDA device")
        expect(ctx.standin or torch.version.cuda is not None, "this torch is not built with CUDA")
    with parts.part("the packages kvj needs import"):
        missing = [n for n in REQUIRED if info["packages"][n] is None]
        expect(not missing, f"missing: {', '.join(missing)} (see the docstring for the wheels to carry)")
        import kvj.integrations.hf  # noqa: F401 - what the checks use, and their imports
        import kvj.integrations.hf_trainer  # noqa: F401
        import kvj.ops.recover  # noqa: F401
        import kvj.segments.flusher  # noqa: F401
    with parts.part("torch.cuda._sleep holds a stream back"):
        done = torch.cuda.Event()
        ctx.delay(long=True)
        done.record(ctx.stream)
        expect(not done.query(), "a long _sleep had finished before the host could look")
        done.synchronize()
    return info


# ================================================================================ device


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

    with parts.part("BlockRing: a slot whose copy is in flight is never handed out"):
        caches = caches_with(values)
        ring = BlockRing(caches, max_blocks=n, slots=2)
        hosts = [pinned((n, L, H, N, C), dt) for _ in range(3)]
        ctx.delay(ctx.side("d2h"), long=True)
        moves = [gather_blocks(caches, ids, hosts[i], ring.take()) for i in range(2)]
        expect(ring.waits == 0, "the ring waited with a free slot")
        third = ring.take()
        expect(ring.waits == 1 and third.transfer is not None and third.transfer.done(),
               "the ring handed out a slot whose copy was still in flight")
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


# ================================================================================ vLLM blocks


def check_vllm_blocks(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    """A step's KV blocks saved and loaded on caches shaped as vLLM 0.32 allocates them."""
    import random

    import torch

    from kvj.segments.device import BlockRing, gather_blocks, scatter_blocks
    from kvj.segments.flusher import Flusher
    from kvj.segments.store import SegmentStore

    L, nb, N, H, C, step = ctx.sizes.vllm
    dt = ctx.dtype
    caches = [nhd_layer(ctx, nb, N, H, C) for _ in range(L)]
    torch.manual_seed(SEED)
    ctx.delay()
    for c in caches:
        c.normal_()  # the forward pass that wrote them, late
    pick = random.Random(SEED)
    ids = pick.sample(range(nb), step)
    new_ids = pick.sample([i for i in range(nb) if i not in set(ids)], step)
    block_bytes = L * H * N * C * torch.empty((), dtype=dt).element_size()
    ring = BlockRing(caches, max_blocks=step, slots=2)
    host = pinned((step, L, H, N, C), dt)
    details: Dict[str, Any] = {"caches": f"{L} x [{nb}, {H}, {N}, {C}] {ctx.sizes.dtype}, NHD-permuted",
                               "blocks_per_step": step, "block_bytes": block_bytes}

    def read(which: Sequence[int]) -> Any:
        index = torch.tensor(list(which), device=ctx.device)
        return torch.stack([c.index_select(0, index) for c in caches], dim=1)

    with parts.part("a step's blocks gathered to the host are the cache's, bit for bit"):
        t0 = time.perf_counter()
        moved = gather_blocks(caches, ids, host, ring.take())
        enqueued = time.perf_counter() - t0
        moved.wait()
        landed = time.perf_counter() - t0
        torch.cuda.synchronize(ctx.device)
        readback = read(ids).cpu()  # a synchronized readback
        expect(same(host, readback), "the gathered blocks differ from a synchronized readback of the cache")
        details.update(gather_host_us_per_block=round(enqueued / step * 1e6, 2), gather_gbps=gbps(step * block_bytes,
                                                                                                landed))

    saved = pinned((step, L, H, N, C), dt)
    with parts.part("saved through the flusher and read back from the store: the same bits"):
        with SegmentStore(os.path.join(ctx.tmp, "vllm-store")) as store, Flusher(store) as fl:
            t0 = time.perf_counter()
            futures = [fl.submit(host[i]) for i in range(step)]
            infos = [f.result() for f in futures]
            details["flush_s"] = round(time.perf_counter() - t0, 3)
            for i, info in enumerate(infos):
                saved[i].copy_(store.get(info.key))
        expect(same(saved, readback), "a block read back from the store differs from the cache's")

    with parts.part("loaded into other blocks: what was saved, and no other block touched"):
        before = [c.clone() for c in caches]
        t0 = time.perf_counter()
        moved = scatter_blocks(caches, new_ids, saved, ring.take())
        enqueued = time.perf_counter() - t0
        moved.fence()
        moved.wait()
        landed = time.perf_counter() - t0
        expect(same(read(new_ids), saved), "the loaded blocks differ from what was saved")
        keep = torch.tensor([i for i in range(nb) if i not in set(new_ids)], device=ctx.device)
        expect(all(torch.equal(c.index_select(0, keep), b.index_select(0, keep)) for c, b in zip(caches, before)),
               "a block the load was not given changed")
        details.update(scatter_host_us_per_block=round(enqueued / step * 1e6, 2),
                       scatter_gbps=gbps(step * block_bytes, landed))

    with parts.part("the connector's worker: a step journaled, a restarted worker loads it into other blocks"):
        details.update(worker_journal(ctx, caches, ids, new_ids, read))
    return details


def worker_journal(ctx: Ctx, caches: List[Any], ids: List[int], new_ids: List[int],
                   read: Callable[[Sequence[int]], Any]) -> Dict[str, Any]:
    """The vLLM connector's worker side (``WorkerJournal``, vLLM not needed) on these caches: one
    step's saves with the blocks overwritten right after, a finish, then a restarted worker's
    asynchronous load polled to completion: the loaded blocks are what the cache held."""
    import torch

    from kvj.integrations.vllm.worker import Finish, Load, Save, Start, StepPlan, WorkerJournal
    from kvj.segments import kvblock

    L, _nb, N, H, C, step = ctx.sizes.vllm
    layout = kvblock.KVBlockLayout(model_id("vllm"), ctx.sizes.dtype, L, H, C // 2, N, kvblock.LHNC)
    tokens = [i % 1000 for i in range(step * N + 1)]
    chains = kvblock.chain_keys(layout.seed(), tokens, N)
    want = read(ids).cpu()
    journal = os.path.join(ctx.tmp, "vllm-journal")
    worker = WorkerJournal(journal, layout)
    worker.register(caches)
    saves = [Save("e-r0", b, ids[b], chains[b], tokens[b * N:(b + 1) * N + 1]) for b in range(step)]
    t0 = time.perf_counter()
    ctx.delay()
    for c in caches:
        c.mul_(1)  # the step's forward pass, still running when the connector saves
    worker.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {"prompt_len": len(tokens)})], saves=saves))
    enqueued = time.perf_counter() - t0
    for c in caches:
        c.zero_()  # vLLM reuses the blocks as soon as the step's save is enqueued
    worker.step(StepPlan(finishes=[Finish("r0", "e-r0", "length", [])]))
    worker.close()
    durable = time.perf_counter() - t0
    again = WorkerJournal(journal, layout)
    again.register(caches)
    again.step(StepPlan())
    t0 = time.perf_counter()
    ctx.delay(ctx.side("h2d"), long=True)  # kvj's copies run late: a load reported before they land is caught
    again.start_loads(StepPlan(loads=[Load("r1", list(zip(new_ids, chains[:step])))]))
    done: set = set()
    while "r1" not in done:
        expect(time.perf_counter() - t0 < 120, "the load was not reported done within 120 s")
        if SIM is not None:
            SIM.advance()  # the stand-in runs queued work only when asked; a GPU runs it meanwhile
        done.update(again.poll()[1])
        time.sleep(0.001)
    loaded = time.perf_counter() - t0
    expect(again.load_errors() == set(), f"blocks failed to load: {sorted(again.load_errors())}")
    # read on the compute stream, as the request's next forward pass would, with no host sync first
    expect(same(read(new_ids).cpu(), want), "the blocks the restarted worker loaded differ from the cache's")
    again.close()
    return {"worker_step_host_ms": round(enqueued * 1e3, 2), "worker_durable_s": round(durable, 3),
            "worker_load_s": round(loaded, 3)}


# ================================================================================ models


def build_model(name: str, device: Any, attention: str = "sdpa") -> Any:
    """A random-weight Llama from its config, made and initialised on ``device`` (seeded: the same
    weights in every process). Training uses eager attention: its backward is deterministic,
    which SDPA's fused kernels' need not be."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**MODELS[name], max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.to(torch.float32 if name == "tiny" else torch.bfloat16).eval()


def model_id(name: str) -> str:
    return f"gpu-check-{name}-seed{SEED}"


def prompt_tokens(name: str, count: int) -> List[int]:
    import torch

    gen = torch.Generator().manual_seed(SEED + count)
    return torch.randint(0, MODELS[name]["vocab_size"], (count,), generator=gen).tolist()


def decode(model: Any, prompt: Sequence[int], new: int, block: int, *, cache: Any = None,
           tokens: Optional[Sequence[int]] = None, computed: int = 0, journal: Any = None,
           on_step: Optional[Callable[[int, List[int]], None]] = None) -> Tuple[List[int], Any]:
    """Greedy generation on one fixed schedule: the prompt in chunks that end on block boundaries,
    then one token at a time, so a run resumed at a block boundary computes what the uninterrupted
    run did. ``journal`` (a CacheJournal) observes the cache after every forward pass."""
    import torch
    from transformers import DynamicCache

    from kvj.integrations.hf import cache_kwarg

    cache = cache if cache is not None else DynamicCache(config=model.config)
    tokens = list(tokens if tokens is not None else prompt)
    kwarg, total, device = cache_kwarg(model), len(prompt) + new, model.device
    with torch.no_grad():
        while len(tokens) < total:
            end = min(len(prompt), (computed // block + 1) * block) if computed < len(prompt) else computed + 1
            ids = torch.tensor([tokens[computed:end]], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits[0, -1]
            computed = end
            if end >= len(prompt):
                if not bool(torch.isfinite(logits).all()):
                    raise CheckFailed(f"the model's logits at position {end} are not finite")
                tokens.append(int(torch.argmax(logits)))
            if journal is not None:
                journal.observe(RID, cache, tokens)
            if on_step is not None:
                on_step(computed, tokens)
    return tokens, cache


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


# ================================================================================ HF generation


def check_hf_generation(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    details: Dict[str, Any] = {}
    for name, prompt_len, new, block in ctx.sizes.generation:
        details[name] = one_generation(ctx, parts, name, prompt_len, new, block)
    return details


def one_generation(ctx: Ctx, parts: Parts, name: str, prompt_len: int, new: int, block: int) -> Dict[str, Any]:
    import torch
    from transformers import DynamicCache

    from kvj.demo import crashrun
    from kvj.integrations.blocks import resume_points
    from kvj.integrations.hf import CacheJournal, cache_block, cache_kwarg
    from kvj.journal.journal import Journal
    from kvj.ops.recover import recover

    out: Dict[str, Any] = {"prompt": prompt_len, "new": new, "block": block}
    tag = f"{name}, {prompt_len}-token prompt"
    journal_dir = os.path.join(ctx.tmp, f"gen-{name}")
    with deterministic():
        model = build_model(name, ctx.device)
        prompt = prompt_tokens(name, prompt_len)
        want: List[int] = []
        with parts.part(f"{tag}: an uninterrupted run"):
            want, want_cache = decode(model, prompt, new, block)
            out["distinct_tokens"] = len(set(want[prompt_len:]))
        spec = json.dumps({"model": name, "prompt": prompt_len, "new": new, "block": block})
        argv = [sys.executable, SCRIPT, "--child", "generate", "--journal", journal_dir, "--spec", spec]
        whole = prompt_len // block + 1  # the prompt's whole blocks and the first block decoding completed
        with parts.part(f"{tag}: SIGKILLed mid-decode, recovered, resumed on {ctx.device}: tokens identical"):
            expect(bool(want), "no uninterrupted run to compare with")
            killed = crashrun.kill_when(crashrun.start(argv + (["--standin"] if ctx.standin else [])),
                                        lambda e: e.get("durable", 0) >= whole)
            expect(not killed.finished, "the child finished before the kill landed (raise the new tokens)")
            steps = killed.last("step")
            out["at_kill"] = max((e["computed"] for e in steps), default=0)
            manifest = recover(journal_dir).manifest
            with Journal.open(journal_dir) as journal:
                cj = CacheJournal(journal, model, block_size=block, model_id=model_id(name))
                points = [p for p in resume_points(manifest, cj.layout) if p.request_id == RID]
                expect(len(points) == 1, f"recovery found {len(points)} resume points for the request")
                point = points[0]
                expect(point.position >= whole * block, f"only {point.position} positions were durable at the kill")
                torch.cuda.synchronize(ctx.device)
                t0 = time.perf_counter()
                cache, tokens = cj.restore(point, ctx.device)
                torch.cuda.synchronize(ctx.device)
                out["restore_s"] = round(time.perf_counter() - t0, 4)
                expect(all(torch.equal(cache_block(cache, b, cj.layout), cache_block(want_cache, b, cj.layout))
                           for b in range(point.position // block)),
                       "the KV restored onto the device differs from the uninterrupted run's")
                got, _ = decode(model, prompt, new, block, cache=cache, tokens=tokens, computed=point.position,
                                journal=cj)
                cj.end(RID)
            out.update(restored=point.position, recomputed=out["at_kill"] - point.position)
            differ = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            expect(got == want, f"the resumed run's tokens differ from the uninterrupted run's from position {differ}")
        if "restored" in out:
            context = torch.tensor([want[:out["restored"]]], dtype=torch.long, device=ctx.device)
            with torch.no_grad():
                for _ in range(2):  # a warm-up, then the timed prefill
                    torch.cuda.synchronize(ctx.device)
                    t0 = time.perf_counter()
                    model(input_ids=context, use_cache=True, logits_to_keep=1,
                          **{cache_kwarg(model): DynamicCache(config=model.config)})
                    torch.cuda.synchronize(ctx.device)
                    out["prefill_s"] = round(time.perf_counter() - t0, 4)
            print(f"  {tag}: killed at position {out['at_kill']}, {out['restored']} restored, "
                  f"{out['recomputed']} recomputed; restore {out['restore_s'] * 1e3:.1f} ms (segments in the page "
                  f"cache) vs re-prefill of {out['restored']} tokens {out['prefill_s'] * 1e3:.1f} ms", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def child_generate(args: argparse.Namespace, spec: Dict[str, Any]) -> None:
    """The journaled generation the parent SIGKILLs: reports after each forward pass how many of
    its blocks are durable (their segment records are in the journal's durable part)."""
    import torch

    device = torch.device("cuda", 0)
    torch.use_deterministic_algorithms(True)
    with torch.cuda.stream(torch.cuda.Stream(device)):  # a non-default stream, as a server's
        run_generation(args, spec, device)
    emit(event="done")


def run_generation(args: argparse.Namespace, spec: Dict[str, Any], device: Any) -> None:
    """The child's generation, on the current stream (the model is made on it too, so reading
    its weights needs no wait)."""
    from kvj.integrations.hf import CacheJournal
    from kvj.journal.journal import Journal

    model = build_model(spec["model"], device)
    prompt = prompt_tokens(spec["model"], spec["prompt"])
    with Journal.open(args.journal) as journal:
        records: List[Any] = []
        flush = journal.flush

        def counted(*a: Any, **kw: Any) -> Any:
            records.append(flush(*a, **kw))
            return records[-1]

        journal.flush = counted  # type: ignore[method-assign]
        cj = CacheJournal(journal, model, block_size=spec["block"], model_id=model_id(spec["model"]))
        cj.start(RID, prompt, spec["new"])

        def on_step(computed: int, tokens: List[int]) -> None:
            durable = 0
            for r in records:
                if not r.done() or r.exception() is not None or r.result() > journal.writer.durable_lsn:
                    break
                durable += 1
            emit(event="step", computed=computed, tokens=len(tokens), durable=durable)

        decode(model, prompt, spec["new"], spec["block"], journal=cj, on_step=on_step)
        cj.end(RID)


# ================================================================================ LoRA


def make_trainer(spec: Dict[str, Any], output_dir: str, callbacks: List[Any]) -> Any:
    """A PEFT LoRA fine-tune of ``spec``'s model through transformers.Trainer, fused AdamW, on cuda:0."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from kvj.demo.hf_training import SyntheticLM

    base = build_model(spec["model"], torch.device("cuda", 0), attention="eager").train()
    model = get_peft_model(base, LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"],
                                            target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                                            task_type="CAUSAL_LM"))
    args = TrainingArguments(output_dir=output_dir, max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
                             learning_rate=2e-3, lr_scheduler_type="linear", save_strategy="no",
                             logging_steps=spec["steps"],  # each log waits for the GPU, hiding a missing wait
                             report_to=[], seed=SEED % 10_000, dataloader_num_workers=0, disable_tqdm=True,
                             optim="adamw_torch_fused", max_grad_norm=1.0)
    data = SyntheticLM(spec["batch"] * spec["steps"], spec["seq"], MODELS[spec["model"]]["vocab_size"], SEED % 997)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    return trainer


def train(spec: Dict[str, Any], output_dir: str, journal: Optional[str] = None, resume: bool = False,
          on_step: Optional[Callable[[int, Optional[int]], None]] = None, cycles: Optional[int] = None
          ) -> Dict[str, Any]:
    """One fine-tune (with KvjCallback when ``journal`` is given; resumed from it with ``resume``):
    its digests, the median ms per step and what it ran with. With ``cycles`` (torch.cuda._sleep
    cycles per DELAY_MS) the races of kvj's saves are made deterministic: each optimizer step runs
    late (a save that does not wait for it reads the state from before it) and so does kvj's
    gather of the state after it (a next step that does not wait for that changes what is saved)."""
    import torch
    from transformers import TrainerCallback

    from kvj.demo.hf_training import digests
    from kvj.integrations.hf_trainer import KvjCallback
    from kvj.segments import device as kd

    times: List[float] = []
    cb = KvjCallback(journal=journal, full_every=max(2, spec["steps"] // 4), model_id=model_id(spec["model"])) \
        if journal else None

    class Late(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda._sleep(cycles)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            with torch.cuda.stream(kd.CUDA.side_stream(kd.CUDA.resolve("cuda"), "d2h")):
                torch.cuda._sleep(int(cycles * TRAINING_DELAY_MS / DELAY_MS))

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter())
            if on_step is not None:
                on_step(state.global_step, cb.durable_step if cb is not None else None)

    callbacks = [Late() if cycles is not None else None, cb, Steps()]
    trainer = make_trainer(spec, output_dir, [c for c in callbacks if c is not None])
    checkpoint = cb.resume(trainer) if cb is not None and resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    steps = [b - a for a, b in zip(times, times[1:])]
    return {**digests(trainer), "ms_per_step": round(median(steps) * 1e3, 2) if steps else None,
            "optimizer": type(inner).__name__, "fused": bool(inner.defaults.get("fused")),
            "resumed_from": cb.recovered.step if cb is not None and cb.recovered is not None else None,
            "step": trainer.state.global_step}


def check_lora(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    """Trainer runs on the device's default stream, as training loops do (under the stand-in,
    autograd's backward runs on its engine thread's current stream, the default one)."""
    import torch

    from kvj.demo import crashrun
    from kvj.ops.recover import recover

    name, steps, kill_at, batch, seq, rank = ctx.sizes.lora
    spec = {"model": name, "steps": steps, "batch": batch, "seq": seq, "rank": rank}
    out: Dict[str, Any] = {"spec": spec, "kill_once_durable": kill_at}
    journal_dir = os.path.join(ctx.tmp, "lora-journal")
    with deterministic(), torch.cuda.stream(torch.cuda.default_stream(ctx.device)):
        ref: Dict[str, Any] = {}
        with parts.part(f"{name}: an uninterrupted fine-tune without kvj (fused AdamW on the device)"):
            ref = train(spec, os.path.join(ctx.tmp, "lora-ref"))
            expect(ref["fused"] and ref["optimizer"] == "AdamW", f"Trainer ran {ref['optimizer']}, fused="
                   f"{ref['fused']}, not fused AdamW")
            out["without_kvj"] = ref
        with parts.part(f"{name}: SIGKILLed mid-run, recovered, resumed: adapter and optimizer state bit-identical"):
            expect(bool(ref), "no uninterrupted run to compare with")
            argv = [sys.executable, SCRIPT, "--child", "train", "--journal", journal_dir, "--spec", json.dumps(spec)]
            killed = crashrun.kill_when(crashrun.start(argv + (["--standin"] if ctx.standin else [])),
                                        lambda e: (e.get("durable") or 0) >= kill_at)
            expect(not killed.finished, "the child finished before the kill landed (raise the steps)")
            out["killed_at_step"] = max((e["step"] for e in killed.last("step")), default=0)
            out["recovery"] = recover(journal_dir).manifest.get("training")
            resumed = train(spec, os.path.join(ctx.tmp, "lora-resumed"), journal=journal_dir, resume=True)
            out["resumed"] = resumed
            expect(resumed["resumed_from"] is not None and resumed["resumed_from"] >= kill_at,
                   f"resumed from step {resumed['resumed_from']}, not from the journal's step {kill_at} or later")
            expect(resumed["step"] == steps, f"the resumed run stopped at step {resumed['step']} of {steps}")
            expect(resumed["adapter_sha256"] == ref["adapter_sha256"], "the adapter after the resume differs from "
                   "the uninterrupted run's")
            expect(resumed["optimizer_sha256"] == ref["optimizer_sha256"], "the optimizer state after the resume "
                   "differs from the uninterrupted run's")
    resumed = out.get("resumed", {})
    print(f"  {name}: killed at step {out.get('killed_at_step')}, resumed from {resumed.get('resumed_from')}; ms "
          f"per step without kvj {ref.get('ms_per_step')}, with kvj {resumed.get('ms_per_step')} (the resumed run, "
          f"steps {resumed.get('resumed_from')} to {steps})", flush=True)
    return out


def child_train(args: argparse.Namespace, spec: Dict[str, Any]) -> None:
    """The journaled fine-tune the parent SIGKILLs, its races made deterministic (its saves are
    what the resume starts from): reports each step and the newest durable one."""
    import torch

    torch.use_deterministic_algorithms(True)
    train(spec, os.path.join(os.path.dirname(args.journal), "lora-killed"), journal=args.journal,
          on_step=lambda step, durable: emit(event="step", step=step, durable=durable),
          cycles=calibrate_sleep(torch.device("cuda", 0)))
    emit(event="done")


def child_main(args: argparse.Namespace) -> int:
    setup_process(args.standin)
    spec = json.loads(args.spec)
    (child_generate if args.child == "generate" else child_train)(args, spec)
    return 0


# ================================================================================ timing


def check_timing(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    """GB/s through kvj against plain copies, each result checked; host time per saved block."""
    import torch

    from kvj.segments import device as kd
    from kvj.segments.flusher import Flusher
    from kvj.segments.load import load
    from kvj.segments.staging import StagingPool
    from kvj.segments.store import SegmentStore

    nbytes = ctx.sizes.transfer_mib << 20
    dt = ctx.dtype
    numel = nbytes // torch.empty((), dtype=dt).element_size()
    src = torch.empty(numel, dtype=dt, device=ctx.device).normal_()
    torch.cuda.synchronize(ctx.device)
    want = src.cpu()
    pin = pinned((numel,), dt)
    pageable = want.clone()
    rows: List[Dict[str, Any]] = []

    def measure(direction: str, how: str, fn: Callable[[], Any], expected: Any) -> None:
        with parts.part(f"{direction} {how}"):
            expect(same(fn(), expected), "the copy's result is wrong")
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize(ctx.device)
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            rows.append({"direction": direction, "how": how, "MiB": ctx.sizes.transfer_mib, "GB/s": gbps(nbytes, best)})

    def pinned_d2h() -> Any:
        pin.copy_(src, non_blocking=True)
        torch.cuda.synchronize(ctx.device)
        return pin

    def kvj_d2h() -> Any:
        kd.CUDA.wait(kd.CUDA.download(src, pin))
        return pin

    def pinned_h2d() -> Any:
        out = pin.cuda(non_blocking=True)
        torch.cuda.synchronize(ctx.device)
        return out

    def kvj_h2d() -> Any:
        out, event = kd.CUDA.upload(pin, ctx.device)
        kd.CUDA.finish(event, kd.CUDA.side_stream(ctx.device, "h2d"))
        return out

    def pageable_h2d() -> Any:
        out = pageable.cuda()
        torch.cuda.synchronize(ctx.device)
        return out

    measure("D2H", "tensor.cpu() (pageable)", lambda: src.cpu(), want)
    measure("D2H", "copy_ into pinned memory, non_blocking, then synchronize", pinned_d2h, want)
    measure("D2H", "kvj: CUDA.download into pinned memory, then its event", kvj_d2h, want)
    pin.copy_(want)
    measure("H2D", "tensor.cuda() (pageable)", pageable_h2d, want)
    measure("H2D", "pinned .cuda(non_blocking=True), then synchronize", pinned_h2d, want)
    measure("H2D", "kvj: CUDA.upload from pinned memory, then its event", kvj_h2d, want)
    with SegmentStore(os.path.join(ctx.tmp, "timing-store")) as store:
        key = store.put(want, codec="raw").key
        pool = StagingPool(2 * nbytes, pinned=True)
        measure("H2D", "kvj: segments.load.load of a stored segment (read, CRC-checked, copied)",
                lambda: load(store, key, ctx.device, staging=pool), want)
        block = torch.empty(ctx.sizes.flushed_block, dtype=dt, device=ctx.device).normal_()
        count = ctx.sizes.submits
        with parts.part("host time per Flusher.submit of a device block"), Flusher(store) as fl:
            for _ in range(2):  # the first round allocates the pinned staging; the second is timed
                t0 = time.perf_counter()
                futures = [fl.submit(block) for _ in range(count)]
                submit_s = time.perf_counter() - t0
                infos = [f.result() for f in futures]
            expect(all(same(store.get(i.key), block) for i in infos[:2]), "a submitted block was saved wrong")
            rows.append({"direction": "D2H", "how": f"kvj: Flusher.submit of a {tuple(block.shape)} block "
                         f"({block.numel() * block.element_size() >> 10} KiB), host time", "us/block":
                         round(submit_s / count * 1e6, 1)})
    width = max(len(r["how"]) for r in rows)
    note = "   (the CUDA stand-in: not a measurement)" if ctx.standin else ""
    print(f"  {'':3} {'how':{width}}  {'GB/s':>8}{note}")
    for r in rows:
        value = f"{r['GB/s']:8.2f}" if "GB/s" in r else f"{r['us/block']:8.1f} us per block"
        print(f"  {r['direction']:3} {r['how']:{width}}  {value}", flush=True)
    return {"rows": rows, "measured_on": "the CUDA stand-in (not a measurement)" if ctx.standin else "GPU"}


CHECK_FUNCTIONS: Dict[str, Callable[[Ctx, Parts], Optional[Dict[str, Any]]]] = {
    "environment": check_environment, "device": check_device, "vllm-blocks": check_vllm_blocks,
    "hf-generation": check_hf_generation, "lora": check_lora, "timing": check_timing,
}


if __name__ == "__main__":
    sys.exit(main())
