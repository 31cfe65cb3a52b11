"""``kvj demo`` end to end, as the quick start runs it: the real CLI, real engines and
trainers in child processes, real SIGKILLs, and the proof table it prints.

The default demo (a vLLM engine with KvjConnector killed and resumed, live requests handed off
to a second engine, HF Trainer + PEFT with KvjCallback killed and resumed) runs
in CI with fewer requests, tokens and steps (the same code path, demo parameters); the full
default and ``--quick`` (kvj's own loops, whose parts the generation and training e2e tests
cover in CI) behind ``-m slow``; a machine without vLLM runs in CI too. Kill seeds are printed by the demo (``--seed`` replays one).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest
from support.cli_helpers import KVJ, env

from kvj.demo.stacks import vllm_available


def run_demo(tmp_path, *args: str) -> subprocess.CompletedProcess:
    seed = random.SystemRandom().randrange(1_000_000)
    print(f"kvj demo --seed {seed}")
    return subprocess.run([*KVJ, "demo", "--out", str(tmp_path / "out"), "--seed", str(seed), *args],
                          capture_output=True, text=True, env=env(COLUMNS="160"), timeout=1500, cwd=tmp_path)


def check_trainer_proof(out: str) -> None:
    assert re.search(r"adapter sha256 .*bit-identical", out), out
    assert re.search(r"optimizer sha256 .*bit-identical", out), out
    equal = re.search(r"loss at every step .*equal \((\d+)/(\d+)\)", out)
    assert equal and equal.group(1) == equal.group(2), out


def check_ends_on_the_proof(proc: subprocess.CompletedProcess) -> None:
    """The run's last words are the proof (its panel, then where the files are): nothing after
    it, above all no "nanobind: leaked" lines of Triton's at exit (issue 41 item 12)."""
    tail = proc.stdout.rstrip().splitlines()[-5:]
    assert any("PROOF: every request continued token for token" in line for line in tail), tail
    assert "nanobind" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def check_default(proc: subprocess.CompletedProcess, requests: int) -> None:
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    assert "PROOF: every request continued token for token" in out and "Traceback" not in out + proc.stderr
    assert "$ kvj fsck --journal" in out and "$ kvj recover --journal" in out
    row = r"(\d+)-token prompt\s+│\s+(\S+) \((\d+)/(\d+)\)\s+│\s+(\S+)\s+│\s+(\d+)\s+│\s+(\d+)\s+│\s+(\d+)"
    resumed, handoff = out.split("Handoff: every live request")
    # the killed engine's requests still in flight; every live request (drained mid-decode)
    for part, counts in ((resumed.split("The proof")[-1], range(1, requests + 1)), (handoff, [min(3, requests)])):
        rows = re.findall(row, part)
        assert len(rows) in counts, out
        for _, same, got, want, lp, _, restored, recomputed in rows:
            assert same == "yes" and got == want and float(lp) <= 5e-5, out
        # Some KV came back from a journal rather than being recomputed.
        assert sum(int(r[6]) for r in rows) > 0, out
    check_trainer_proof(out)
    check_ends_on_the_proof(proc)


@pytest.mark.skipif(not vllm_available(), reason="the default demo's serving part needs vLLM")
def test_kvj_demo_kills_vllm_and_hf_trainer_and_proves_both(tmp_path):
    check_default(run_demo(tmp_path, "--requests", "3", "--max-new", "48", "--steps", "12"), 3)


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="the default demo's serving part needs vLLM")
def test_kvj_demo_full_default(tmp_path):
    check_default(run_demo(tmp_path), 4)


@pytest.mark.slow
def test_kvj_demo_quick_runs_kvjs_own_loops(tmp_path):
    proc = run_demo(tmp_path, "--quick")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "PROOF: every request continued token for token" in proc.stdout
    assert "bit-identical" in proc.stdout and "MISMATCH" not in proc.stdout
    check_ends_on_the_proof(proc)


def test_kvj_demo_without_vllm_says_so_in_one_line_and_runs_the_rest(tmp_path):
    """A CUDA torch without vLLM (the quick start installs none there): one line, no traceback."""
    code = "import sys; sys.modules['vllm'] = None; from kvj.cli.main import main; sys.argv[0] = 'kvj'; main()"
    proc = subprocess.run([sys.executable, "-c", code, "demo", "--out", str(tmp_path / "out"), "--steps", "6",
                           "--seed", "1"], capture_output=True, text=True, env=env(COLUMNS="160"), timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "needs vLLM" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout
    assert "vLLM + KvjConnector" not in proc.stdout and not os.path.exists(tmp_path / "out" / "vllm")
    check_trainer_proof(proc.stdout)
    check_ends_on_the_proof(proc)
