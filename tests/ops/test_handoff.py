"""``kvj handoff`` over a journal written here (no vLLM): arming, waiting, the manifest, status,
inspect, and recovery never resuming a moved request. The engines' side: tests/e2e/vllm/test_vllm_handoff.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import kvj
from kvj.integrations.vllm.resuming import resume_plans
from kvj.ops.armed import read_control


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvj.cli.main", *args], capture_output=True, text=True)


def test_handoff_waits_for_the_moves_then_writes_a_manifest_recovery_never_resumes(tmp_path):
    path = str(tmp_path / "j")
    meta = {"format": "kvj-vllm-request/1", "prompt_len": 3, "max_tokens": 8, "sampling": {}, "stop_ids": []}
    with kvj.Journal.open(path) as j:
        j.start("r-1", None, [1, 2, 3], meta)
        j.tokens("r-1", 3, [4, 5])
        j.flush("r-1", 0, torch.ones(4, 4), token_range=(0, 4), layout={"token_ids": [1, 2, 3, 4, 5]}).result()
        j.start("r-2", None, [7], meta)
        j.sync()
    early = cli("handoff", "-j", path, "--to", "b", "--timeout", "0")
    assert early.returncode == 75 and "2 request(s) still in flight" in early.stderr and not early.stdout
    assert read_control(path)["state"] == "armed"
    shown = cli("status", "-j", path, "--json")
    assert json.loads(shown.stdout)["handoff"]["state"] == "armed"
    with kvj.Journal.open(path) as j:  # what the connector does once the engine aborts them
        j.handoff("r-1", "b")
    # killed here: r-1's record is durable (the target's to resume), r-2's is not (still this engine's)
    mid = cli("recover", "-j", path, "--dry-run", "--json")
    assert [r["id"] for r in json.loads(mid.stdout)["manifest"]["requests"]] == ["r-2"]
    with kvj.Journal.open(path) as j:
        j.end("r-2", "ok")
    done = cli("handoff", "-j", path, "--to", "b", "--json")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["requests"] == ["r-1"]
    with open(reply["manifest_path"]) as f:
        manifest = json.load(f)
    (plan,) = resume_plans(manifest)
    assert (plan.request_id, plan.prompt, plan.generated, plan.durable_tokens) == ("r-1", [1, 2, 3], [4, 5], 4)
    assert manifest["handoff"] == {"from": path, "to": "b"} and manifest["segments_unusable"] == 0
    status = json.loads(cli("status", "-j", path, "--json").stdout)
    assert status["handoff"]["state"] == "done" and status["moved"] == 1 and status["in_flight"] == 0
    listing = cli("inspect", "-j", path)
    assert "id=r-1 moved to b" in listing.stdout
    stats = cli("inspect", "-j", path, "--stats", "--json")
    assert json.loads(stats.stdout)["moved"] == {"r-1": "b"}
    rec = cli("recover", "-j", path, "--dry-run", "--json")
    assert rec.returncode == 0 and json.loads(rec.stdout)["manifest"]["requests"] == []


def test_a_bad_target_is_refused_and_touches_nothing(tmp_path):
    path = str(tmp_path / "j")
    with kvj.Journal.open(path) as j:
        j.start("r-1", None, [1], {})
    bad = cli("handoff", "-j", path, "--to", "../x")
    assert bad.returncode == 64 and bad.stderr.count("\n") == 1 and "invalid request id" in bad.stderr
    assert not os.path.exists(os.path.join(path, "handoff.json"))
    assert cli("handoff", "-j", path).returncode == 64
    assert cli("handoff", "-j", path, "--to", "b", "--mode", "later").returncode == 64


def test_a_moved_request_s_blocks_stay_referenced_until_a_snapshot_drops_it(tmp_path):
    """The target loads them from this store or its restored replica: compaction keeps them,
    and ``kvj restore`` downloads them (both go by ``referenced_keys``)."""
    path = str(tmp_path / "j")
    meta = {"format": "kvj-vllm-request/1", "prompt_len": 3, "max_tokens": 8, "sampling": {}, "stop_ids": []}
    with kvj.Journal.open(path) as j:
        j.start("r-1", None, [1, 2, 3], meta)
        j.flush("r-1", 0, torch.ones(4, 4), token_range=(0, 4), layout={"token_ids": [1, 2, 3, 4]}).result()
        j.start("r-2", None, [7], meta)
        j.flush("r-2", 0, torch.zeros(4, 4), token_range=(0, 4), layout={"token_ids": [7, 8, 9, 10]}).result()
        j.handoff("r-1", "b")
        j.end("r-2", "ok")
        j.sync()
    state = kvj.replay(path)
    key, other = state.requests["r-1"].segments[0].key, state.requests["r-2"].segments[0].key
    assert [r.id for r in state.moved()] == ["r-1"] and not state.in_flight()
    assert list(state.referenced_keys()) == [key] and "moved to b" in state.referenced_keys()[key]
    done = cli("compact", "-j", path, "--grace", "0", "--json")
    assert done.returncode == 0, done.stderr
    with kvj.Journal.open(path) as j:
        assert j.store.exists(key), "compaction collected a moved request's block"
        assert not j.store.exists(other), "compaction collected nothing: the check above shows nothing"

