"""The ``/dev/shm`` ledger (``kvj.serve.shm``): a killed server's names are removed at the next start;
names a live process maps or holds, names of a server still running, and names kvj never recorded
are left alone. Against a stand-in for ``/dev/shm`` (a temporary directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvj.serve import shm
from kvj.serve.paths import replies_dir


@pytest.fixture
def fake_shm(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setattr(shm, "SHM", str(root))
    return root


def ledger(journal: str, doc: dict) -> None:
    os.makedirs(replies_dir(journal), exist_ok=True)
    with open(shm.ledger_path(journal), "w") as f:
        json.dump(doc, f)


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_killed_server_s_names_are_removed_and_nothing_else(fake_shm, tmp_path):
    journal = str(tmp_path / "j")
    for name in ("psm_dead1", "sem.mp-dead2", "psm_busy", "psm_other"):
        (fake_shm / name).write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1]); sys.stdin.read()",
                               str(fake_shm / "psm_busy")], stdin=subprocess.PIPE)
    try:
        ledger(journal, {"boot_id": shm.boot_id(), "pid": dead_pid(), "start_time": 1,
                         "names": ["psm_dead1", "sem.mp-dead2", "psm_busy", "psm_gone", "../escape"]})
        assert "psm_busy" in _wait_mapped("psm_busy", holder.pid)
        assert sorted(shm.cleanup(journal)) == ["psm_dead1", "sem.mp-dead2"]
        assert sorted(os.listdir(fake_shm)) == ["psm_busy", "psm_other"]  # in use, and never recorded
    finally:
        holder.stdin.close()
        holder.wait()


def _wait_mapped(name: str, pid: int) -> set:
    from support.wait import wait_for

    wait_for(lambda: name in shm.mapped([pid]), f"process {pid} to hold {name}")
    return shm.mapped([pid])


def test_a_server_still_running_keeps_its_names_and_a_ledger_kvj_cannot_read_names_nothing(fake_shm, tmp_path):
    journal = str(tmp_path / "j")
    (fake_shm / "psm_live").write_bytes(b"x")
    ledger(journal, {"boot_id": shm.boot_id(), "pid": os.getpid(), "start_time": shm.start_time(os.getpid()),
                     "names": ["psm_live"]})
    assert shm.cleanup(journal) == [] and (fake_shm / "psm_live").exists()
    with open(shm.ledger_path(journal), "w") as f:
        f.write("{not json")
    assert shm.cleanup(journal) == [] and (fake_shm / "psm_live").exists()


def test_a_ledger_of_another_boot_is_a_dead_server_s(fake_shm, tmp_path):
    journal = str(tmp_path / "j")
    (fake_shm / "psm_old").write_bytes(b"x")
    ledger(journal, {"boot_id": "another-boot", "pid": os.getpid(), "start_time": shm.start_time(os.getpid()),
                     "names": ["psm_old"]})
    assert shm.cleanup(journal) == ["psm_old"]


def test_record_keeps_what_this_server_recorded_before(fake_shm, tmp_path):
    journal = str(tmp_path / "j")
    me = os.getpid()
    ledger(journal, {"boot_id": shm.boot_id(), "pid": me, "start_time": shm.start_time(me), "names": ["psm_earlier"]})
    assert shm.record(journal) == ["psm_earlier"]
    ledger(journal, {"boot_id": "x", "pid": me, "start_time": 0, "names": ["psm_other_server"]})
    assert shm.record(journal) == []  # another server's ledger: replaced by this one's
