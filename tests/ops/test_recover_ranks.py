"""Recovery of a directory of rank journals (a tensor-parallel vLLM engine's, ``kvj.journal.ranks``):
``kvj recover -j JOURNAL`` recovers every rank's journal and writes one manifest whose resume
position per request is the minimum over the ranks; the commands that take one journal refuse
the directory in one line naming its ranks. The ranks' journals are written by the connector's worker side
itself (``WorkerJournal``, one per rank, each with its shard layout), no engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

import pytest
import torch

from kvj.errors import FormatError
from kvj.integrations.vllm.resuming import START_FORMAT, resume_plans
from kvj.integrations.vllm.plan import Save, Start, StepPlan
from kvj.integrations.vllm.worker import WorkerJournal
from kvj.journal import ranks
from kvj.ops.recover_ranks import merge_rank_manifests
from kvj.segments import kvblock
from kvj.segments.kvblock import LHNC, KVBlockLayout

L, H, BS, D, NB = 2, 2, 4, 8, 8
TP = 2


def layout(tp_rank: int) -> KVBlockLayout:
    return KVBlockLayout("m", "float32", L, H, D, BS, LHNC, TP, tp_rank)


SEED = layout(0).seed()
TOKENS = [(11 * i) % 97 for i in range(3 * BS + 2)]
PROMPT = TOKENS[:BS + 2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvj.cli.main", *args], capture_output=True, text=True)


def write_rank(journal: str, tp_rank: int, blocks: int, generated: int) -> None:
    """Rank ``tp_rank``'s journal of one request in flight: its START, ``generated`` tokens and
    its first ``blocks`` blocks (its own shard: 1 of the 2 KV heads), then a crash (no END)."""
    worker = WorkerJournal(ranks.rank_journal(journal, tp_rank, 0, TP, 1), layout(tp_rank), threads=1)
    gen = torch.Generator().manual_seed(tp_rank)
    worker.register([torch.randn(NB, H // TP, BS, 2 * D, generator=gen) for _ in range(L)])
    chains = kvblock.chain_keys(SEED, TOKENS, BS)
    meta = {"format": START_FORMAT, "prompt_len": len(PROMPT), "max_tokens": 8, "sampling": {}, "stop_ids": []}
    worker.step(StepPlan(starts=[Start("v0", "e-v0", PROMPT, meta)],
                         tokens=[("e-v0", len(PROMPT), TOKENS[len(PROMPT):len(PROMPT) + generated])],
                         saves=[Save("e-v0", b, b, chains[b], TOKENS[b * BS:(b + 1) * BS + 1]) for b in range(blocks)]))
    worker.close()


@pytest.fixture
def journal(tmp_path) -> str:
    path = str(tmp_path / "tp2")
    ranks.claim(path, TP, 1)
    write_rank(path, 0, blocks=3, generated=6)
    write_rank(path, 1, blocks=2, generated=4)  # rank 1 had made less durable when the engine died
    return path


def test_recover_writes_one_manifest_resuming_each_request_at_the_minimum_over_ranks(journal):
    rec = cli("recover", "-j", journal, "--json")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    result = json.loads(rec.stdout)
    manifest = result["manifest"]
    assert result["manifest_path"].startswith(os.path.join(journal, "recovery", "manifest-"))
    with open(result["manifest_path"]) as f:
        assert json.load(f)["requests"] == manifest["requests"]
    (req,) = manifest["requests"]
    assert req["ranks"] == {"rank-0-0": {"resume_position": 3 * BS, "in_flight": True},
                            "rank-1-0": {"resume_position": 2 * BS, "in_flight": True}}
    assert req["resume_position"] == 2 * BS and req["recorded_position"] == 3 * BS
    assert [s["seg"] for s in req["segments"]] == [0, 1]  # a block missing on any rank is recomputed on all
    assert req["fallback"]["lost_tokens"] == [2 * BS, 3 * BS]
    # Each rank's journal was recovered as a journal of its own (its manifest, its epoch record).
    for name in ("rank-0-0", "rank-1-0"):
        assert os.path.exists(manifest["ranks"][name]["manifest_path"])
        assert manifest["ranks"][name]["epoch_lsn"] is not None
    # Resume continues from every durable token (rank 0's: they are the tokens generated), KV to 2 blocks.
    (plan,) = resume_plans(result["manifest_path"])
    assert plan.prompt == PROMPT and plan.generated == TOKENS[len(PROMPT):len(PROMPT) + 6]
    assert plan.durable_tokens == 2 * BS
    # The story names each rank.
    text = cli("recover", "-j", journal, "--dry-run")
    assert text.returncode == 0 and "rank-1-0: up to LSN" in text.stdout and "2 rank journals" in text.stdout


@pytest.mark.parametrize("command", [["replay"], ["replicate", "--to", "s3://bucket/p"]])
def test_other_commands_refuse_the_directory_in_one_line_naming_its_ranks(journal, command):
    # (fsck, status, inspect, compact and prune take it: tests/cli/test_cli_engine_dir.py)
    proc = cli(command[0], "-j", journal, *command[1:])
    assert proc.returncode == 66, proc.stdout + proc.stderr  # missing input
    line = proc.stderr.strip()
    assert "\n" not in line and "rank-0-0, rank-1-0" in line and "kvj recover -j" in line, line
    assert cli("fsck", "-j", os.path.join(journal, "rank-1-0")).returncode == 0


def test_a_rank_without_a_journal_resumes_everything_at_zero(tmp_path):
    path = str(tmp_path / "tp2")
    ranks.claim(path, TP, 1)
    write_rank(path, 0, blocks=3, generated=6)  # rank 1 died before it made its journal
    rec = cli("recover", "-j", path, "--json")
    assert rec.returncode == 0, rec.stdout + rec.stderr
    manifest = json.loads(rec.stdout)["manifest"]
    (req,) = manifest["requests"]
    assert req["resume_position"] == 0 and req["segments"] == []
    assert manifest["ranks"]["rank-1-0"]["epoch"] is None


def _manifest(requests: List[Dict]) -> Dict:
    return {"recovered_lsn": 9, "epoch": 1, "requests": requests, "ended_requests": 0, "segments_verified": 0,
            "segments_unusable": 0, "warnings": []}


def _req(rid: str, position: int, output: List[int]) -> Dict:
    return {"id": rid, "tokens": [1, 2], "output": output, "resume_position": position, "recorded_position": position,
            "segments": [{"seg": 0, "tokens": [0, 4]}, {"seg": 1, "tokens": [4, 8]}], "fallback": None, "start_lsn": 1}


def test_merge_takes_the_minimum_position_and_the_most_tokens_and_refuses_contradicting_tokens():
    merged = merge_rank_manifests({"rank-0-0": _manifest([_req("a", 8, [3, 4, 5]), _req("b", 4, [])]),
                                   "rank-1-0": _manifest([_req("a", 4, [3])])}, journal="/j", epoch=2)
    a, b = merged["requests"]
    assert (a["resume_position"], a["output"], [s["seg"] for s in a["segments"]]) == (4, [3, 4, 5], [0])
    assert b["resume_position"] == 0 and b["ranks"]["rank-1-0"] == {"resume_position": 0, "in_flight": False}
    assert merged["tokens"]["restorable"] == 4 and len(merged["fallbacks"]) == 2
    with pytest.raises(FormatError):
        merge_rank_manifests({"rank-0-0": _manifest([_req("a", 8, [3, 4])]),
                              "rank-1-0": _manifest([_req("a", 8, [3, 9])])}, journal="/j", epoch=2)
