"""What commands say, said right: a dry run says what it would keep, every listing shows a
segment key by the same prefix, a number a record cannot hold is a usage error on the command
line, a journal without records has no "LSN None..None", and a point in time past the
journal's end is named as such."""

from __future__ import annotations

import re

import torch
from support.cli_helpers import assert_fails, build, in_process

from kvj.journal.journal import Journal
from kvj.ops.recover import recover


def test_prune_dry_run_says_it_would_keep_the_newest_manifest(tmp_path, capsys):
    path = tmp_path / "j"
    build(str(path), requests=1, blocks=1, ended=0, training=False)
    recover(str(path))
    dry = in_process(capsys, "prune", "-j", path, "--older-than", "0", "--dry-run").stdout
    assert "would keep the newest manifest" in dry and "; kept the" not in dry
    assert "; kept the newest manifest" in in_process(capsys, "prune", "-j", path, "--older-than", "0").stdout


def test_flush_and_inspect_show_a_segment_key_by_the_same_prefix(tmp_path, capsys):
    path = tmp_path / "j"
    build(str(path), requests=1, blocks=0, ended=0, training=False)
    torch.save(torch.ones(2, 16, 2, 8), tmp_path / "b.pt")
    flushed = in_process(capsys, "flush", tmp_path / "b.pt", "-j", path, "-r", "req-0", "--tokens", "0:16").stdout
    shown = re.search(r"segment 0, tokens 0\.\.16: ([0-9a-f]+) ", flushed).group(1)
    listed = re.search(r"key=([0-9a-f]+) ", in_process(capsys, "inspect", "-j", path, "-t", "segment").stdout).group(1)
    assert shown == listed and len(shown) == 12


def test_a_meta_value_no_record_can_hold_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "j"
    Journal.open(path).close()
    assert_fails(in_process(capsys, "record", "start", "r1", "-j", path, "--meta", "a=1e309"), 64, "meta.a is inf")
    assert "r1" not in in_process(capsys, "replay", "-j", path).stdout


def test_a_journal_without_records_shows_no_none(tmp_path, capsys):
    path = tmp_path / "j"
    Journal.open(path).close()
    for args in (["fsck"], ["inspect", "--stats"], ["replay"], ["status"]):
        proc = in_process(capsys, *args, "-j", path)
        assert proc.returncode == 0 and "None" not in proc.stdout, (args, proc.stdout)
    assert "0 records," in in_process(capsys, "fsck", "-j", path).stdout


def test_a_point_past_the_journal_s_end_is_named_as_such(tmp_path, capsys):
    path = tmp_path / "j"
    with Journal.open(path) as j:
        for i in range(5):
            j.alloc("cuda:0", i, 64)
    proc = in_process(capsys, "replay", "--at", "1200", "-j", path)
    assert proc.returncode == 0
    assert proc.stderr.strip() == ("kvj: warning: --at 1200 is past the journal's last record (LSN 5): this is "
                                   "the state at its end"), proc.stderr
    assert in_process(capsys, "replay", "--at", "5", "-j", path).stderr == ""
