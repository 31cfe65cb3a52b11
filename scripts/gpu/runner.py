"""The GPU check's runner: checks in worker processes, in order, each bounded by its limit (a
check that outlives it is killed, with its Python stacks, and the rest go on), the JSON and
the summary table."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gpu
from gpu import common, environment
from gpu.common import FULL, ROOT, SCRIPT, SMALL, Ctx, Parts, Result, calibrate_sleep, setup_process

#: The checks in the order they run (the fast ones that a first run must report first), and how
#: long each may take on one H200 before it is killed.
LIMITS: Dict[str, float] = {"environment": 60, "bandwidth": 120, "device": 120, "vllm-blocks": 120,
                            "serving": 150, "hf-generation": 300, "lora": 300}
CHECKS = tuple(LIMITS)
#: The whole run's default bound on a GPU (the lease's command limit is 10 minutes).
BUDGET_S = 450.0
#: Under the stand-in every op runs in Python on a CPU: limits stretch by this much.
STANDIN_SLOWER = 10


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=(gpu.__doc__ or "").split("\n\n")[0],
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
        from gpu.models import child_main
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
            ctx = Ctx(sizes, device, torch.cuda.Stream(device), calibrate_sleep(device), tmp, common.SIM is not None)
        else:
            why = "no CUDA device (torch.cuda.is_available() is False); on a CPU run with --standin"
        for name in checks:
            report({"start": name})
            if ctx is None:
                res = Result(name, reason=why if name == "environment" else f"not run: {why}",
                             details=environment.environment_details() if name == "environment" else {})
            else:
                res = run_check(name, ctx)
            print(f"{res.status:4} {name} ({res.seconds:.1f} s){': ' + res.reason if res.reason else ''}", flush=True)
            report({"result": json.loads(json.dumps(asdict(res), default=str))})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_check(name: str, ctx: Ctx) -> Result:
    import torch

    parts = Parts(name)
    res = Result(name)
    t0 = time.perf_counter()
    try:
        with torch.cuda.stream(ctx.stream):
            res.details = check_functions()[name](ctx, parts) or {}
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


def check_functions() -> Dict[str, Callable[[Ctx, Parts], Optional[Dict[str, Any]]]]:
    """Each check's function, by name (their modules are imported once a worker runs them)."""
    from gpu import bandwidth, device_checks, models, serving, vllm_checks

    return {"environment": environment.check_environment, "bandwidth": bandwidth.check_bandwidth,
            "device": device_checks.check_device, "vllm-blocks": vllm_checks.check_vllm_blocks,
            "serving": serving.check_serving, "hf-generation": models.check_hf_generation,
            "lora": models.check_lora}
