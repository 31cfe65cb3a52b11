"""Standard output that cannot be written (``> /dev/full``, closed with ``>&-``): a command
whose work is done and durable says so, in one line, with status 73 (fsck: 8 added to its
status); a command that did nothing says it could not write, with status 74 (fsck: 8). Never
"internal error", never a traceback, and what was done stays done."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from support.cli_helpers import KVJ, append_torn_tail, build, env

import kvj as kvj_lib

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")

FULL, CLOSED = "> /dev/full", ">&-"


def _run(args, redirect):
    line = " ".join(f"'{a}'" for a in [*KVJ, *map(str, args)])
    return subprocess.run(["bash", "-c", f"{line} {redirect}"], capture_output=True, text=True, env=env(),
                          timeout=300)


def _one_line(proc, status, *needles):
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvj: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def journal(tmp_path):
    path = tmp_path / "j"
    build(str(path))
    return path


def test_recover_to_a_full_disk_or_closed_output_says_the_recovery_is_done(journal):
    proc = _run(["recover", "-j", journal], FULL)
    _one_line(proc, 73, "recovery is done: manifest ", "manifest-000001.json, epoch record at LSN",
              "could not be written to standard output: No space left on device")
    proc = _run(["recover", "-j", journal, "--json"], CLOSED)
    _one_line(proc, 73, "manifest-000002.json", "standard output is closed")
    epochs = kvj_lib.replay(str(journal)).epochs
    assert [e["epoch"] for e in epochs] == [1, 2] and (journal / "recovery" / "manifest-000002.json").exists()


@pytest.mark.parametrize("redirect", [FULL, CLOSED], ids=["full", "closed"])
def test_record_says_its_records_are_durable(journal, redirect):
    _one_line(_run(["record", "start", "late", "-j", journal], redirect), 73, "1 records durable", "LSN 21..21")
    assert "late" in kvj_lib.replay(str(journal)).requests


def test_every_other_command_that_writes_says_what_it_did(tmp_path, journal):
    torch.save(torch.ones(2, 16, 2, 8, dtype=torch.bfloat16), tmp_path / "b.pt")
    seed = tmp_path / "seed.jsonl"
    seed.write_text('{"op": "start", "id": "a"}\n')
    cases = [(["init", "-j", tmp_path / "new"], "created journal "),
             (["flush", tmp_path / "b.pt", "-j", journal, "-r", "req-0", "--tokens", "48:64",
               "--layout", "model=tiny"], "1 segments durable"),
             (["migrate", seed, "-j", tmp_path / "migrated"], "migrated 1 records"),
             (["dump", "-j", journal, "-r", "req-0", "--segment", "0", "-o", tmp_path / "s.pt"], "written to "),
             (["compact", "-j", journal, "--grace", "0"], "compaction of "),
             (["prune", "-j", journal, "--older-than", "0"], "pruned ")]
    for args, needle in cases:
        _one_line(_run(args, FULL), 73, needle, "No space left on device")
    assert (tmp_path / "new" / "kvj.conf").exists() and (tmp_path / "s.pt").exists()
    assert kvj_lib.replay(str(journal)).requests["req-0"].resume_position == 64
    assert "a" in kvj_lib.replay(str(tmp_path / "migrated")).requests


def test_fsck_repair_adds_8_to_the_status_of_what_it_corrected(journal):
    append_torn_tail(str(journal))
    proc = _run(["fsck", "-j", journal, "--repair"], FULL)
    _one_line(proc, 1 | 8, "the repairs are done (1 corrected), status 1", "No space left on device")
    assert os.listdir(journal / "torn")  # the cut is kept, and the journal is clean now
    assert subprocess.run([*KVJ, "fsck", "-j", str(journal)], capture_output=True, env=env()).returncode == 0


@pytest.mark.parametrize("args, status, redirect", [(["status"], 74, CLOSED), (["inspect"], 74, FULL),
                                                    (["recover", "--dry-run"], 74, CLOSED), (["fsck"], 8, FULL)],
                         ids=["status closed", "inspect full", "recover --dry-run closed", "fsck full"])
def test_a_read_only_command_says_it_could_not_write(journal, args, status, redirect):
    before = json.dumps(sorted(os.listdir(journal)))
    proc = _run([*args, "-j", journal], redirect)
    _one_line(proc, status, "standard output")
    if status == 74:
        assert "cannot write to standard output" in proc.stderr
    assert json.dumps(sorted(os.listdir(journal))) == before
