"""Journals are made on purpose: kvj init (with the settings later commands use), record and
flush refuse a path that is not a journal, and kvj migrate makes one of a seed-era journal."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.cli_helpers import assert_fails, in_process, kvj

import kvj as kvj_lib

USAGE, NOINPUT = 64, 66


@pytest.fixture
def cli(capsys):
    return lambda *args: in_process(capsys, *args)


def test_record_and_flush_refuse_a_path_that_is_not_a_journal(tmp_path, cli):
    torch.save(torch.ones(4), tmp_path / "t.pt")
    typo = tmp_path / "jornal"
    for args in (["record", "start", "r"], ["flush", tmp_path / "t.pt", "--checkpoint", "1"]):
        assert_fails(cli(*args, "-j", typo), NOINPUT, "is not a kvj journal", "kvj init -j")
    assert not typo.exists()  # nothing created at the mistyped path
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_fails(cli("record", "start", "r", "-j", empty), NOINPUT, "kvj init")
    assert os.listdir(empty) == []


def test_init_writes_the_settings_later_commands_use(tmp_path):
    journal, store = tmp_path / "j", tmp_path / "elsewhere"
    proc = kvj("init", "-j", journal, "--store", store, "--max-delay", "20ms", "--max-records", "7",
               "--file-size", "1MiB", "--json")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((journal / "kvj.conf").read_text())
    assert config["policy"]["max_delay"] == 0.02 and config["policy"]["max_records"] == 7
    assert config["policy"]["file_size_limit"] == 1 << 20 and config["store"] == str(store)
    torch.save({"w": torch.ones(4)}, tmp_path / "ck.pt")
    assert kvj("flush", tmp_path / "ck.pt", "-j", journal, "--checkpoint", "3").returncode == 0
    assert os.listdir(store / "objects")  # the recorded store, without --store
    assert kvj("fsck", "-j", journal).returncode == 0  # which every command finds
    assert_fails(kvj("init", "-j", journal), USAGE, "not an empty directory")


def test_migrate_a_seed_era_journal(tmp_path, cli):
    seed = tmp_path / "seed.jsonl"
    seed.write_text('{"op": "start", "id": "a", "prompt_hash": "p"}\n'
                    '{"op": "seg_flush", "id": "a", "seg": 0, "ptr": 0, "size": 16}\n'
                    '{"op": "start", "id": "b"}\n{"op": "end", "id": "b"}\n{"op": "sta')
    before = seed.read_bytes()
    assert_fails(cli("record", "start", "x", "-j", seed), NOINPUT, "kvj migrate")
    assert_fails(cli("migrate", seed, "-j", tmp_path / "new"), USAGE, "1 seg_flush records", "--drop-segments")
    assert not (tmp_path / "new").exists()
    proc = cli("migrate", seed, "-j", tmp_path / "new", "--drop-segments", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["records"] == 3 and result["segments_dropped"] == {"a": 1} and result["torn_last_line"]
    state = kvj_lib.replay(str(tmp_path / "new"))
    assert state.requests["a"].prompt_hash == "p" and not state.requests["a"].ended and state.requests["b"].ended
    assert seed.read_bytes() == before  # only read
    assert cli("record", "end", "a", "-j", tmp_path / "new").returncode == 0  # a kvj journal now
