"""A real vLLM engine (CPU backend) journals through KvjConnector, is SIGKILLed, and resumes.

Every engine runs in a child process (``support.vllm_engine``); the tiny random-weight Llama
has its weights scaled up so that its outputs depend on the context, and every comparison is
of tokens *and* logprobs, and of the raw KV loaded against the KV an uninterrupted engine
computed. Kill points come from a printed seed (``KVJ_VLLM_SEED=N`` replays one).
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

import kvj
from support.wait import wait_for

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 32  # the CPU attention backend takes multiples of 32
LOGPROB_TOL = 1e-5  # the CPU backend's batch invariance, measured (reference/serving.md)


def make_model(path: str, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # random weights at init scale barely depend on context
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"main": make_model(str(root / "main"), 0), "other": make_model(str(root / "other"), 1)}


def prompts(seed: int) -> Dict[str, List[int]]:
    """Four requests (two share a 96-token prefix) and a later one sharing 64 tokens with P1."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1024) for _ in range(n)]  # noqa: E731
    p0, p1, p3 = ids(150), ids(90), ids(200)
    return {"P0": p0, "P1": p1, "P2": p0[:96] + ids(20), "P3": p3, "Q": p1[:64] + ids(30)}


def start_engine(tmp: str, name: str, model: str, jobs: List[Dict[str, Any]], journal: str,
                 **settings: Any) -> subprocess.Popen:
    record = os.path.join(tmp, f"{name}-rec")
    os.makedirs(record, exist_ok=True)
    spec = {"model": model, "connector": "kvj", "journal": journal, "record": record,
            "out": os.path.join(tmp, f"{name}.jsonl"), "max_num_batched_tokens": 64, "jobs": jobs, **settings}
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen([sys.executable, "-m", "support.vllm_engine", path], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def lines(tmp: str, name: str) -> List[Dict[str, Any]]:
    path = os.path.join(tmp, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_engine(tmp: str, name: str, model: str, jobs: List[Dict[str, Any]], journal: str,
               **settings: Any) -> List[Dict[str, Any]]:
    proc = start_engine(tmp, name, model, jobs, journal, **settings)
    try:
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with open(os.path.join(tmp, f"{name}.log")) as f:
        assert rc == 0, f"engine {name} exited {rc}:\n{f.read()[-6000:]}"
    return lines(tmp, name)[1:]


def stats(tmp: str, name: str) -> Dict[str, int]:
    total = {"blocks_loaded": 0, "blocks_failed": 0}
    for path in glob.glob(os.path.join(tmp, f"{name}-rec", "stats-*.json")):
        with open(path) as f:
            for k, v in json.load(f).items():
                total[k] = total.get(k, 0) + v
    return total


def same(got: Dict[str, Any], want: Dict[str, Any], what: str, offset: int = 0) -> None:
    assert got["token_ids"] == want["token_ids"][offset:], f"{what}: tokens differ"
    np.testing.assert_allclose(got["logprobs"], want["logprobs"][offset:], rtol=0, atol=LOGPROB_TOL,
                               err_msg=f"{what}: logprobs differ")


def segment_records(journal: str) -> int:
    try:
        state = kvj.replay(journal)
    except kvj.KvjError:
        return 0  # caught mid-creation; ask again
    return sum(len(r.segments) for r in state.requests.values())


def kvj_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvj.cli.main", *args], capture_output=True, text=True)


def test_sigkill_mid_generation_then_fsck_recover_resume(models: Dict[str, str], tmp_path: Any) -> None:
    seed = int(os.environ.get("KVJ_VLLM_SEED") or random.SystemRandom().randrange(1 << 20))
    print(f"KVJ_VLLM_SEED={seed}")
    rng = random.Random(seed)
    tmp = str(tmp_path)
    ps = prompts(seed)
    batch = [ps["P0"], ps["P1"], ps["P2"], ps["P3"]]
    ref = run_engine(tmp, "ref", models["main"], [{"generate": batch, "max_tokens": 64}],
                     os.path.join(tmp, "ref-journal"))[0]["requests"]
    total = segment_records(os.path.join(tmp, "ref-journal"))

    # The same requests, killed once a random number of blocks is journaled.
    journal = os.path.join(tmp, "journal")
    kill_at = rng.randint(1, int(total * 0.7))
    proc = start_engine(tmp, "killed", models["main"], [{"generate": batch, "max_tokens": 64}], journal)
    try:
        wait_for(lambda: segment_records(journal) >= kill_at or proc.poll() is not None,
                 f"{kill_at} of {total} segment records", timeout=900, interval=0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(lines(tmp, "killed")) == 1, "the engine finished before the kill: nothing was in flight"

    fsck = kvj_cli("fsck", "-j", journal)
    assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr
    rec = kvj_cli("recover", "-j", journal, "--json")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    manifest_path = sorted(glob.glob(os.path.join(journal, "recovery", "manifest-*.json")))[-1]
    with open(manifest_path) as f:
        manifest = json.load(f)
    in_flight = manifest["requests"]
    assert in_flight, "nothing was in flight at the kill"

    # Bit rot after recovery: one block the resume will load is damaged on disk.
    longest = max(in_flight, key=lambda r: len(r["segments"]))
    victim = longest["segments"][-1] if longest["segments"] else None
    if victim is not None:
        path = os.path.join(journal, "segments", "objects", victim["key"][:2], victim["key"] + ".kvjseg")
        data = bytearray(open(path, "rb").read())
        data[len(data) // 3] ^= 0x40
        with open(path, "wb") as f:
            f.write(data)

    resumed = run_engine(tmp, "resumed", models["main"], [{"resume": manifest_path}], journal)[0]["requests"]
    assert len(resumed) == len(in_flight)
    by_prompt = {tuple(p): r for p, r in zip(batch, ref)}
    for r in resumed:
        want = by_prompt[tuple(r["prompt"])]
        assert r["all_token_ids"] == want["token_ids"], f"request {r['id']}: resumed output differs"
        if "token_ids" in r:  # the part generated after the restart, with its logprobs
            same(r, want, f"request {r['id']}", offset=r["resumed_at"])
        mid_prefill = r["durable_tokens"] < len(r["prompt"])
        print(f"request {r['id']}: prompt {len(r['prompt'])}, durable {r['durable_tokens']} tokens"
              f"{' (killed mid-prefill)' if mid_prefill else ''}, {r['resumed_at']} generated tokens from the "
              f"journal, KV restored {r.get('restored', 0)} / recomputed {r.get('recomputed', 0)} tokens")
        prompt_len = len(r["prompt"]) + r["resumed_at"]
        if "token_ids" in r:
            # Only what follows the last usable durable block is computed again.
            assert r["recomputed"] <= prompt_len - (r["durable_tokens"] // BLOCK) * BLOCK + BLOCK * (victim is not None)

    loaded = glob.glob(os.path.join(tmp, "resumed-rec", "loaded-*.npy"))
    for path in loaded:
        computed = path.replace("resumed-rec", "ref-rec").replace("loaded-", "saved-")
        assert np.array_equal(np.load(path), np.load(computed)), f"loaded KV differs from computed: {path}"
    counts = stats(tmp, "resumed")
    print(f"blocks loaded {counts['blocks_loaded']}, failed verification {counts['blocks_failed']}")
    assert counts["blocks_loaded"] == len(loaded)
    if victim is not None:
        assert counts["blocks_failed"] >= 1, "the damaged block was not detected"
        assert not os.path.exists(os.path.join(tmp, "resumed-rec", f"loaded-{victim['layout']['chain']}.npy"))

    # Resumed requests are done: nothing is left in flight.
    state = kvj.replay(journal)
    assert not state.in_flight(), [r.id for r in state.in_flight()]


def test_restart_prefix_reuse_and_wrong_model(models: Dict[str, str], tmp_path: Any) -> None:
    tmp = str(tmp_path)
    ps = prompts(7)
    journal = os.path.join(tmp, "journal")
    first = run_engine(tmp, "first", models["main"],
                       [{"generate": [ps["P1"]], "max_tokens": 8}, {"generate": [ps["Q"]], "max_tokens": 16}],
                       journal)
    cold_q = first[1]["requests"][0]

    # A second engine process: only Q's 30 tokens after the shared 64 are computed.
    second = run_engine(tmp, "second", models["main"], [{"generate": [ps["Q"]], "max_tokens": 16}], journal)
    q = second[0]["requests"][0]
    assert q["cached"] == 64 and stats(tmp, "second")["blocks_loaded"] == 2
    same(q, cold_q, "Q after a restart")

    # Other weights, or another dtype: the blocks are never loaded.
    other = run_engine(tmp, "other", models["other"], [{"generate": [ps["Q"]], "max_tokens": 16}], journal)
    assert other[0]["requests"][0]["cached"] == 0 and stats(tmp, "other")["blocks_loaded"] == 0
    fp32 = run_engine(tmp, "fp32", models["main"], [{"generate": [ps["Q"]], "max_tokens": 16}], journal,
                      dtype="float32")
    assert fp32[0]["requests"][0]["cached"] == 0 and stats(tmp, "fp32")["blocks_loaded"] == 0
