"""The generation end-to-end test on cuda:0: on an NVIDIA GPU when there is one, and on the
strict CUDA stand-in (tests/support/fakecuda.py) in the slow suite.

Same code path as the CPU tests: the workload processes run with ``--device cuda:0`` (KV
blocks leave the device through the flusher's pinned staging, and come back through pinned
staging on restore), are SIGKILLed at random points, recovered through ``kvj recover``
and resumed; the tokens must equal an uninterrupted run on the same device. On the stand-in
the workers start through ``tests/support/fakecuda_run.py``, so their copies run late and their
streams race unless kvj waits.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import pytest  # noqa: E402
import torch  # noqa: E402
from support.e2e import check_cycles, reference_generation, rng  # noqa: E402
from support.fakecuda import FakeCuda  # noqa: E402

from kvj.demo import crashrun  # noqa: E402
from kvj.demo.worker import read_results  # noqa: E402
from kvj.demo.workload import GenerationWorkload, ModelSpec  # noqa: E402

pytest.importorskip("transformers")

DEVICE = "cuda:0"
#: Each loop step lasts at least 10 ms, as with a real model, so the random kills land
#: before, across and after the journal's 100 ms commit windows.
PACE = ["--pace-ms", "10"]
WORK = GenerationWorkload(ModelSpec("llama", "small"), requests=4, max_new_tokens=32, stagger=3)
RUNNER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "fakecuda_run.py")

GPU = pytest.param("gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"))
STAND_IN = pytest.param("stand-in", marks=[pytest.mark.slow, pytest.mark.skipif(
    torch.version.cuda is not None, reason="the CUDA stand-in runs on CPU-only torch builds")])


@pytest.mark.parametrize("where", [GPU, STAND_IN])
@pytest.mark.parametrize("backend", ["hf", "paged"])
def test_sigkill_generation_on_cuda_resumes_token_identical(tmp_path, monkeypatch, backend, where):
    r = rng(f"gpu-{backend}-{where}")
    argv = crashrun.worker("generate", "--backend", backend, "--device", DEVICE, "--journal", str(tmp_path / "j"),
                           "--results", str(tmp_path / "out"), *WORK.argv(), *PACE)
    sim = None
    if where == "stand-in":
        sim = FakeCuda(devices=1).install(monkeypatch)
        argv = [sys.executable, RUNNER, "kvj.demo.worker", *argv[3:]]
    expected, total = reference_generation(WORK, backend, DEVICE)
    if sim is not None:
        sim.check()
    cycles = crashrun.generation_kill_cycles(argv, kills=2, total_steps=total, r=r)
    assert cycles, "the workload finished before the first kill"
    assert check_cycles(cycles, WORK) > 0
    assert read_results(str(tmp_path / "out")) == expected
