"""``scripts/gpu_check.py`` on a CPU under the strict CUDA stand-in (``tests/support/fakecuda.py``):
every check passes on kvj as it is; a wait deleted from kvj makes the device check fail (each
of them, in the slow run); a check that hangs is killed at its limit, with its stacks, and the
next check still runs; without a GPU or the stand-in the script says so and exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.fakecuda import gpu  # noqa: F401
from support.mutants import CPU_INTO_CUDA, SITES, Site, mutated

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from gpu import common, runner  # noqa: E402 - the checks, imported as the script imports them


def _run(*args: str, env=None, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def _doc(out) -> dict:
    with open(os.path.join(out, "gpu_check.json"), encoding="utf-8") as f:
        return json.load(f)


def test_every_check_passes_under_the_standin(tmp_path):
    proc = _run("--standin", "--out", str(tmp_path))
    doc = _doc(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert doc["passed"] and doc["standin"] and doc["environment"]["standin"]
    checks = {c["name"]: c for c in doc["checks"]}
    assert list(checks) == list(runner.CHECKS)
    for c in checks.values():
        assert c["status"] == "PASS" and c["parts"], c
        assert all(p["status"] == "PASS" for p in c["parts"]), c
    assert len(checks["device"]["parts"]) == 13
    gen = checks["hf-generation"]["details"]["tiny"]
    assert gen["at_kill"] >= gen["restored"] >= (gen["prompt"] // gen["block"] + 1) * gen["block"]
    assert gen["distinct_tokens"] > 1
    lora = checks["lora"]["details"]
    assert lora["resumed"]["resumed_from"] >= lora["kill_once_durable"] and lora["without_kvj"]["fused"]
    assert {r["how"] for r in checks["bandwidth"]["details"]["rows"]} >= {
        "tensor.cpu() (pageable)", "kvj: CUDA.download into pinned memory, then its event"}
    assert any(r["how"].startswith("kvj: the connector's worker loads") for r in checks["bandwidth"]["details"]["rows"])
    serving = checks["serving"]["details"]
    assert serving["decode"]["with kvj"]["host_waits_in_hooks"] == {}
    assert serving["decode"]["with kvj"]["blocks_skipped"] > 0  # the prefill burst outruns the ring
    assert len(serving["streams"]["side_streams"]) == 2
    blocks = checks["vllm-blocks"]["details"]
    assert blocks["one_allocation_bfloat16"]["gathers"] == blocks["one_allocation_bfloat16"]["rounds"]
    assert "PASS device: scatter_blocks: fence() orders the caller's reads after the scatter" in proc.stdout


def _device_check(gpu, tmp_path, monkeypatch, check: str = "device"):
    monkeypatch.setattr(common, "SIM", gpu)
    device = torch.device("cuda", 0)
    ctx = common.Ctx(common.SMALL, device, torch.cuda.Stream(device), 1, str(tmp_path), True)
    return runner.run_check(check, ctx)


def _site(function: str, old: str) -> Site:
    (site,) = [s for s in SITES if s.function == function and old in s.old]
    return site


#: A wait of each primitive (from the shared mutation list), and the part of the device check
#: that fails without it.
FAST = {
    _site("Cuda.download", "gpu_wait_stream"): "download: kvj's copy waits for",
    _site("Transfer.fence", "gpu_wait"): "fence() orders the caller's reads",
    CPU_INTO_CUDA: "scatter_blocks",
}


@pytest.mark.parametrize("site", list(FAST), ids=lambda s: s.name)
def test_a_wait_deleted_from_kvj_fails_the_device_check(gpu, tmp_path, monkeypatch, site):
    with mutated(site):
        res = _device_check(gpu, tmp_path, monkeypatch)
    assert res.status == "FAIL"
    assert any(p["status"] == "FAIL" and FAST[site] in p["name"] for p in res.parts), res.parts


#: Sites no check fails without, and why: error paths (a CUDA call that fails), the download's
#: record_stream, which its wait of the caller's stream makes redundant (memory the caller frees
#: is reused only by work ordered after the copy), and one wait reintroduced on the serving thread.
SURVIVORS = {"device.Cuda.settle: stream.synchronize() -> None",
             "device.Cuda.enqueue_on: self.settle(stream) -> None",
             "device.Cuda.finish: self.settle(stream) -> None",
             "device.Cuda.download: self.keep_alive(tensor, side) -> None",
             # a load's pinned allocation on the serving thread: the serving check's loop loads nothing
             "loads.Loads._start_reads: slot = pool.take() if pool is not None else None -> "
             "slot = device.CUDA.pinned(pool.slot_bytes)"}


#: The mutation sites of the device layer and its callers (the training capture's run inside the
#: lora check's Trainer processes, out of reach of an in-process mutant).
DEVICE_SITES = [s for s in SITES + [CPU_INTO_CUDA] if not s.module.startswith("kvj.integrations.training.")]


@pytest.mark.slow
@pytest.mark.parametrize("site", DEVICE_SITES, ids=lambda s: s.name)
def test_every_wait_of_the_mutation_list_fails_a_check_or_is_a_known_survivor(gpu, tmp_path, monkeypatch, site):
    with mutated(site):
        failed = [c for c in ("device", "vllm-blocks", "serving")
                  if _device_check(gpu, tmp_path, monkeypatch, c).status == "FAIL"]
    assert bool(failed) != (site.name in SURVIVORS), failed


#: The training capture's sites the lora check does not reach, and why: the scaler's early
#: gather and its wait (no GradScaler: the fine-tune runs without mixed precision); the wait
#: for a capture without an optimizer step hook (KvjCallback always has one); recovery onto a
#: device (KvjCallback recovers on the host and loads the adapter into the model).
TRAINING_SURVIVORS = {"host.StateBuffers._download: early = cuda.CUDA.record(side) -> early = torch.cuda.Event()",
                      "host.StateBuffers._download: cuda.CUDA.gpu_wait(current, early) -> None",
                      "host.StateBuffers._download: cuda.CUDA.gpu_wait(current, gathered) -> None",
                      'recover._placed: cuda.CUDA.finish(last, cuda.CUDA.side_stream(target, "h2d")) -> None'}
TRAINING_SITES = [s for s in SITES
                  if s.module.startswith("kvj.integrations.training.") and s.name not in TRAINING_SURVIVORS]


def _mutant_site(tmp_path, code: str) -> str:
    """A directory whose sitecustomize.py runs ``code`` in every process the script starts."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return os.pathsep.join([str(site), ROOT, os.environ.get("PYTHONPATH", "")])


@pytest.mark.slow
@pytest.mark.parametrize("site", TRAINING_SITES, ids=lambda s: s.name)
def test_a_wait_deleted_from_the_training_capture_fails_the_lora_check(tmp_path, site):
    code = (f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n"
            "from support.mutants import SITES, mutated\n"
            f"MUTANT = mutated(next(s for s in SITES if s.name == {site.name!r}))  # kept: dropped, it undoes\n"
            "MUTANT.__enter__()\n")
    proc = _run("--standin", "--out", str(tmp_path / "out"), "--checks", "lora",
                env={"PYTHONPATH": _mutant_site(tmp_path, code)})
    (lora,) = _doc(tmp_path / "out")["checks"]
    assert proc.returncode == 1 and lora["status"] == "FAIL", lora


@pytest.mark.slow  # it waits out a 30 s limit
def test_a_check_that_hangs_is_killed_at_its_limit_and_the_next_check_still_runs(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PYTHONPATH", _mutant_site(tmp_path, (
        "import sys, time\nimport kvj.segments.device as d\n"
        "download = d.Cuda.download\n"
        "def hang_in_the_device_check(self, tensor, dest):  # its first part hangs; vllm-blocks' downloads do not\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        if frame.f_code.co_name == 'check_device':\n"
        "            time.sleep(3600)\n"
        "        frame = frame.f_back\n"
        "    return download(self, tensor, dest)\n"
        "d.Cuda.download = hang_in_the_device_check\n")))
    # long enough for the worker to start (torch, the stand-in) and reach the hang on a loaded machine
    monkeypatch.setitem(runner.LIMITS, "device", 30 / runner.STANDIN_SLOWER)
    code = runner.main(["--standin", "--out", str(tmp_path / "out"), "--checks", "device,vllm-blocks"])
    doc = _doc(tmp_path / "out")
    captured = capfd.readouterr()
    assert code == 1 and not doc["passed"]
    device, blocks = doc["checks"]
    assert device["status"] == "FAIL" and device["reason"].startswith("killed after 30 s (its limit is 30 s)")
    assert blocks["status"] == "PASS", blocks
    assert "sitecustomize.py" in captured.err and "hang_in_the_device_check" in captured.err  # the hung worker's stacks


def test_without_a_gpu_or_the_standin_it_says_so_and_exits_1(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run scripts/gpu_check.py itself")
    proc = _run("--out", str(tmp_path), "--checks", "environment,device", timeout=600)
    doc = _doc(tmp_path)
    assert proc.returncode == 1
    env, device = doc["checks"]
    assert env["status"] == device["status"] == "FAIL"
    assert "no CUDA device" in env["reason"] and "--standin" in env["reason"]
    assert device["reason"].startswith("not run: no CUDA device")
    assert doc["environment"]["torch"] == torch.__version__
