"""Salvage (kvj recover --until-damage): a journal damaged in the middle of its log is recovered
as of the last record before the damage; the damage and everything after it is kept in torn/,
and exactly what is lost is said, in the manifest and in the recovery-epoch record."""

from __future__ import annotations

import errno
import json
import os

import pytest
from support.cli_helpers import block, build, in_process, kvj, tree

import kvj as kvj_lib
from kvj.errors import CorruptionError
from kvj.fileio import FS
from kvj.journal.journal import Journal
from kvj.journal.reader import list_logs
from kvj.journal.writer import CommitPolicy
from kvj.ops.recover import recover


def damaged_journal(path: str, how: str = "group") -> dict:
    """Two requests with two blocks in a first log, then six more requests one log file each
    (a small size limit), then req-0's end; one sealed file is damaged as ``how`` says."""
    build(path, requests=2, blocks=2, ended=0, training=False)
    with Journal.open(path, policy=CommitPolicy(file_size_limit=600)) as j:
        for i in range(6):
            j.start(f"late-{i}", tokens=[1, 2])
            j.flush(f"late-{i}", 0, block(5, i), token_range=(0, 16)).result()
            j.sync()
        j.end("req-0")
    logs = list_logs(path)
    victim = logs[2]
    data = bytearray(open(victim, "rb").read())
    if how == "group":
        data[100] ^= 0xFF  # inside the first group: a valid group follows, so it is no torn tail
        open(victim, "wb").write(data)
    elif how == "header":
        data[3] ^= 0xFF
        open(victim, "wb").write(data)
    elif how == "missing file":
        os.unlink(victim)
    return {"logs": logs, "victim": victim, "bytes": {p: open(p, "rb").read() for p in logs if os.path.exists(p)}}


@pytest.mark.parametrize("how", ["group", "header", "missing file"])
def test_salvage_keeps_what_precedes_the_damage_and_sets_the_rest_aside(tmp_path, capsys, how):
    path = str(tmp_path / "j")
    made = damaged_journal(path, how)
    before = tree(path)
    with pytest.raises(CorruptionError):
        kvj_lib.replay(path)
    refused = in_process(capsys, "recover", "-j", path)
    assert refused.returncode == 65 and "--until-damage" in refused.stderr
    dry = in_process(capsys, "recover", "-j", path, "--until-damage", "--dry-run")
    assert dry.returncode == 0 and "SALVAGE" in dry.stdout and "would set aside" in dry.stdout
    after = tree(path)
    for lock in ("LOCK", "COMPACT"):  # the refused recovery took its locks (its own files, its pid)
        before.pop(lock, None), after.pop(lock, None)
    assert after == before  # refused and dry runs change nothing

    result = recover(path, until_damage=True)
    s = result.manifest["salvage"]
    assert s["kept_lsn"] == 12 and result.manifest["recovered_lsn"] == 12
    lost = {r["id"]: r for r in s["requests"]}
    assert {"late-4", "late-5"} <= set(lost) and lost["late-5"]["tokens_lost"] == 16  # read after the damage
    assert lost["req-0"]["what"] == "ended after the damage: recovery resumes it"
    state = kvj_lib.replay(path)  # the journal replays again, ending at the epoch record
    assert state.last_lsn == 13 and state.epochs[-1]["salvage"]["kept_lsn"] == 12
    assert state.epochs[-1]["salvage"]["set_aside"] == s["set_aside_to"]
    assert {"req-0", "req-1", "late-0", "late-1"} <= {r.id for r in state.in_flight()}
    # nothing is deleted: what was set aside is the original bytes, from the cut on
    kept = b"".join(open(p, "rb").read() for p in s["set_aside_to"])
    if how == "group":
        assert kept == made["bytes"][made["victim"]][s["cut_offset"]:] + b"".join(
            made["bytes"][p] for p in made["logs"][3:])
    assert s["cut_offset"] == (36 if how == "group" else 0)
    again = in_process(capsys, "fsck", "-j", path)
    assert again.returncode == 0, again.stdout


def test_the_story_says_what_is_lost_and_the_epoch_record_keeps_it(tmp_path):
    path = str(tmp_path / "j")
    damaged_journal(path)
    proc = kvj("recover", "-j", path, "--until-damage", "--json")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    epoch = kvj_lib.replay(path).epochs[-1]
    assert epoch["lsn"] == printed["epoch_lsn"] and epoch["salvage"]["lost_from"] == 13
    assert epoch["salvage"]["tokens_lost"] == printed["manifest"]["salvage"]["tokens_lost"] == 48
    proc = kvj("recover", "-j", path)  # the salvaged journal recovers as any other now
    assert proc.returncode == 0 and "SALVAGE" not in proc.stdout and "since epoch 1" in proc.stdout


def test_a_healthy_journal_needs_no_salvage(tmp_path):
    path = str(tmp_path / "j")
    build(path)
    result = recover(path, until_damage=True)
    assert "salvage" not in result.manifest and kvj_lib.replay(path).epochs[-1].get("salvage") is None


class _FullDisk(FS):
    """A file system with no space left: every write fails with ENOSPC."""

    def write(self, fd: int, data) -> None:  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_salvage_on_a_full_disk_leaves_the_log_as_it_was_and_a_retry_says_all_that_is_lost(tmp_path):
    path = str(tmp_path / "j")
    made = damaged_journal(path)
    full = recover(path, dry_run=True, until_damage=True).manifest["salvage"]
    with pytest.raises(OSError) as exc:
        recover(path, until_damage=True, fs=_FullDisk())
    assert exc.value.errno == errno.ENOSPC
    assert {p: open(p, "rb").read() for p in list_logs(path)} == made["bytes"]  # nothing moved or cut
    assert os.listdir(os.path.join(path, "torn")) == []
    salvage = recover(path, until_damage=True).manifest["salvage"]
    for field in ("kept_lsn", "lost_to", "requests", "tokens_lost"):
        assert salvage[field] == full[field], field
    assert full["lost_to"] > full["kept_lsn"] and full["requests"]
