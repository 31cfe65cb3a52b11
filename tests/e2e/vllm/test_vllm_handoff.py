"""Live handoff: engine A (a real vLLM engine on the CPU backend) is drained mid-batch and a
second engine B, another process with a journal of its own, continues A's requests, read-only,
from A's journal replicated to object storage (moto) and restored onto B's disk while A's disk
is gone; another model on B loads nothing and says why; an engine killed mid-drain hands each
request to exactly one of its own recovery and the target, which reads it by path.

Engines run in child processes (``support.vllm_engine``), as in ``test_vllm_connector``: the
uninterrupted reference and A run side by side, then B and the other-model engine C; every
comparison is of tokens and float32 logprobs. Prompts come from a printed seed
(``KVJ_VLLM_SEED=N`` replays one).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import shutil
import signal
from typing import Any, Dict, List

import pytest

import kvj
from kvj.integrations.vllm.resuming import resume_plans
from kvj.ops.handoff import write_manifest
from support.s3 import MotoEndpoint, s3_env
from support.wait import wait_for
from support.vllm_e2e import (BLOCK, ENGINE, PACE, SEEDED, journal_state, kvj_cli, lines, make_model, same,
                              start_engine)

MAX_NEW = 48


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"main": make_model(str(root / "main"), 0), "other": make_model(str(root / "other"), 1)}


@pytest.fixture(scope="module")
def seed() -> int:
    seed = int(os.environ.get("KVJ_VLLM_SEED") or random.SystemRandom().randrange(1 << 20))
    print(f"KVJ_VLLM_SEED={seed}")
    return seed


def batch(seed: int) -> List[List[int]]:
    """Three short requests (S0 seeded, the others greedy) that decode first, and a long one
    (added late) that is still in prefill when A is drained."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1024) for _ in range(n)]  # noqa: E731
    return [ids(8), ids(60), ids(90), ids(440)]


def sampling() -> List[Any]:
    return [SEEDED, None, None, None]


def finish(procs: Dict[str, subprocess.Popen], tmp: str) -> Dict[str, List[Dict[str, Any]]]:
    """Wait for every engine; their job results (each must exit 0)."""
    out = {}
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        with open(os.path.join(tmp, f"{name}.log")) as f:
            assert rc == 0, f"engine {name} exited {rc}:\n{f.read()[-6000:]}"
        out[name] = lines(tmp, name)[1:]
    return out


def tree(path: str) -> Dict[str, Any]:
    """Every file under ``path`` with its size and mtime: what "nothing written there" compares."""
    found = {}
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            found[os.path.relpath(os.path.join(root, name), path)] = (st.st_size, st.st_mtime_ns)
    return found


def moved_some(journal: str) -> bool:
    state = journal_state(journal)
    return state is not None and any(r.status == "handoff" for r in state.requests.values())


@pytest.fixture(scope="module")
def handoff(models: Dict[str, str], seed: int, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The reference, A (drained to B) and K (drained, SIGKILLed once a first request is journaled
    as moved) side by side; then B and C (another model) continue A's requests, K' (a fresh
    engine on K's journal) resumes what ``kvj recover`` finds in flight there and L (another
    engine) continues the requests K had journaled as moved."""
    tmp = str(tmp_path_factory.mktemp("handoff"))
    ps = batch(seed)
    ja, jk = os.path.join(tmp, "journal-a"), os.path.join(tmp, "journal-k")
    settings = {**ENGINE, "max_model_len": 640}
    drain = {"drain": ps[:3], "late": ps[3], "at": 40, "after": 2, "to": "b", "max_tokens": MAX_NEW,
             "sampling": sampling()}
    ref = start_engine(tmp, "ref", models["main"], [{"generate": ps, "max_tokens": MAX_NEW, "sampling": sampling()}],
                       os.path.join(tmp, "journal-ref"), in_process=True, **settings)
    # In process: the engine core steps when the job does, so no request finishes before the drain.
    a = start_engine(tmp, "a", models["main"], [drain], ja, pace=PACE * 4, in_process=True, **settings)
    k = start_engine(tmp, "k", models["main"], [drain], jk, pace=PACE * 4, in_process=True, **settings)
    try:
        wait_for(lambda: k.poll() is not None or moved_some(jk), "a request journaled as moved", timeout=900,
                 interval=0.01)
    finally:
        os.killpg(k.pid, signal.SIGKILL)
        k.wait()
    first = finish({"ref": ref, "a": a}, tmp)
    with open(first["a"][0]["manifest"]) as f:
        plans = resume_plans(json.load(f))
    # Across nodes: A's journal goes to object storage (``kvj replicate``) and comes back on B's
    # disk (``kvj restore``) with the manifest; A's disk is gone while B and C run.
    s3 = MotoEndpoint()
    try:
        url = f"s3://{s3.new_bucket()}/a"
        for args in (("replicate", "-j", ja, "--to", url), ("restore", "--from", url, "-j", os.path.join(tmp, "node-b", "a"))):
            done = kvj_cli(*args, env=s3_env(s3.url))
            assert done.returncode == 0, f"kvj {args[0]}: {done.stderr}"
    finally:
        s3.stop()
    restored = os.path.join(tmp, "node-b", "a")
    manifest = shutil.copy(first["a"][0]["manifest"], os.path.join(tmp, "node-b", "manifest-b.json"))
    a_files, restored_files = tree(ja), tree(restored)
    os.rename(ja, ja + ".gone")
    killed = kvj.replay(jk)
    rec = kvj_cli("recover", "-j", jk, "--json")
    assert rec.returncode == 0, rec.stderr
    recovered = json.loads(rec.stdout)["manifest_path"]
    moved_manifest, _ = write_manifest(jk, "b")  # what kvj handoff writes once every move is durable
    procs = {
        "b": start_engine(tmp, "b", models["main"], [{"resume": manifest}], os.path.join(tmp, "journal-b"),
                          sources=[restored], in_process=True, **settings),
        "c": start_engine(tmp, "c", models["other"], [{"resume": manifest}], os.path.join(tmp, "journal-c"),
                          sources=[restored], in_process=True, **settings),
        "k2": start_engine(tmp, "k2", models["main"], [{"resume": recovered}], jk, in_process=True, **settings),
        "l": start_engine(tmp, "l", models["main"], [{"resume": moved_manifest}], os.path.join(tmp, "journal-l"),
                          sources=[jk], in_process=True, **settings)}
    try:
        second = finish(procs, tmp)
    finally:
        os.rename(ja + ".gone", ja)
    return {"tmp": tmp, "prompts": ps, "ref": first["ref"][0]["requests"], "manifest": manifest, "plans": plans,
            "ja": ja, "a_files": a_files, "restored": restored, "restored_files": restored_files, "b": second["b"][0]["requests"], "c": second["c"][0]["requests"],
            "jk": jk, "killed": killed, "k2": second["k2"][0]["requests"], "l": second["l"][0]["requests"]}


def test_drained_requests_continue_on_another_engine_as_if_uninterrupted(handoff: Dict[str, Any]) -> None:
    ps, ref = handoff["prompts"], handoff["ref"]
    plans = {tuple(p.prompt): p for p in handoff["plans"]}
    assert sorted(ps.index(list(k)) for k in plans) == [0, 1, 2, 3], "not every request was handed off"
    phases = {ps.index(list(k)): (p.durable_tokens, len(p.prompt), len(p.generated)) for k, p in plans.items()}
    print("request: (durable tokens, prompt, generated) at the handoff", phases)
    assert any(d > n for d, n, _ in phases.values()), f"no request was mid-decode with a durable block: {phases}"
    assert any(g == 0 and d < n for d, n, g in phases.values()), f"no request was mid-prefill: {phases}"
    for r in handoff["b"]:
        i = ps.index(r["prompt"])
        want = ref[i]
        assert r["all_token_ids"] == want["token_ids"], f"request {i}: output after the handoff differs"
        same(r, want, f"request {i}", offset=r["resumed_at"])
        prompt_len = len(r["prompt"]) + r["resumed_at"]
        usable = min(r["durable_tokens"], prompt_len - 1) // BLOCK * BLOCK  # vLLM computes the last token
        print(f"request {i}: prompt {len(r['prompt'])}, {r['resumed_at']} generated on A, durable {r['durable_tokens']}"
              f" tokens; on B restored {r['restored']}, reused {r['reused']}, recomputed {r['recomputed']}")
        # B computed only what follows the request's last durable block: everything before it was loaded
        # from A's store (or, for a block two requests share, found in B's own prefix cache).
        assert r["restored"] + r["reused"] == usable, f"request {i}: restored {r['restored']} of {usable}"
        assert r["recomputed"] == prompt_len - usable


def test_the_first_engine_records_the_move_and_is_never_written_by_the_second(handoff: Dict[str, Any]) -> None:
    ja = handoff["ja"]
    state = kvj.replay(ja)
    moved = [r for r in state.requests.values() if r.status == "handoff"]
    assert len(moved) == 4 and all(r.moved_to == "b" for r in moved) and not state.in_flight()
    assert tree(ja) == handoff["a_files"], "something wrote into engine A's journal or store"
    assert tree(handoff["restored"]) == handoff["restored_files"], "engine B wrote into the journal it continued from"
    rec = kvj_cli("recover", "-j", ja, "--json")  # nothing of A's is A's to resume
    assert rec.returncode == 0, rec.stderr
    assert json.loads(rec.stdout)["manifest"]["requests"] == []
    for name in ("b", "c", "k2", "l"):  # journaling never stopped (B saves loaded blocks in its own store)
        with open(os.path.join(handoff["tmp"], f"{name}.log")) as f:
            assert "journaling stopped" not in f.read(), f"engine {name}: journaling stopped"
    for name in ("b", "c", "l"):
        other = kvj.replay(os.path.join(handoff["tmp"], f"journal-{name}"))
        assert not other.in_flight() and not other.warnings, (name, other.warnings)
    b = kvj.replay(os.path.join(handoff["tmp"], "journal-b"))
    assert sorted(r.meta["resumes"] for r in b.requests.values()) == sorted(r.id for r in moved)
    assert {r.meta["from"] for r in b.requests.values()} == {ja}


def test_another_model_loads_nothing_and_says_why(handoff: Dict[str, Any]) -> None:
    assert handoff["c"] and all(r.get("restored", 0) == 0 for r in handoff["c"])
    with open(os.path.join(handoff["tmp"], "c.log")) as f:
        log = f.read()
    assert "holds KV blocks of another layout" in log and "none will load" in log


def test_killed_mid_drain_each_request_resumes_exactly_once(handoff: Dict[str, Any]) -> None:
    """A request whose handoff record is durable is the target's; one whose record is not is
    still in flight in the killed engine's journal, and its recovery resumes it."""
    killed, ps, ref = handoff["killed"], handoff["prompts"], handoff["ref"]
    moved = {r.id for r in killed.requests.values() if r.status == "handoff"}
    in_flight = {r.id for r in killed.in_flight()}
    print(f"killed mid-drain: {len(moved)} moved, {len(in_flight)} in flight, "
          f"{len(killed.requests) - len(moved) - len(in_flight)} ended otherwise")
    assert moved and len(moved | in_flight) == 4
    here = {r["id"] for r in handoff["k2"]}
    there = {r["id"] for r in handoff["l"]}
    assert here == in_flight and there == moved and not here & there
    for r in handoff["k2"] + handoff["l"]:
        assert r["all_token_ids"] == ref[ps.index(r["prompt"])]["token_ids"], f"request {r['id']} differs"
    assert not kvj.replay(handoff["jk"]).in_flight()  # resumed once: nothing left for a later recover
    again = kvj_cli("recover", "-j", handoff["jk"], "--dry-run", "--json")
    assert json.loads(again.stdout)["manifest"]["requests"] == []


def test_keys_travel_between_paths_and_not_between_layouts(models: Dict[str, str], tmp_path) -> None:
    """The chain seed names the weights by their bytes (not the directory's path): a copy of the
    model elsewhere has the same seed; another model, dtype, block size or TP size does not."""
    import shutil

    from kvj.integrations.vllm.layout import weights_digest
    from kvj.segments.kvblock import LHNC, KVBlockLayout

    copy = shutil.copytree(models["main"], str(tmp_path / "elsewhere" / "model"))
    here, there = weights_digest(models["main"], str(tmp_path / "j1")), weights_digest(copy, str(tmp_path / "j2"))
    assert here == there and here != weights_digest(models["other"], str(tmp_path / "j1"))
    base = dict(model=here, dtype="float32", layers=2, kv_heads=2, head_dim=32, block_size=BLOCK, order=LHNC)
    seed = KVBlockLayout(**base).seed()
    assert KVBlockLayout(**{**base, "tp_size": 2, "tp_rank": 0}).seed() == KVBlockLayout(
        **{**base, "tp_size": 2, "tp_rank": 1}).seed()  # rank-free: one name for all ranks' shards
    for change in ({"model": "blake3:" + "0" * 64}, {"dtype": "bfloat16"},
                   {"block_size": 2 * BLOCK}, {"tp_size": 2}):
        assert KVBlockLayout(**{**base, **change}).seed() != seed, change


def test_sources_are_checked(tmp_path) -> None:
    from kvj.errors import InvalidArgument
    from kvj.integrations.vllm.config import KvjConfig

    own = str(tmp_path / "b")
    config = KvjConfig.from_extra({"journal": own, "sources": [str(tmp_path / "a")]})
    assert config.sources == (str(tmp_path / "a"),)
    for bad in (str(tmp_path / "a"), [own], [1]):
        with pytest.raises(InvalidArgument, match="sources"):
            KvjConfig.from_extra({"journal": own, "sources": bad})
