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
    assert_fails(cli("record", "start", "x", "-j", seed), 65, "is a seed-era JSON-lines journal",
                 f"kvj migrate {seed} -j NEWDIR")
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


def test_kvj_conf_is_the_one_configuration_the_library_and_every_command_read(tmp_path):
    journal, store = tmp_path / "cs", tmp_path / "cs-store"
    proc = kvj("init", "-j", journal, "--store", store, "--max-delay", "20ms", "--max-records", "7",
               "--file-size", "64KiB")
    assert proc.returncode == 0, proc.stderr
    with kvj_lib.Journal.open(str(journal)) as j:  # the README's call, without repeating the settings
        assert (j.writer.policy.max_delay, j.writer.policy.max_records, j.writer.policy.file_size_limit) == (
            0.02, 7, 64 << 10)
        j.start("r1")
        j.flush("r1", 0, torch.ones(2, 16, 2, 8), token_range=(0, 16)).result()
    assert os.listdir(store / "objects") and not (journal / "segments").exists()
    proc = kvj("fsck", "-j", journal)
    assert proc.returncode == 0 and "1 segments checked" in proc.stdout, proc.stdout + proc.stderr
    proc = kvj("recover", "-j", journal)
    assert proc.returncode == 0 and "1 verified, 0 unusable" in proc.stdout, proc.stderr
    # what is given explicitly wins over the file
    other = tmp_path / "other-store"
    with kvj_lib.Journal.open(str(journal), store=str(other),
                              policy=kvj_lib.CommitPolicy(max_records=3)) as j:
        assert j.writer.policy.max_records == 3
        j.start("r2")
        j.flush("r2", 0, torch.zeros(2, 16, 2, 8), token_range=(0, 16)).result()
    assert os.listdir(other / "objects")
    assert kvj("fsck", "-j", journal, "--store", other).returncode == 4  # r1's segment is not in that store


def test_commit_policy_values_that_cannot_work_are_refused(tmp_path, cli):
    for args in (["--file-size", "0"], ["--file-size", "1"], ["--file-size", "4KiB"], ["--max-records", "0"],
                 ["--max-delay", "-1s"], ["--max-delay", "20000w"], ["--max-delay", "25h"],
                 ["--file-size", "9000000TiB"], ["--max-records", str(1 << 63)]):
        assert_fails(cli("init", "-j", tmp_path / "j", *args), USAGE, args[0])
        assert not (tmp_path / "j").exists()
    assert_fails(cli("init", "-j", ""), USAGE, "give the journal directory")
    journal = tmp_path / "j"
    assert cli("init", "-j", journal).returncode == 0
    config = json.loads((journal / "kvj.conf").read_text())
    config["policy"]["max_buffer_bytes"] = 0  # by hand: a policy that would block the first record for ever
    (journal / "kvj.conf").write_text(json.dumps(config))
    proc = kvj("record", "start", "r1", "-j", journal, timeout=60)
    assert_fails(proc, 65, "kvj.conf", "max_buffer_bytes must be an integer >= 1")
    with pytest.raises(kvj_lib.FormatError, match="max_buffer_bytes"):
        kvj_lib.Journal.open(str(journal))


def test_a_max_delay_no_timed_wait_takes_is_refused_at_init_and_at_open(tmp_path, cli):
    """Regression: --max-delay 20000w was accepted, and the first record's commit killed the
    committer thread (its timed wait overflowed threading.TIMEOUT_MAX), failing start() and sync()."""
    journal = tmp_path / "j"
    assert_fails(cli("init", "-j", journal, "--max-delay", "20000w"), USAGE, "--max-delay", "at most 86400")
    assert not journal.exists()
    assert cli("init", "-j", journal, "--max-delay", "1d").returncode == 0  # a day is the longest
    with kvj_lib.Journal.open(str(journal)) as j:
        j.start("r1")
        assert j.sync() == 1
    config = json.loads((journal / "kvj.conf").read_text())
    config["policy"]["max_delay"] = 20000 * 7 * 86400.0  # what kvj init wrote before
    (journal / "kvj.conf").write_text(json.dumps(config))
    assert_fails(cli("record", "start", "r2", "-j", journal), 65, "kvj.conf", "max_delay", "at most 86400")
    with pytest.raises(kvj_lib.FormatError, match="max_delay"):
        kvj_lib.Journal.open(str(journal))
    with pytest.raises(kvj_lib.InvalidArgument, match="max_delay"):
        kvj_lib.Journal.open(str(journal), policy=kvj_lib.CommitPolicy(max_delay=20000 * 7 * 86400.0))
    assert kvj_lib.replay(str(journal)).last_lsn == 1  # nothing written by the refused opens


@pytest.mark.parametrize("content, needles", [
    (b'{"op": "start", "id": "a"}\n{"op": "sta"}\n', ["line 2", "invalid request id None"]),  # complete: not torn
    (b'{"op": "start", "id": "../../etc/x"}\n', ["line 1", "invalid request id '../../etc/x'"]),
    (b'{"op": "start", "id": "../../etc/x"}', ["its only line is torn", "invalid request id '../../etc/x'"]),
    (b'{"op": "start", "id": "a", "prompt_hash": NaN}\n{"op": "end", "id": "a"}\n', ["line 1", "NaN is not JSON"]),
    (b'{"op": "start", "id": "a", "prompt_hash": 1e309}\n{"op": "end", "id": "a"}\n', ["line 1", "not inf"]),
    (b'{"op": "end", "id": "a", "status": Infinity}\n', ["line 1", "Infinity is not JSON"]),
], ids=["complete bad last line", "bad id", "bad id, torn", "NaN", "1e309", "Infinity"])
def test_migrate_refuses_what_is_not_a_seed_record_and_names_it(tmp_path, cli, content, needles):
    seed = tmp_path / "seed.jsonl"
    seed.write_bytes(content)
    assert_fails(cli("migrate", seed, "-j", tmp_path / "new"), 65, str(seed), *needles)
    assert not (tmp_path / "new").exists() and seed.read_bytes() == content


def test_migrate_keeps_integer_hashes_and_leaves_out_zeros_a_crash_left(tmp_path, cli):
    seed = tmp_path / "seed.jsonl"
    seed.write_bytes(b'{"op": "start", "id": "a", "prompt_hash": 12345}\n\0\0\0\n\0\0')
    proc = cli("migrate", seed, "-j", tmp_path / "new", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["torn_last_line"]["length"] == 6
    assert kvj_lib.replay(str(tmp_path / "new")).requests["a"].prompt_hash == "12345"
