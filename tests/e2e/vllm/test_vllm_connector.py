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
import types
from typing import Any, Dict, List

import numpy as np
import pytest

import kvj
from support.damage import flip_a_bit
from support.vllm_e2e import (BLOCK, PACE, SEEDED, journal_state, kill_when, kvj_cli, lines, make_model, matched_tokens,
                              run_engine, same, scheduler_connector, start_engine)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"main": make_model(str(root / "main"), 0), "other": make_model(str(root / "other"), 1)}


def prompts(seed: int) -> Dict[str, List[int]]:
    """A batch (S0, P0..P3) whose short requests decode while the long one is still in prefill, and
    R/Q for prefix reuse: Q shares R's first 64 tokens and nothing with the batch. S0 is sampled
    (temperature 1, seeded), the others greedy."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1024) for _ in range(n)]  # noqa: E731
    # Prompt ends just below a block boundary: a block holding generated tokens fills after a few steps.
    p0, p1, p3, r = ids(60), ids(90), ids(200), ids(90)
    return {"S0": ids(8), "P0": p0, "P1": p1, "P2": p0[:32] + ids(92), "P3": p3, "R": r, "Q": r[:64] + ids(30)}


def stats(tmp: str, name: str) -> Dict[str, int]:
    total = {"blocks_loaded": 0, "blocks_failed": 0}
    for path in glob.glob(os.path.join(tmp, f"{name}-rec", "stats-*.json")):
        with open(path) as f:
            for k, v in json.load(f).items():
                total[k] = total.get(k, 0) + v
    return total


def durable_tokens(journal: str, prompts: List[List[int]]) -> Dict[int, int]:
    """Prompt index -> most tokens the journaled blocks of a request in flight cover for it (a
    resumed request carries its original prompt's tokens too)."""
    state = journal_state(journal)
    covered: Dict[int, int] = {}
    for r in state.in_flight() if state is not None else ():
        prompt = (r.tokens or [])[:r.meta.get("prompt_len", 0)]
        if prompt in prompts:
            i = prompts.index(prompt)
            covered[i] = max(covered.get(i, 0), len(r.segments) * BLOCK)
    return covered


def recover(journal: str) -> str:
    """``kvj fsck`` then ``kvj recover``; the manifest's path."""
    fsck = kvj_cli("fsck", "-j", journal)
    assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr
    rec = kvj_cli("recover", "-j", journal, "--json")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    return sorted(glob.glob(os.path.join(journal, "recovery", "manifest-*.json")))[-1]


def check_resumed(resumed: List[Dict[str, Any]], batch: List[List[int]], ref: List[Dict[str, Any]]) -> None:
    """Every resumed request's whole output is the uninterrupted run's; logprobs of the tokens generated now."""
    for r in resumed:
        want = ref[batch.index(r["prompt"])]
        assert r["all_token_ids"] == want["token_ids"], f"request {r['id']}: resumed output differs"
        if "token_ids" in r:
            same(r, want, f"request {r['id']}", offset=r["resumed_at"])


def check_loaded_kv(tmp: str, name: str, ref_tmp: str) -> List[str]:
    """Every block the engine loaded equals, bit for bit, the block the reference engine computed."""
    loaded = glob.glob(os.path.join(tmp, f"{name}-rec", "loaded-*.npy"))
    for path in loaded:
        computed = os.path.join(ref_tmp, "ref-rec", os.path.basename(path).replace("loaded-", "saved-"))
        assert np.array_equal(np.load(path), np.load(computed)), f"loaded KV differs from computed: {path}"
    return loaded


MAX_NEW = 64
def batch_of(ps: Dict[str, List[int]]) -> List[List[int]]:
    return [ps["S0"], ps["P0"], ps["P1"], ps["P2"], ps["P3"]]


def jobs_of(ps: Dict[str, List[int]]) -> List[Dict[str, Any]]:
    """What the reference and the killed engine run: R, then Q (sharing R's prefix), then the batch."""
    return [{"generate": [ps["R"]], "max_tokens": 8}, {"generate": [ps["Q"]], "max_tokens": 16},
            {"generate": batch_of(ps), "max_tokens": MAX_NEW, "sampling": [SEEDED, None, None, None, None]}]


@pytest.fixture(scope="module")
def seed() -> int:
    seed = int(os.environ.get("KVJ_VLLM_SEED") or random.SystemRandom().randrange(1 << 20))
    print(f"KVJ_VLLM_SEED={seed}")
    return seed


@pytest.fixture(scope="module")
def reference(models: Dict[str, str], seed: int, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """An uninterrupted engine: its outputs, and (recorded) every block's KV it computed."""
    tmp = str(tmp_path_factory.mktemp("reference"))
    ps = prompts(seed)
    # In process (engine core and worker in one process: no step follows the last finishes,
    # and at exit the worker journals what the scheduler side still held for it).
    out = run_engine(tmp, "ref", models["main"], jobs_of(ps), os.path.join(tmp, "journal"), in_process=True)
    return {"tmp": tmp, "prompts": ps, "Q": out[1]["requests"][0], "batch": out[2]["requests"],
            "journal": os.path.join(tmp, "journal")}


@pytest.fixture(scope="module")
def crashed(models: Dict[str, str], seed: int, reference: Dict[str, Any],
            tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The same jobs, SIGKILLed mid-batch (short requests mid-decode, the long one mid-prefill);
    fsck, recover, a damaged block; then a fresh engine serves Q (prefix reuse) and resumes."""
    tmp = str(tmp_path_factory.mktemp("crashed"))
    ps = reference["prompts"]
    batch = batch_of(ps)
    rng = random.Random(seed)
    journal = os.path.join(tmp, "journal")
    extra = rng.randint(0, 1)  # more segment records after the first block holding generated tokens
    seen: Dict[str, int] = {}

    def mixed() -> bool:
        covered = durable_tokens(journal, batch)
        if not any(n > len(batch[i]) for i, n in covered.items()):
            return False
        total = sum(covered.values())
        seen.setdefault("first", total)
        return total >= seen["first"] + extra * BLOCK or covered.get(4, 0) + 3 * BLOCK > len(batch[4])

    proc = start_engine(tmp, "killed", models["main"], jobs_of(ps), journal, pace=PACE)
    kill_when(proc, mixed, "a journaled block holding generated tokens")
    assert len(lines(tmp, "killed")) == 3, "the kill did not land in the batch"
    manifest_path = recover(journal)
    with open(manifest_path) as f:
        manifest = json.load(f)

    # Bit rot after recovery: one block the resume will load is damaged on disk.
    longest = max(manifest["requests"], key=lambda r: len(r["segments"]))
    victim = longest["segments"][-1] if longest["segments"] else None
    if victim is not None:
        flip_a_bit(os.path.join(journal, "segments"), victim["key"])

    out = run_engine(tmp, "resumed", models["main"],
                     [{"generate": [ps["Q"]], "max_tokens": 16}, {"resume": manifest_path}], journal)
    return {"tmp": tmp, "journal": journal, "manifest": manifest, "victim": victim, "victim_request": longest["id"],
            "Q": out[0]["requests"][0],
            "resumed": out[1]["requests"]}


def test_sigkill_mid_decode_and_mid_prefill_then_fsck_recover_resume(reference: Dict[str, Any],
                                                                     crashed: Dict[str, Any]) -> None:
    batch = batch_of(reference["prompts"])
    in_flight = [r for r in crashed["manifest"]["requests"] if r["tokens"] in batch]
    # START is journaled on arrival: every request vLLM had accepted is in the manifest.
    assert sorted(batch.index(r["tokens"]) for r in in_flight) == list(range(len(batch)))
    phase = {batch.index(r["tokens"]): r["resume_position"] for r in in_flight}
    assert any(n > len(batch[i]) for i, n in phase.items()), f"no request was mid-decode: {phase}"
    # The journal knows whole blocks only: mid-prefill here means part of the prompt is not durable.
    assert any(n < len(batch[i]) for i, n in phase.items()), f"no request was mid-prefill: {phase}"

    resumed = crashed["resumed"]
    assert len(resumed) == len(crashed["manifest"]["requests"])
    check_resumed(resumed, batch, reference["batch"])
    victim = crashed["victim"]
    assert victim is not None, "no durable block to damage"
    assert any(r["prompt"] == batch[0] and "token_ids" in r for r in resumed), "the seeded request was not resumed"
    for r in resumed:
        prompt_len = len(r["prompt"]) + r["resumed_at"]
        state = "mid-prefill" if r["durable_tokens"] < len(r["prompt"]) else "mid-decode"
        print(f"request {r['id']}: prompt {len(r['prompt'])}, durable {r['durable_tokens']} tokens ({state}), "
              f"{r['resumed_at']} generated tokens from the journal, KV restored {r.get('restored', 0)} / "
              f"recomputed {r.get('recomputed', 0)} tokens")
        if "token_ids" in r:
            # Only what follows the last usable durable block is computed again, and the KV of
            # every durable block before it was loaded (counted by the connector, not vLLM).
            damaged = r["id"] == crashed["victim_request"]
            assert r["recomputed"] <= prompt_len - (r["durable_tokens"] // BLOCK) * BLOCK + BLOCK * damaged
            if r["durable_tokens"] >= BLOCK and not (damaged and r["durable_tokens"] == BLOCK):
                assert r["restored"] > 0, f"request {r['id']}: nothing restored from {r['durable_tokens']} durable"

    loaded = check_loaded_kv(crashed["tmp"], "resumed", reference["tmp"])
    counts = stats(crashed["tmp"], "resumed")
    print(f"blocks loaded {counts['blocks_loaded']}, failed verification {counts['blocks_failed']}")
    assert 0 < len(loaded) <= counts["blocks_loaded"]  # one file per chain: two requests may load one block
    assert counts["blocks_failed"] >= 1, "the damaged block was not detected"
    assert not os.path.exists(os.path.join(crashed["tmp"], "resumed-rec", f"loaded-{victim['layout']['chain']}.r0.npy"))

    # Resumed requests are done: nothing is left in flight.
    state = kvj.replay(crashed["journal"])
    assert not state.in_flight(), [r.id for r in state.in_flight()]


def test_an_engine_that_finished_leaves_nothing_in_flight(reference: Dict[str, Any]) -> None:
    """The in-process reference engine exited after its last generate: every request it finished
    ended in the journal, after all its tokens (the last finishes never reached a step)."""
    state = kvj.replay(reference["journal"])
    outputs = [reference["Q"], *reference["batch"]]
    assert len(state.requests) == len(outputs) + 1 and not state.in_flight(), [r.id for r in state.in_flight()]
    for r in state.requests.values():
        if r.tokens in batch_of(reference["prompts"]):
            want = reference["batch"][batch_of(reference["prompts"]).index(r.tokens)]["token_ids"]
            assert r.output == want, f"request {r.id}: journaled tokens differ from its output"


def test_restart_prefix_reuse(reference: Dict[str, Any], crashed: Dict[str, Any]) -> None:
    """A fresh engine process computes only Q's 30 tokens after the 64 it shares with R."""
    q = crashed["Q"]
    assert q["cached"] == 64
    same(q, reference["Q"], "Q after a restart")
    state = kvj.replay(crashed["journal"])
    first_q = min((r for r in state.requests.values() if r.tokens == reference["prompts"]["Q"]),
                  key=lambda r: r.start_lsn)  # the killed engine's
    chains = [first_q.segments[b].layout["chain"] for b in (0, 1)]
    for chain in chains:  # loaded from kvj, and equal to what the reference computed
        assert os.path.exists(os.path.join(crashed["tmp"], "resumed-rec", f"loaded-{chain}.r0.npy"))
    check_loaded_kv(crashed["tmp"], "resumed", reference["tmp"])


def test_other_weights_or_dtype_never_match(models: Dict[str, str], reference: Dict[str, Any]) -> None:
    """The blocks the reference engine journaled match its own model only (the engine loads only
    what its scheduler-side connector matches; the worker checks the layout again on load)."""
    q, journal = reference["prompts"]["Q"], reference["journal"]
    assert matched_tokens(scheduler_connector(models["main"], journal), q) == 64
    assert matched_tokens(scheduler_connector(models["other"], journal), q) == 0
    assert matched_tokens(scheduler_connector(models["main"], journal, "bfloat16"), q) == 0


def test_journaled_stop_tokens_are_those_vllm_stops_on(models: Dict[str, str], tmp_path: Any) -> None:
    """A request with ignore_eos does not stop on EOS, so its EOS is not a stop token in the
    journal (resume would otherwise end it early, at an EOS it generated, unlike an
    uninterrupted run); explicit stop_token_ids are, and so is EOS for other requests."""
    from vllm import SamplingParams

    connector = scheduler_connector(models["main"], str(tmp_path / "journal"))
    for ignore_eos, want in ((False, [2, 5]), (True, [5])):
        params = SamplingParams(max_tokens=8, ignore_eos=ignore_eos, stop_token_ids=[5])
        params.update_from_generation_config({}, eos_token_id=2)
        assert 2 in params.all_stop_token_ids  # what the journal held before
        request = types.SimpleNamespace(request_id=f"r{ignore_eos}", prompt_token_ids=[1, 2, 3],
                                        sampling_params=params, all_token_ids=[1, 2, 3], num_tokens=3)
        connector.on_new_request(request)
        side = connector.scheduler
        assert side._start(side._requests[request.request_id]).meta["stop_ids"] == want


@pytest.mark.slow
def test_many_kills_each_resume_killed_again(models: Dict[str, str], seed: int, reference: Dict[str, Any],
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """The batch is killed, recovered and resumed again and again (each resumed engine killed at a
    seeded point) until it completes. At every kill the journaled tokens are the uninterrupted
    run's; the last resume's outputs equal it, token for token and logprob for logprob. In float32:
    vLLM 0.32's CPU worker dies of SIGILL (exit -4, in its bfloat16 attention kernel) on the first
    step of an engine resumed with loaded blocks, on this machine's CPU, every time."""
    from kvj.integrations.vllm import resume_plans

    tmp = str(tmp_path_factory.mktemp("many-kills"))
    batch = batch_of(reference["prompts"])
    f32 = run_engine(tmp, "ref", models["main"], [{"generate": batch, "max_tokens": MAX_NEW}],
                     os.path.join(tmp, "ref-journal"), dtype="float32")[0]["requests"]
    rng = random.Random(seed + 1)
    journal = os.path.join(tmp, "journal")
    jobs: List[Dict[str, Any]] = [{"generate": batch, "max_tokens": MAX_NEW}]
    kills = 0
    for attempt in range(12):
        name = f"run{attempt}"
        # Kill once the requests in flight have journaled a few more blocks (the first time, once
        # all of them have started).
        at = sum(durable_tokens(journal, batch).values()) + rng.randint(2, 4) * BLOCK
        started = 1 if attempt else len(batch)

        def progressed() -> bool:
            covered = durable_tokens(journal, batch)
            return len(covered) >= started and sum(covered.values()) >= at

        kill_when(start_engine(tmp, name, models["main"], jobs, journal, pace=PACE, dtype="float32"), progressed,
                  f"{at} durable tokens")
        if len(lines(tmp, name)) == 2:  # it finished before the kill
            break
        kills += 1
        manifest = recover(journal)
        for plan in resume_plans(manifest):
            want = f32[batch.index(plan.prompt)]["token_ids"]
            assert plan.generated == want[:len(plan.generated)], f"kill {kills}: journaled tokens differ"
        print(f"kill {kills} at {at} durable tokens: {len(resume_plans(manifest))} requests in flight")
        jobs = [{"resume": manifest}]
    assert kills >= 3, f"only {kills} kills landed before the batch completed"
    final = lines(tmp, name)[1]["requests"]
    if kills:
        check_resumed(final, batch, f32)
    assert not kvj.replay(journal).in_flight()
