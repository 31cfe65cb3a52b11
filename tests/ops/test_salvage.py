"""Salvage (kvj recover --recovery-mode point-in-time): a journal damaged in the middle of its log is recovered
as of the last record before the damage; the damage and everything after it is kept in torn/,
and exactly what is lost is said, in the manifest and in the recovery-epoch record."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
from support.cli_helpers import block, build, in_process, kvj, tree

import kvj as kvj_lib
from kvj.errors import CorruptionError
from kvj.fileio import FS
from kvj.journal.journal import Journal
from kvj.journal.framing import RECORD_HEADER_SIZE
from kvj.journal.reader import Scan, decode, list_logs, read_header
from kvj.journal.records import RecordType
from kvj.journal.config import CommitPolicy
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
    assert refused.returncode == 65 and "--recovery-mode point-in-time" in refused.stderr
    dry = in_process(capsys, "recover", "-j", path, "--recovery-mode", "point-in-time", "--dry-run")
    assert dry.returncode == 0 and "SALVAGE" in dry.stdout and "would set aside" in dry.stdout
    after = tree(path)
    for lock in ("LOCK", "COMPACT"):  # the refused recovery took its locks (its own files, its pid)
        before.pop(lock, None), after.pop(lock, None)
    assert after == before  # refused and dry runs change nothing

    result = recover(path, mode="point-in-time")
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
    proc = kvj("recover", "-j", path, "--recovery-mode", "point-in-time", "--json")
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
    result = recover(path, mode="point-in-time")
    assert "salvage" not in result.manifest and kvj_lib.replay(path).epochs[-1].get("salvage") is None


class _FullDisk(FS):
    """A file system with no space left: every write fails with ENOSPC."""

    def write(self, fd: int, data) -> None:  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_salvage_on_a_full_disk_leaves_the_log_as_it_was_and_a_retry_says_all_that_is_lost(tmp_path):
    path = str(tmp_path / "j")
    made = damaged_journal(path)
    full = recover(path, dry_run=True, mode="point-in-time").manifest["salvage"]
    with pytest.raises(OSError) as exc:
        recover(path, mode="point-in-time", fs=_FullDisk())
    assert exc.value.errno == errno.ENOSPC
    assert {p: open(p, "rb").read() for p in list_logs(path)} == made["bytes"]  # nothing moved or cut
    assert os.listdir(os.path.join(path, "torn")) == []
    salvage = recover(path, mode="point-in-time").manifest["salvage"]
    for field in ("kept_lsn", "lost_to", "requests", "tokens_lost"):
        assert salvage[field] == full[field], field
    assert full["lost_to"] > full["kept_lsn"] and full["requests"]


class _CrashAt(FS):
    """Fails the first matching step (``open`` of a path containing ``name``, or an ``op``) as a
    crash there would stop the recovery: everything before it done, nothing after it."""

    def __init__(self, op: str, name: str = "", nth: int = 1):
        self.op, self.name, self.nth, self.fired = op, name, nth, False

    def _maybe(self, op: str, path: object = "") -> None:
        if not self.fired and op == self.op and self.name in str(path):
            self.nth -= 1
            if self.nth == 0:
                self.fired = True
                raise OSError(errno.EIO, f"injected at {op} {path}")

    def rename(self, src, dst) -> None:  # type: ignore[no-untyped-def]
        self._maybe("rename", dst)
        super().rename(src, dst)

    def open(self, path, flags, mode=0o600):  # type: ignore[no-untyped-def]
        self._maybe("open", path)
        return super().open(path, flags, mode)

    def ftruncate(self, fd: int, length: int) -> None:
        self._maybe("ftruncate")
        super().ftruncate(fd, length)

    def unlink(self, path) -> None:  # type: ignore[no-untyped-def]
        self._maybe("unlink", path)
        super().unlink(path)


LOSS = ("kept_lsn", "lost_to", "requests", "tokens_lost", "training", "damage")


@pytest.mark.parametrize("where", [("open", "manifest-"), ("ftruncate", ""), ("rename", "/torn/", 3)],
                         ids=["writing the manifest", "cutting the damaged file", "moving the later files"])
def test_a_salvage_interrupted_after_setting_files_aside_is_reported_by_the_retry(tmp_path, capsys, where):
    path = str(tmp_path / "j")
    damaged_journal(path)
    full = recover(path, dry_run=True, mode="point-in-time").manifest["salvage"]
    crash = _CrashAt(*where)
    with pytest.raises(OSError):
        recover(path, mode="point-in-time", fs=crash)
    assert crash.fired and os.path.exists(os.path.join(path, "SALVAGE.json"))
    assert os.listdir(os.path.join(path, "torn"))  # the cut's copy at least was made before the crash
    if where[0] == "rename":  # the crash came between two moves
        assert any(n.endswith(".log") for n in os.listdir(os.path.join(path, "torn")))
    status = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert status["salvage_pending"]

    dry = recover(path, dry_run=True, mode="point-in-time").manifest["salvage"]
    for field in LOSS:  # the retry's own walk no longer sees what was set aside; the report does
        assert dry[field] == full[field], field
    still_damaged = where[0] != "open"
    again = in_process(capsys, "recover", "-j", path,
                       *(["--recovery-mode", "point-in-time"] if still_damaged else ["--json"]))
    assert again.returncode == 0, again.stderr
    state = kvj_lib.replay(path)
    epoch = state.epochs[-1]["salvage"]
    assert (epoch["kept_lsn"], epoch["lost_to"], epoch["tokens_lost"]) == (full["kept_lsn"], full["lost_to"], 48)
    planned = [os.path.basename(full["cut_file"]) + ".36.torn"] + [os.path.basename(p) for p in full["later_files"]]
    assert [os.path.basename(p) for p in epoch["set_aside"]] == planned  # every file, each once
    assert sorted(os.listdir(os.path.join(path, "torn"))) == sorted(planned)
    assert not os.path.exists(os.path.join(path, "SALVAGE.json"))
    if still_damaged:
        assert "was interrupted; its report" in " ".join(again.stdout.split())
    later = recover(path)  # reported once: the next recovery is an ordinary one
    assert "salvage" not in later.manifest


def test_a_pending_report_whose_epoch_record_is_durable_is_not_reported_twice(tmp_path):
    path = str(tmp_path / "j")
    damaged_journal(path)
    with pytest.raises(OSError):  # the epoch record is durable; removing the report is not done
        recover(path, mode="point-in-time", fs=_CrashAt("unlink", "SALVAGE.json"))
    assert os.path.exists(os.path.join(path, "SALVAGE.json"))
    assert kvj_lib.replay(path).epochs[-1]["salvage"]["tokens_lost"] == 48
    result = recover(path)
    assert "salvage" not in result.manifest and not os.path.exists(os.path.join(path, "SALVAGE.json"))
    assert len([e for e in kvj_lib.replay(path).epochs if e.get("salvage")]) == 1


class _NoSpaceForTheReport(FS):
    def open(self, path, flags, mode=0o600):  # type: ignore[no-untyped-def]
        if "SALVAGE.json" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().open(path, flags, mode)


def test_no_space_for_the_report_leaves_the_journal_as_it_was(tmp_path):
    path = str(tmp_path / "j")
    made = damaged_journal(path)
    with pytest.raises(OSError) as exc:  # the copy of the cut fits; the report does not
        recover(path, mode="point-in-time", fs=_NoSpaceForTheReport())
    assert exc.value.errno == errno.ENOSPC
    assert os.listdir(os.path.join(path, "torn")) == [] and not os.path.exists(os.path.join(path, "SALVAGE.json"))
    assert {p: open(p, "rb").read() for p in list_logs(path)} == made["bytes"]


_GOOD = {"damage": [], "kept_lsn": 3, "lost_to": None, "cut_file": "x", "cut_offset": 36, "later_files": [],
         "requests": [], "training": None, "tokens_lost": 0, "set_aside_to": [], "id": "a", "resumed": False}


@pytest.mark.parametrize("text", ['{"kept_lsn": 3', "[]", json.dumps({**_GOOD, "requests": [{"id": "r"}]}),
                                  json.dumps({**_GOOD, "damage": [{"kind": "corruption"}]}),
                                  json.dumps({**_GOOD, "training": {"kept_step": 1}}),
                                  json.dumps({**_GOOD, "set_aside_to": [1]})],
                         ids=["torn", "not a map", "request", "damage", "training", "paths"])
def test_a_damaged_pending_report_is_refused_and_left_alone(tmp_path, capsys, text):
    path = str(tmp_path / "j")
    build(path)
    report = os.path.join(path, "SALVAGE.json")
    with open(report, "w") as f:
        f.write(text)
    before = tree(path)
    proc = in_process(capsys, "recover", "-j", path)
    assert proc.returncode == 65 and "SALVAGE.json" in proc.stderr and "not a pending salvage report" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    after = tree(path)
    for lock in ("LOCK", "COMPACT"):
        before.pop(lock, None), after.pop(lock, None)
    assert after == before


def test_a_new_damage_after_a_completed_salvage_is_reported_despite_a_stale_report(tmp_path):
    path = str(tmp_path / "j")
    damaged_journal(path)
    with pytest.raises(OSError):
        recover(path, mode="point-in-time", fs=_CrashAt("unlink", "SALVAGE.json"))
    epoch = kvj_lib.replay(path).epochs[-1]
    first = epoch["salvage"]
    with Journal.open(path, policy=CommitPolicy(file_size_limit=300)) as j:  # more work, more log files
        for i in range(12):
            j.start(f"after-{i}", tokens=[1], meta={"pad": "x" * 100})
            j.sync()
    victim = [p for p in list_logs(path)[:-1] if read_header(p).base_lsn > epoch["lsn"]][0]
    data = bytearray(open(victim, "rb").read())
    data[60] ^= 0xFF
    open(victim, "wb").write(data)
    result = recover(path, mode="point-in-time")
    s = result.manifest["salvage"]
    assert s["id"] != first["id"] and s["kept_lsn"] > first["kept_lsn"] and not s["resumed"]
    assert [e["salvage"]["id"] for e in kvj_lib.replay(path).epochs if e.get("salvage")] == [first["id"], s["id"]]
    assert not os.path.exists(os.path.join(path, "SALVAGE.json"))


def _flip_record_of(path: str, rid: str) -> None:
    """Damage the group that starts request ``rid`` (a byte inside its payload)."""
    for raw in Scan(path, reporter=lambda _d: None):
        rec = decode(raw)
        if rec.rtype == RecordType.START and rec.payload["id"] == rid:
            data = bytearray(open(raw.path, "rb").read())
            data[raw.offset + RECORD_HEADER_SIZE + 3] ^= 0xFF
            open(raw.path, "wb").write(data)
            return
    raise AssertionError(f"no start of {rid}")


@pytest.mark.parametrize("where", [("open", "manifest-"), ("rename", "/torn/", 2)],
                         ids=["after everything was set aside", "before anything moved"])
def test_a_second_damage_found_by_the_retry_adds_its_loss_to_the_pending_one(tmp_path, where):
    path, twin = str(tmp_path / "j"), str(tmp_path / "twin")
    build(path, requests=1, blocks=1, ended=0, training=False)
    with Journal.open(path, policy=CommitPolicy(file_size_limit=250)) as j:
        j.start("r", tokens=[1, 2])
        for b in range(12):  # each record its own commit group: a damaged start costs r no segment
            j.flush("r", b, block(7, b), token_range=(16 * b, 16 * (b + 1))).result()
            j.sync()
            j.start(f"f-{b}", tokens=[1], durable=True)
    shutil.copytree(path, twin)
    for d in (path, twin):
        _flip_record_of(d, "f-8")
    with pytest.raises(OSError):  # the first salvage stopped after its report was written
        recover(path, mode="point-in-time", fs=_CrashAt(*where))
    assert os.path.exists(os.path.join(path, "SALVAGE.json"))
    for d in (path, twin):  # a second damage, earlier in what the first salvage kept
        _flip_record_of(d, "f-3")
    truth = recover(twin, dry_run=True, mode="point-in-time").manifest["salvage"]  # both damages, one walk
    s = recover(path, mode="point-in-time").manifest["salvage"]
    assert s["resumed"] and (s["kept_lsn"], s["tokens_lost"]) == (truth["kept_lsn"], truth["tokens_lost"]) == (s["kept_lsn"], 128)
    assert [r["tokens_lost"] for r in s["requests"] if r["id"] == "r"] == [128]  # 192 -> 144 -> 64, once
    assert s["damage"][0]["path"] == s["cut_file"]  # the damage named first is where recovery is cut
    assert len(s["damage"]) >= 2 and kvj_lib.replay(path).epochs[-1]["salvage"]["tokens_lost"] == 128


def test_a_mirrored_journal_is_salvaged_in_both_copies(tmp_path):
    path, mirror = str(tmp_path / "j"), str(tmp_path / "m")
    with Journal.open(path, mirror=mirror, policy=CommitPolicy(file_size_limit=600)) as j:
        for i in range(6):
            j.start(f"late-{i}", tokens=[1, 2], durable=True)
            j.flush(f"late-{i}", 0, block(5, i), token_range=(0, 16)).result()
            j.sync()
    victim = os.path.basename(list_logs(path)[2])
    for root in (path, mirror):  # damage in one copy only would be read from the other
        data = bytearray(open(os.path.join(root, victim), "rb").read())
        data[100] ^= 0xFF
        open(os.path.join(root, victim), "wb").write(data)
    s = recover(path, mode="point-in-time").manifest["salvage"]
    for root in (path, mirror):
        assert sorted(n for n in os.listdir(root) if n.endswith(".log")) == [os.path.basename(p) for p in list_logs(path)]
        assert {os.path.join(root, "torn", n) for n in os.listdir(os.path.join(root, "torn"))} <= set(s["set_aside_to"])
        assert open(os.path.join(root, victim), "rb").read() == open(os.path.join(path, victim), "rb").read()
    assert len(s["set_aside_to"]) == 2 * (1 + len(s["later_files"]))
    with Journal.open(path) as j:  # a writer evening out the copies brings nothing back
        j.start("after", tokens=[1], durable=True)
    state = kvj_lib.replay(path)
    assert state.last_lsn == s["kept_lsn"] + 2 and "salvage" not in recover(path).manifest


def test_a_second_cut_at_the_same_place_keeps_the_first_cuts_bytes(tmp_path):
    path = str(tmp_path / "j")
    build(path, requests=1, blocks=1, ended=0, training=False)
    with Journal.open(path) as j:
        for i in range(4):
            j.start(f"a-{i}", tokens=[1], durable=True)
    log = list_logs(path)[-1]
    offsets = [raw.offset for raw in Scan(path, reporter=lambda _d: None) if raw.path == log]
    data = bytearray(open(log, "rb").read())
    data[offsets[1] + 20] ^= 0xFF
    open(log, "wb").write(data)
    first = recover(path, mode="point-in-time").manifest["salvage"]
    kept = first["set_aside_to"][0]
    kept_bytes = open(kept, "rb").read()
    with Journal.open(path) as j:  # the writer continues the cut file where it was cut
        for i in range(3):
            j.start(f"b-{i}", tokens=[1], durable=True)
    data = bytearray(open(log, "rb").read())
    data[first["cut_offset"] + 30] ^= 0xFF  # the group there rots too
    open(log, "wb").write(data)
    second = recover(path, mode="point-in-time").manifest["salvage"]
    assert second["cut_offset"] == first["cut_offset"] and second["set_aside_to"][0] != kept
    assert open(kept, "rb").read() == kept_bytes  # the first salvage's bytes are still where its record says


def test_a_merged_report_keeps_the_training_step_this_recovery_keeps():
    from kvj.journal.state import JournalState
    from kvj.ops.salvage_report import Salvage

    def report(training, kept_step=None):
        state = JournalState()
        if kept_step is not None:
            state.checkpoint = {"step": kept_step, "keys": [], "meta": {}, "lsn": 1}
        return Salvage(damage=[], kept_lsn=1, lost_to=None, cut_file="f", cut_offset=36, later_files=[], requests=[],
                       training=training, kept_state=state)

    pending = report({"kept_step": 5, "step_after_damage": 9})
    later = report(None, kept_step=3)  # another cut, earlier; the retry's own walk saw no step change
    later.cut_offset = 100
    assert pending.merged(later).training == {"kept_step": 3, "step_after_damage": 9}
    assert pending.merged(report(None, kept_step=9)).training is not None  # same cut: the pending report stands
    none_lost = report(None, kept_step=9)
    none_lost.cut_offset = 100
    assert pending.merged(none_lost).training is None
