"""The generation end-to-end test on cuda:0 (skipped without an NVIDIA GPU).

Same code path as the CPU tests: the workload processes run with ``--device cuda:0`` (KV
blocks leave the GPU through the flusher's pinned staging, and come back through pinned
staging on restore), are SIGKILLed at random points, recovered through ``kvj recover``
and resumed; the tokens must equal an uninterrupted run on the same GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import pytest  # noqa: E402
import torch  # noqa: E402
from support.e2e import check_cycles, reference_generation, rng  # noqa: E402

from kvj.demo import crashrun  # noqa: E402
from kvj.demo.worker import read_results  # noqa: E402
from kvj.demo.workload import GenerationWorkload, ModelSpec  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
pytest.importorskip("transformers")

DEVICE = "cuda:0"
#: Each loop step lasts at least 10 ms, as with a real model, so the random kills land
#: before, across and after the journal's 100 ms commit windows.
PACE = ["--pace-ms", "10"]
WORK = GenerationWorkload(ModelSpec("llama", "small"), requests=4, max_new_tokens=32, stagger=3)


@pytest.mark.parametrize("backend", ["hf", "paged"])
def test_sigkill_generation_on_gpu_resumes_token_identical(tmp_path, backend):
    r = rng(f"gpu-{backend}")
    expected, total = reference_generation(WORK, backend, DEVICE)
    argv = crashrun.worker("generate", "--backend", backend, "--device", DEVICE, "--journal", str(tmp_path / "j"),
                           "--results", str(tmp_path / "out"), *WORK.argv(), *PACE)
    cycles = crashrun.generation_kill_cycles(argv, kills=2, total_steps=total, r=r)
    assert cycles, "the workload finished before the first kill"
    assert check_cycles(cycles, WORK) > 0
    assert read_results(str(tmp_path / "out")) == expected
