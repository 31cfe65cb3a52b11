"""Only kvj migrate reads a seed-era JSON-lines journal (issue 23 item 5): every other command
and library entry point refuses one, the file or a directory holding it, with one line naming
the kvj migrate command to run (LegacyJournal, status 65; 8 for fsck), and changes nothing."""

from __future__ import annotations

import os

import pytest
import torch
from support.cli_helpers import assert_fails, in_process, tree

import kvj
from kvj.errors import LegacyJournal

SEED = b'{"op": "start", "id": "a", "prompt_hash": "p"}\n{"op": "end", "id": "a"}\n{"op": "sta'

COMMANDS = [["status"], ["replay"], ["replay", "--json"], ["inspect"], ["inspect", "--stats"], ["inspect", "--json"],
            ["recover"], ["recover", "--dry-run"], ["fsck"], ["fsck", "--repair"], ["compact", "--grace", "0"],
            ["prune", "--older-than", "0"], ["dump", "-r", "a", "--segment", "0", "-o", "{out}"],
            ["record", "start", "x"], ["flush", "{block}", "--checkpoint", "1"],
            ["replicate", "--to", "s3://bucket/prefix"], ["journal_replay", "--recover"]]


@pytest.fixture(params=["file", "directory"])
def seed(request, tmp_path):
    """(what to pass as the journal, the seed-era file the refusal names)."""
    home = tmp_path / "seed"
    home.mkdir()
    (home / "journal.jsonl").write_bytes(SEED)
    return (home / "journal.jsonl" if request.param == "file" else home), home / "journal.jsonl"


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_every_command_but_migrate_refuses_a_seed_era_journal(tmp_path, capsys, seed, args):
    target, seed_file = seed
    torch.save({"w": torch.ones(2)}, tmp_path / "b.pt")
    args = [{"{out}": str(tmp_path / "out.npy"), "{block}": str(tmp_path / "b.pt")}.get(a, a) for a in args]
    before = tree(seed_file.parent)
    if args[0] == "journal_replay":
        proc = in_process(capsys, "--log", target, *args[1:], prog="journal_replay")
    else:
        proc = in_process(capsys, *args, "-j", target)
    assert_fails(proc, 8 if args[0] == "fsck" else 65, f"{seed_file} is a seed-era JSON-lines journal",
                 f"kvj migrate {seed_file} -j NEWDIR", prog="journal_replay" if args[0] == "journal_replay" else "kvj")
    assert tree(seed_file.parent) == before and not (tmp_path / "out.npy").exists()


def test_the_library_refuses_a_seed_era_journal(seed):
    from kvj.journal.replay import RecordStream
    from kvj.ops.compact import compact
    from kvj.ops.inspection import Entries
    from kvj.ops.prune import prune
    from kvj.ops.recover import recover
    from kvj.ops.status import status

    target, seed_file = seed
    before = tree(seed_file.parent)
    for call in (lambda: kvj.replay(str(target)), lambda: kvj.Journal.open(target), lambda: RecordStream(str(target)),
                 lambda: Entries(str(target)), lambda: compact(str(target)), lambda: status(str(target), None),
                 lambda: prune(str(target), older_than=0), lambda: recover(str(target)),
                 lambda: recover(str(target), dry_run=True)):
        with pytest.raises(LegacyJournal, match=f"kvj migrate {seed_file} -j NEWDIR"):
            call()
    assert tree(seed_file.parent) == before


def test_a_kvj_journal_holding_a_jsonl_file_is_no_seed_era_journal(tmp_path, capsys):
    journal = tmp_path / "j"
    with kvj.Journal.open(journal) as j:
        j.start("r")
    (journal / "export.jsonl").write_bytes(SEED)
    assert in_process(capsys, "replay", "-j", journal).returncode == 0
    assert in_process(capsys, "record", "end", "r", "-j", journal).returncode == 0
    assert kvj.replay(str(journal)).requests["r"].ended


def test_migrate_still_reads_it(tmp_path, capsys):
    seed_file = tmp_path / "journal.jsonl"
    seed_file.write_bytes(SEED)
    proc = in_process(capsys, "migrate", seed_file, "-j", tmp_path / "new")
    assert proc.returncode == 0, proc.stderr
    assert kvj.replay(str(tmp_path / "new")).requests["a"].ended
    assert os.listdir(tmp_path / "new")  # a kvj journal now, which every command reads
    assert in_process(capsys, "fsck", "-j", tmp_path / "new").returncode == 0
