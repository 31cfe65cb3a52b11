"""Retention: kvj compact --dry-run says what compaction would do and changes nothing; kvj prune
removes what kvj set aside long ago (torn/, recovery/ manifests but the newest, quarantine)."""

from __future__ import annotations

import os
import time

from support.cli_helpers import append_torn_tail, build, flip_byte, in_process, kvj, segment_file, tree

import kvj as kvj_lib
from kvj.journal.journal import Journal
from kvj.journal.reader import list_logs
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.ops.fsck import fsck
from kvj.ops.prune import prune
from kvj.ops.recover import recover

DAY = 86400.0


def test_compact_dry_run_changes_nothing_and_says_what_compact_does(tmp_path, capsys):
    path = str(tmp_path / "j")
    build(path)
    with Journal.open(path, policy=CommitPolicy(file_size_limit=1)) as j:
        j.start("later")  # past the size limit: the log rotates, and the first file is sealed
    assert len(list_logs(path)) >= 2
    recover(path)
    before = tree(path)
    dry = compact(path, grace=0, dry_run=True)
    assert tree(path) == before
    real = compact(path, grace=0)
    assert dry.dry_run and not real.dry_run
    for field in ("snapshot", "snapshot_lsn", "logs_removed", "snapshots_removed", "segments_removed",
                  "bytes_reclaimed"):
        assert getattr(dry, field) == getattr(real, field), field
    assert real.segments_removed  # the ended request's blocks
    proc = in_process(capsys, "compact", "-j", path, "--dry-run", "--grace", "0")
    assert proc.returncode == 0 and "would remove" in proc.stdout and "would reclaim" in proc.stdout


def test_prune_removes_what_was_set_aside_long_ago_and_keeps_the_newest_manifest(tmp_path, capsys):
    path = str(tmp_path / "j")
    written = build(path)
    append_torn_tail(path)
    recover(path)  # cuts the tail into torn/, manifest 1
    recover(path)  # manifest 2
    damaged = written["keys"]["req-2"][0]  # nothing live refers to it: fsck --repair quarantines it
    flip_byte(segment_file(path, damaged))
    assert fsck(path, repair=True).exit_code == 1
    quarantine = os.path.join(path, "segments", "quarantine")
    assert len(os.listdir(quarantine)) == 1 and len(os.listdir(os.path.join(path, "torn"))) == 1

    assert prune(path, older_than=7 * DAY).removed == {"torn": [], "recovery": [], "quarantine": []}
    before = tree(path)
    later = time.time() + 8 * DAY
    dry = prune(path, older_than=7 * DAY, now=later, dry_run=True)
    assert tree(path) == before
    result = prune(path, older_than=7 * DAY, now=later)
    assert result.removed == dry.removed and result.bytes_reclaimed == dry.bytes_reclaimed > 0
    assert [len(result.removed[k]) for k in ("torn", "recovery", "quarantine")] == [1, 1, 1]
    assert os.listdir(os.path.join(path, "recovery")) == ["manifest-000002.json"]
    assert os.listdir(os.path.join(path, "torn")) == [] and os.listdir(quarantine) == []
    assert kvj_lib.replay(path).epochs[-1]["manifest"] == "recovery/manifest-000002.json"
    assert fsck(path).exit_code == 0


def test_prune_through_the_real_entry_point(tmp_path):
    path = str(tmp_path / "j")
    build(path)
    append_torn_tail(path)
    recover(path)
    proc = kvj("prune", "-j", path, "--older-than", "0s", "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"torn":["' in proc.stdout and '"kept_newest_manifest":"' in proc.stdout
    assert kvj("prune", "-j", path).returncode == 64  # --older-than is required
