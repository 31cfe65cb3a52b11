"""torch.distributed.checkpoint through kvj: two ranks on CPU (gloo), DTensor state sharded
across them, saved with JournalWriter and loaded with JournalReader. A round trip is bit-exact
(in the ranks, and resharded into whole tensors in one process); a rank SIGKILLed mid-save
leaves the previous checkpoint, whole, as what loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from support.dcp_rank import digest, full_state
from support.fakecuda import gpu  # noqa: F401 (the fixture)

import kvj

pytest.importorskip("torch.distributed.checkpoint")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(journal: str, step: int, die: dict = None):
    port = _port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1"}
        if die and rank in die:
            env["KVJ_DCP_DIE_AFTER"] = str(die[rank])
        procs.append(subprocess.Popen([sys.executable, "-m", "support.dcp_rank", journal, str(step)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _load_whole(journal: str):
    """The newest committed checkpoint, loaded in this process (no process group) into whole
    tensors: DCP reads every rank's shards. Its step, and the digest of the tensors."""
    import torch
    import torch.distributed.checkpoint as dcp

    from kvj.integrations.dcp import JournalReader

    state = {"model": {"w": torch.zeros(64, 48)}, "optim": {"m": torch.zeros(96, 8, dtype=torch.bfloat16)},
             "step": torch.tensor(-1)}
    reader = JournalReader(journal)
    dcp.load(state, storage_reader=reader)
    return reader.step, digest({"w": state["model"]["w"], "m": state["optim"]["m"], "step": state["step"]})


def test_round_trip_is_bit_exact_and_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path):
    journal = str(tmp_path / "dcp")
    out = []
    for p in _ranks(journal, 1):  # each rank saves step 1, then loads it back
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    state = kvj.replay(journal)
    assert state.counts == {"checkpoint": 1} and state.checkpoint["step"] == 1  # one record: the commit point
    expected = digest(full_state(1))
    assert {(e["event"], e["step"], e["tensor_step"], e["digest"]) for e in out} == {("loaded", 1, 1, expected)}
    assert _load_whole(journal) == (1, expected)

    rank0, rank1 = _ranks(journal, 2, die={1: 1})  # rank 1 SIGKILLs itself after storing its first shard
    rank1.wait(timeout=300)
    assert rank1.returncode == -signal.SIGKILL
    assert "dying" in rank1.stdout.read()
    # Rank 0 waits in DCP's collective for a rank that will never answer: kill it too.
    rank0.send_signal(signal.SIGKILL)
    rank0.wait(timeout=60)
    state = kvj.replay(journal)
    assert state.counts == {"checkpoint": 1} and state.checkpoint["step"] == 1
    assert _load_whole(journal) == (1, expected)


class _Evil:
    """Unpickling this makes the directory ``path``: proof that something was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_plain_values_round_trip_and_nothing_else_is_ever_unpickled(tmp_path, monkeypatch):
    """DCP stores non-tensor values as torch.save bytes (BYTE_IO) and its planner loads them
    with pickle's full unpickler: kvj reads them with torch.load(weights_only=True) on save
    and on load, so plain data round-trips and a pickled object is refused both ways."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from kvj.errors import FormatError
    from kvj.integrations import dcp as kvj_dcp

    journal, marker = str(tmp_path / "dcp"), str(tmp_path / "unpickled")
    extra = {"epoch": 3, "lr": 0.25, "name": "run-7", "sizes": [1, 2, 3]}
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "extra": dict(extra)},
             storage_writer=kvj_dcp.JournalWriter(journal, step=1))
    target = {"w": torch.zeros(3, 4), "extra": {"epoch": 0, "lr": 0.0, "name": "", "sizes": []}}
    dcp.load(target, storage_reader=kvj_dcp.JournalReader(journal))
    assert target["extra"] == extra and torch.equal(target["w"], torch.arange(12.0).reshape(3, 4))

    with pytest.raises(CheckpointException, match="'extra' is not plain data"):  # DCP wraps a rank's error
        dcp.save({"w": torch.zeros(3, 4), "extra": _Evil(marker)}, storage_writer=kvj_dcp.JournalWriter(journal, step=2))
    assert kvj.replay(journal).checkpoint["step"] == 1 and not os.path.exists(marker)

    # A journal whose value got past the check (written by another tool, or planted): the
    # load refuses it instead of handing its bytes to DCP's unpickler.
    with monkeypatch.context() as m:
        m.setattr(kvj_dcp, "plain_value", lambda raw, fqn: None)
        dcp.save({"w": torch.zeros(3, 4), "extra": _Evil(marker)}, storage_writer=kvj_dcp.JournalWriter(journal, step=3))
    assert kvj.replay(journal).checkpoint["step"] == 3
    with pytest.raises(CheckpointException, match="'extra' is not plain data"):
        dcp.load({"w": torch.zeros(3, 4), "extra": None}, storage_reader=kvj_dcp.JournalReader(journal))
    assert not os.path.exists(marker)
    with pytest.raises(FormatError, match="weights_only"):
        kvj_dcp.plain_value(b"not a torch.save", "x")


def test_shards_on_a_gpu_leave_and_come_back_through_kvjs_device_copies(tmp_path, gpu):
    """State on a GPU (the strict stand-in of tests/support/fakecuda.py: a download's pinned
    destination holds poison until the host waits, streams that touch memory without a wait
    between them raise): each shard leaves through pinned staging and kvj's device-to-host
    copy and comes back through pinned staging and kvj's upload into device memory before it
    is copied into its target, bit-exact both ways. (Before, loading copied the host tensor
    straight into the device target, outside kvj's device path.)"""
    import torch
    import torch.distributed.checkpoint as dcp

    from kvj.integrations.dcp import JournalReader, JournalWriter

    gen = torch.Generator().manual_seed(3)
    want = {"model": {"w": torch.randn(64, 48, generator=gen)},
            "optim": {"m": torch.randn(96, 8, generator=gen).to(torch.bfloat16)}}
    state = {k: {n: t.to("cuda") for n, t in v.items()} for k, v in want.items()}
    gpu.copies.clear()
    dcp.save(state, storage_writer=JournalWriter(str(tmp_path / "dcp"), step=5), no_dist=True)
    assert [(c.kind, c.asynchronous, c.host.is_pinned()) for c in gpu.copies] == [("d2h", True, True)] * 2

    gpu.copies.clear()
    target = {"model": {"w": torch.zeros(64, 48, device="cuda")},
              "optim": {"m": torch.zeros(96, 8, dtype=torch.bfloat16, device="cuda")}}
    reader = JournalReader(str(tmp_path / "dcp"))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.step == 5
    assert [(c.kind, c.asynchronous, c.host.is_pinned()) for c in gpu.copies] == [("h2d", True, True)] * 2
    for part in want:
        for name, t in want[part].items():
            assert target[part][name].device.type == "cuda" and torch.equal(target[part][name].cpu(), t), name
