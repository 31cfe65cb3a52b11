"""A real vLLM engine at tensor-parallel size 2 (CPU backend, two worker processes) journals
through KvjConnector, one journal per rank, is SIGKILLed at a random (printed) point, and
resumes in a fresh TP=2 engine: fsck per rank, ``kvj recover -j JOURNAL`` over both ranks,
``resume``; outputs equal an uninterrupted TP=2 run's, tokens and float32 logprobs, and the KV
each rank loaded equals the KV that rank computed. Two shards go wrong on one rank only: rank 1
of the killed engine never saves block 1 of any request (a hook: rank 0 has made it durable,
rank 1 has not), and after recovery one block of rank 1's store is damaged on disk; both count
as not durable, are recomputed on both ranks, and the outputs are still identical. A TP=1
engine refuses the TP=2 journal.

Kept small (the machine has two cores): the tiny model, three requests, 40 new tokens each.
Still four TP=2 and TP=1 engines, about a quarter of the fast suite's time on two cores: it
runs with ``-m slow``; CI's fast subset for parallelism is ``test_vllm_ranks.py`` (vLLM's real
TP/PP configuration, no engine) and ``tests/ops/test_recover_ranks.py``.
``KVJ_VLLM_SEED=N`` replays a kill point.
"""

from __future__ import annotations

import glob
import json
import os
import random
from typing import Any, Dict, List

import numpy as np
import pytest

from support.damage import flip_a_bit
from support.vllm_e2e import (BLOCK, journal_state, kill_when, kvj_cli, lines, make_model, matched_tokens,
                              run_engine, same, scheduler_connector, start_engine)

import kvj
from kvj.errors import KvjError

TP = 2
MAX_NEW = 40
PACE = 0.05
RANKS = [f"rank-{t}-0" for t in range(TP)]
#: The killed engine's rank 1 never saves block 1 of any request (support.vllm_record).
DROP = {"rank": 1, "block": 1}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def seed() -> int:
    seed = int(os.environ.get("KVJ_VLLM_SEED") or random.SystemRandom().randrange(1 << 20))
    print(f"KVJ_VLLM_SEED={seed}")
    return seed


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(str(tmp_path_factory.mktemp("model")), 0)


def batch_of(seed: int) -> List[List[int]]:
    """Prompts ending a little below a block boundary: blocks holding generated tokens fill soon."""
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(n)] for n in (60, 90, 40)]


def rank_durable(journal: str, rank: str, batch: List[List[int]]) -> Dict[int, int]:
    """Prompt index -> tokens covered by the blocks durable in one rank's journal."""
    path = os.path.join(journal, rank)
    state = journal_state(path) if os.path.isdir(path) else None
    covered: Dict[int, int] = {}
    for req in state.in_flight() if state is not None else ():
        prompt = (req.tokens or [])[:req.meta.get("prompt_len", 0)]
        if prompt in batch:
            covered[batch.index(prompt)] = len(req.segments) * BLOCK
    return covered


def rank_stats(tmp: str, name: str) -> Dict[int, Dict[str, int]]:
    """Rank -> the worker's counters (the last a worker process wrote; one process per rank)."""
    out: Dict[int, Dict[str, int]] = {}
    for path in glob.glob(os.path.join(tmp, f"{name}-rec", "stats-r*-*.json")):
        rank = int(os.path.basename(path).split("-")[1][1:])
        with open(path) as f:
            for k, v in json.load(f).items():
                out.setdefault(rank, {})[k] = out.get(rank, {}).get(k, 0) + v
    return out


@pytest.fixture(scope="module")
def runs(model: str, seed: int, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    batch = batch_of(seed)
    jobs = [{"generate": batch, "max_tokens": MAX_NEW}]
    ref_tmp = str(tmp_path_factory.mktemp("tp-reference"))
    ref = run_engine(ref_tmp, "ref", model, jobs, os.path.join(ref_tmp, "journal"), tp=TP)[0]["requests"]

    tmp = str(tmp_path_factory.mktemp("tp-crashed"))
    journal = os.path.join(tmp, "journal")
    rng = random.Random(seed)
    extra = rng.randint(0, 2)  # blocks more, on both ranks, after the first holding generated tokens
    print(f"kill once rank 0 made a block holding generated tokens durable (and rank 1 block 0 of each "
          f"request), then {extra} more")
    seen: Dict[str, int] = {}

    def ready() -> bool:
        covered = rank_durable(journal, RANKS[0], batch)
        if not any(n > len(batch[i]) for i, n in covered.items()):
            return False
        rank1 = rank_durable(journal, RANKS[1], batch)  # block 0 of every request: one is damaged later
        if not all(rank1.get(i, 0) >= BLOCK for i in range(len(batch))):
            return False
        total = sum(covered.values())
        seen.setdefault("first", total)
        return total >= seen["first"] + extra * BLOCK

    kill_when(start_engine(tmp, "killed", model, jobs, journal, pace=PACE, tp=TP, drop=DROP), ready,
              "a block holding generated tokens durable on rank 0")
    assert len(lines(tmp, "killed")) == 1, "the batch finished before the kill"

    fsck_parent = kvj_cli("fsck", "-j", journal)
    fscks = [kvj_cli("fsck", "-j", os.path.join(journal, rank)) for rank in RANKS]
    recovered = kvj_cli("recover", "-j", journal, "--json")
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    manifest_path = json.loads(recovered.stdout)["manifest_path"]
    with open(manifest_path) as f:
        manifest = json.load(f)

    # Bit rot after recovery, on one rank: rank 1's copy of block 0 of a request it holds it for.
    victim = next(r for r in manifest["requests"] if r["ranks"]["rank-1-0"]["resume_position"] >= BLOCK)
    with open(manifest["ranks"]["rank-1-0"]["manifest_path"]) as f:
        rank1 = {r["id"]: r for r in json.load(f)["requests"]}
    key = next(s["key"] for s in rank1[victim["id"]]["segments"] if s["seg"] == 0)
    flip_a_bit(os.path.join(journal, "rank-1-0", "segments"), key)

    resumed = run_engine(tmp, "resumed", model, [{"resume": manifest_path}], journal, tp=TP)[0]["requests"]
    return {"batch": batch, "ref": ref, "ref_tmp": ref_tmp, "tmp": tmp, "journal": journal, "manifest": manifest,
            "resumed": resumed, "fsck_parent": fsck_parent, "fscks": fscks, "victim": victim["id"]}


def test_tp2_sigkill_fsck_recover_resume_equals_an_uninterrupted_tp2_run(runs: Dict[str, Any]) -> None:
    batch, ref, manifest = runs["batch"], runs["ref"], runs["manifest"]
    for rank, fsck in zip(RANKS, runs["fscks"]):
        assert fsck.returncode in (0, 1), f"{rank}: {fsck.stdout}{fsck.stderr}"
    # The directory of rank journals is not one journal: fsck says which to give it, in one line.
    parent = runs["fsck_parent"]
    assert parent.returncode == 8 and "rank-0-0" in parent.stderr and "Traceback" not in parent.stderr, parent.stderr

    # One manifest for the engine: every request resumes at the minimum over the ranks.
    assert sorted(manifest["ranks"]) == RANKS
    in_flight = [r for r in manifest["requests"] if r["tokens"] in batch]
    assert sorted(batch.index(r["tokens"]) for r in in_flight) == list(range(len(batch)))
    for r in in_flight:
        assert r["resume_position"] == min(v["resume_position"] for v in r["ranks"].values())
        # rank 1 never saved block 1: its position stops at block 0 (a later block follows a gap)
        assert r["ranks"]["rank-1-0"]["resume_position"] <= BLOCK
    lagging = [r for r in in_flight if r["ranks"]["rank-0-0"]["resume_position"] > BLOCK]
    assert lagging, "rank 0 had made no block 1 durable (that rank 1 had not)"
    assert any(r["output"] for r in in_flight), "no request was mid-decode"

    resumed = runs["resumed"]
    assert len(resumed) == len(manifest["requests"])
    for r in resumed:
        want = ref[batch.index(r["prompt"])]
        assert r["all_token_ids"] == want["token_ids"], f"request {r['id']}: resumed output differs"
        if "token_ids" in r:
            same(r, want, f"request {r['id']}", offset=r["resumed_at"])
        print(f"request {r['id']}: prompt {len(r['prompt'])}, durable on both ranks {r['durable_tokens']}, "
              f"{r['resumed_at']} generated tokens from the journal, restored {r.get('restored', 0)} / recomputed "
              f"{r.get('recomputed', 0)} tokens")
        if "token_ids" in r:
            # Block 0 loaded from both ranks where both hold it; block 1 (rank 0's only) recomputed,
            # and so is everything of the request whose block 0 is damaged on rank 1.
            want = 0 if r["id"] == runs["victim"] else min(r["durable_tokens"], BLOCK)
            assert r["restored"] == want, f"request {r['id']}: restored {r['restored']}, not {want}"

    # Each rank loaded its own shards, from its own journal, equal to what that rank computed.
    counts = rank_stats(runs["tmp"], "resumed")
    print("blocks loaded per rank:", {rank: c.get("blocks_loaded", 0) for rank, c in sorted(counts.items())})
    assert sorted(counts) == list(range(TP))
    assert all(counts[rank]["blocks_loaded"] > 0 for rank in counts), "KV not restored from both ranks"
    assert counts[0]["blocks_failed"] == 0 and counts[1]["blocks_failed"] >= 1, "the damaged shard went undetected"
    compared = set()
    for path in glob.glob(os.path.join(runs["tmp"], "resumed-rec", "loaded-*.npy")):
        name = os.path.basename(path)
        computed = os.path.join(runs["ref_tmp"], "ref-rec", name.replace("loaded-", "saved-"))
        if os.path.exists(computed):  # (the uninterrupted engine's last step may not have come)
            got = np.load(path)
            assert got.size == 2 * 1 * BLOCK * 2 * 32 * 4, f"{name} is not one rank's shard (1 of 2 KV heads)"
            assert np.array_equal(got, np.load(computed)), f"{name}: loaded KV differs from that rank's computed KV"
            compared.add(name.rsplit(".r", 1)[1])
    assert compared == {f"{rank}.npy" for rank in range(TP)}, compared

    for rank in RANKS:  # every rank ended every resumed request, after its segments
        assert not kvj.replay(os.path.join(runs["journal"], rank)).in_flight(), rank


def test_a_tp1_engine_refuses_the_tp2_journal_naming_why(model: str, runs: Dict[str, Any]) -> None:
    """Its blocks are shards (one KV head of two): a TP=1 engine must not load them. It refuses
    the directory at start-up, in one line; and pointed at one rank's journal it matches nothing
    (the chain seed holds the parallel size)."""
    with pytest.raises(KvjError) as refused:
        scheduler_connector(model, runs["journal"])
    assert "tensor/pipeline parallel size 2/1" in str(refused.value) and "\n" not in str(refused.value)
    rank0 = os.path.join(runs["journal"], RANKS[0])
    prompt = runs["batch"][1]
    assert matched_tokens(scheduler_connector(model, rank0), prompt) == 0
