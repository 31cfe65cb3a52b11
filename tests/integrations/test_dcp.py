"""torch.distributed.checkpoint through kvj: two ranks on CPU (gloo), DTensor state sharded
across them, saved with JournalWriter and loaded with JournalReader. A round trip is bit-exact;
a rank SIGKILLed mid-save leaves the previous checkpoint, whole, as what loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from support.dcp_rank import digest, full_state

import kvj

pytest.importorskip("torch.distributed.checkpoint")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(mode: str, journal: str, step: int, die: dict = None):
    port = _port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1"}
        if die and rank in die:
            env["KVJ_DCP_DIE_AFTER"] = str(die[rank])
        procs.append(subprocess.Popen([sys.executable, "-m", "support.dcp_rank", mode, journal, str(step)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _run(mode: str, journal: str, step: int):
    out = []
    for p in _ranks(mode, journal, step):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_round_trip_is_bit_exact_and_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path):
    journal = str(tmp_path / "dcp")
    assert [e["event"] for e in _run("save", journal, 1)] == ["saved", "saved"]
    state = kvj.replay(journal)
    assert state.counts == {"checkpoint": 1} and state.checkpoint["step"] == 1  # one record: the commit point
    expected = {(1, 1, digest(full_state(1)))}
    assert {(e["step"], e["tensor_step"], e["digest"]) for e in _run("load", journal, 0)} == expected
    procs = _ranks("save", journal, 2, die={1: 1})  # rank 1 SIGKILLs itself after storing its first shard
    rank0, rank1 = procs
    rank1.wait(timeout=300)
    assert rank1.returncode == -signal.SIGKILL
    assert "dying" in rank1.stdout.read()
    # Rank 0 waits in DCP's collective for a rank that will never answer: kill it too.
    rank0.send_signal(signal.SIGKILL)
    rank0.wait(timeout=60)
    state = kvj.replay(journal)
    assert state.counts == {"checkpoint": 1} and state.checkpoint["step"] == 1
    assert {(e["step"], e["tensor_step"], e["digest"]) for e in _run("load", journal, 0)} == expected
