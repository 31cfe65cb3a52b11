"""kvj fsck: e2fsck's exit statuses on clean (0), repaired (1) and damaged (4) journals, and
what --repair does and refuses to do. What recovery handles by itself (a torn tail,
an empty newest log, a segment quarantined earlier) is a warning: such a journal is 0 or 1,
so `kvj fsck && kvj recover` recovers it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.cli_helpers import Holder, append_torn_tail, build, flip_byte, run_cli, segment_file, tree
from support.cli_helpers import kvj as kvj_proc

import kvj
from kvj.journal.journal import Journal
from kvj.journal.reader import list_logs
from kvj.journal.snapshot import list_snapshots, write_snapshot
from kvj.ops.compact import compact
from kvj.ops.fsck import fsck


def errors(result):
    return [(f.kind, f.fixed) for f in result.findings if f.severity == "error"]


def warnings(result):
    return [(f.kind, f.fixed) for f in result.findings if f.severity == "warning"]


@pytest.fixture
def journal(tmp_path):
    path = str(tmp_path / "j")
    build(path, requests=2, blocks=2, ended=1)
    return path


def test_exit_statuses_clean_damaged_repaired_through_the_cli(journal):
    clean = kvj_proc("fsck", "-j", journal)
    assert clean.returncode == 0 and clean.stdout.rstrip().endswith("clean")
    last, size, torn = append_torn_tail(journal)
    damaged = kvj_proc("fsck", "-j", journal)  # the end of the log after a crash: recovery cuts it
    assert damaged.returncode == 0 and "warning: torn tail of 30 bytes: an incomplete group header" in damaged.stdout
    assert "never acknowledged" not in damaged.stdout and "torn/" in damaged.stdout
    repaired = kvj_proc("fsck", "--repair", "-j", journal, "--json")
    assert repaired.returncode == 1
    (finding,) = [f for f in json.loads(repaired.stdout)["findings"] if f["severity"] == "warning"]
    assert finding["kind"] == "torn-tail" and finding["fixed"] and "torn/" in finding["action"]
    assert os.path.getsize(last) == size
    kept = os.path.join(journal, "torn", os.listdir(os.path.join(journal, "torn"))[0])
    assert open(kept, "rb").read() == torn
    assert fsck(journal).exit_code == 0


def test_mid_log_corruption_is_left_uncorrected(journal, capsys):
    with Journal.open(journal) as j:
        j.start("later")
    first = list_logs(journal)[0]
    with open(first, "r+b") as f:
        f.seek(80)
        f.write(b"\x00\x00\x00")
    for repair in ([], ["--repair"]):
        status, out, _ = run_cli(capsys, "fsck", "-j", journal, *repair)
        assert status == 4 and "corruption" in out and "offset" in out
    assert open(first, "rb").read(83)[80:] == b"\x00\x00\x00"  # repair did not touch it


def test_damaged_needed_segment_is_quarantined_then_a_known_loss(journal):
    keys = kvj.replay(journal).requests["req-0"].segments
    key = keys[1].key
    flip_byte(segment_file(journal, key))
    assert errors(fsck(journal)) == [("segment-damaged", False)] and fsck(journal).exit_code == 4
    result = fsck(journal, repair=True)
    assert errors(result) == [("segment-damaged", True)] and "quarantined" in result.findings[0].action
    assert result.exit_code == 1
    assert not os.path.exists(segment_file(journal, key))
    assert os.listdir(os.path.join(journal, "segments", "quarantine"))
    later = fsck(journal)  # the data is lost, fsck keeps saying so, and recovery falls back: not an error
    assert errors(later) == [] and warnings(later) == [("segment-quarantined", False)] and later.exit_code == 0
    assert any("quarantined as damaged" in f.message for f in later.findings)


def test_damaged_orphan_is_quarantined_and_corrected(journal, capsys):
    ended = kvj.replay(journal).requests["req-2"].segments[0].key
    flip_byte(segment_file(journal, ended))
    result = fsck(journal)
    assert errors(result) == [("segment-damaged", False)] and ended in result.orphans
    status, out, _ = run_cli(capsys, "fsck", "--repair", "-j", journal)
    assert status == 1 and "quarantined" in out
    assert fsck(journal).exit_code == 0


def test_missing_needed_segment(journal):
    key = kvj.replay(journal).requests["req-1"].segments[0].key
    os.unlink(segment_file(journal, key))
    result = fsck(journal, repair=True)
    assert errors(result) == [("segment-missing", False)] and result.exit_code == 4


def test_orphans_are_listed_not_errors(journal):
    with Journal.open(journal) as j:
        stray = j.store.put(torch.ones(3)).key
    result = fsck(journal)
    assert result.exit_code == 0 and stray in result.orphans
    assert any(f.kind == "orphans" for f in result.findings)


def test_snapshot_that_disagrees_with_its_log_is_set_aside(journal):
    state = kvj.replay(journal)
    state.allocations.clear()  # a buggy compactor's snapshot: the log it came from says otherwise
    snap = write_snapshot(journal, state)
    with Journal.open(journal) as j:  # replay now starts from the bad snapshot
        j.start("after")
    assert errors(fsck(journal)) == [("snapshot", False)]
    result = fsck(journal, repair=True)
    assert errors(result) == [("snapshot", True)] and result.exit_code == 1
    assert not os.path.exists(snap) and os.path.exists(os.path.join(journal, "torn", os.path.basename(snap)))
    assert kvj.replay(journal).allocations["cuda:0"]  # the log's state again
    assert fsck(journal).exit_code == 0


def test_damaged_snapshot_after_compaction_cannot_be_replaced(journal):
    from kvj.journal.config import CommitPolicy

    with Journal.open(journal, policy=CommitPolicy(file_size_limit=1)) as j:  # seals the file the build wrote
        j.start("after")
    compact(journal, collect=False)
    (_lsn, snap), = list_snapshots(journal)
    flip_byte(snap, 10)
    result = fsck(journal, repair=True)
    assert ("snapshot", False) in errors(result) and result.exit_code == 4
    assert os.path.exists(snap)  # the only copy of that history stays where it is


def test_live_writer_tail_is_not_an_error_and_repair_refuses(journal):
    with Holder(journal, "writer") as holder:
        assert fsck(journal).exit_code == 0
        proc = kvj_proc("fsck", "--repair", "-j", journal)
        assert proc.returncode == 8 and f"pid {holder.pid}" in proc.stderr


def test_a_seed_era_journal_is_refused_pointing_at_kvj_migrate(tmp_path, capsys):
    """Before issue 23 item 5, fsck checked a seed-era JSON-lines journal and --repair cut its
    torn last line; only kvj migrate reads that format now."""
    log = tmp_path / "old.jsonl"
    content = '{"op": "start", "id": "a"}\n{"op": "end", "id": "a"}\n{"op": "sta'
    log.write_text(content)
    for args in ([], ["--repair"]):
        status, _out, err = run_cli(capsys, "fsck", "-j", log, *args)
        assert status == 8 and "is a seed-era JSON-lines journal" in err and f"kvj migrate {log} -j NEWDIR" in err
    assert log.read_text() == content and os.listdir(tmp_path) == ["old.jsonl"]


def test_the_library_refuses_a_seed_era_journal_too(tmp_path):
    """Before issue 23 item 5, ``kvj.ops.fsck.fsck`` read a seed-era journal (the file, or a
    directory holding it) and, with ``repair``, cut its torn last line."""
    log = tmp_path / "old.jsonl"
    content = '{"op": "start", "id": "a"}\n{"op": "sta'
    log.write_text(content)
    for path in (log, tmp_path):
        for repair in (False, True):
            with pytest.raises(kvj.LegacyJournal, match=f"{log} is a seed-era JSON-lines journal.*kvj migrate"):
                fsck(str(path), repair=repair)
    assert log.read_text() == content and os.listdir(tmp_path) == ["old.jsonl"]


def test_newest_file_without_a_header(journal):
    with Journal.open(journal) as j:
        j.start("x")
    last = list_logs(journal)[-1]
    data = bytearray(open(last, "rb").read())
    open(last, "wb").write(data[:20])  # crashed while creating the file: no record is in it
    assert warnings(fsck(journal)) == [("torn-header", False)] and fsck(journal).exit_code == 0
    repaired = fsck(journal, repair=True)
    assert warnings(repaired) == [("torn-header", True)] and repaired.exit_code == 1
    assert not os.path.exists(last) and fsck(journal).exit_code == 0
    data[3] ^= 0xFF  # a damaged header in front of valid groups is corruption, never cut
    open(last, "wb").write(data)
    assert errors(fsck(journal, repair=True)) == [("corruption", False)]


def test_fsck_goes_on_past_damage_to_the_end_of_the_log(journal):
    """One damaged sealed file does not hide what comes after it: fsck reads on (one log
    walker with a reporter) and reports the later records and the later damage too."""
    from kvj.journal.config import CommitPolicy

    with Journal.open(journal, policy=CommitPolicy(file_size_limit=1500)) as j:
        for i in range(100):
            j.alloc("cuda:1", i, 1, durable=i % 10 == 9)
    logs = list_logs(journal)
    last_lsn = kvj.replay(journal).last_lsn
    with open(logs[1], "r+b") as f:
        f.seek(3)
        f.write(b"\xff")  # a sealed file's header
    with open(logs[-2], "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")  # the last group of another sealed file
    result = fsck(journal)
    damaged = [(f.kind, f.path) for f in result.findings if f.severity == "error"]
    assert damaged == [("corruption", logs[1]), ("corruption", logs[-2])]
    assert result.last_lsn == last_lsn and result.exit_code == 4


def test_an_empty_newest_log_is_benign(journal, capsys):
    from kvj.journal.writer import log_name

    last = list_logs(journal)[-1]
    empty = os.path.join(journal, log_name(int(os.path.basename(last)[:16]) + 1))
    open(empty, "wb").close()  # a crash right after creating the next log file
    result = fsck(journal)
    assert result.exit_code == 0 and [f.kind for f in result.findings if f.path == empty] == ["empty-log"]
    assert not kvj.replay(journal).tail  # replay agrees: nothing is damaged


@pytest.mark.parametrize("state", ["healthy", "torn tail", "torn header", "empty newest log", "quarantined segment"])
def test_fsck_and_recover_as_the_man_page_says(journal, state):
    """kvj(1): `kvj fsck && kvj recover` after a reboot, through the real entry point."""
    import subprocess

    from support.cli_helpers import KVJ, env

    if state == "torn tail":
        append_torn_tail(journal)
    elif state == "torn header":
        with Journal.open(journal) as j:
            j.start("x")
        last = list_logs(journal)[-1]
        os.truncate(last, 20)
    elif state == "empty newest log":
        last = list_logs(journal)[-1]
        open(os.path.join(journal, f"{int(os.path.basename(last)[:16]) + 1:016d}.log"), "wb").close()
    elif state == "quarantined segment":
        flip_byte(segment_file(journal, kvj.replay(journal).requests["req-0"].segments[1].key))
        assert fsck(journal, repair=True).exit_code == 1
    kvj_bin = " ".join(KVJ)
    proc = subprocess.run(["bash", "-c", f"{kvj_bin} fsck -j {journal} && {kvj_bin} recover -j {journal}"],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "manifest: " in proc.stdout
    if state == "quarantined segment":
        assert "fallback: request req-0: resumes at token 16 instead of 32" in proc.stdout


def test_preen_repairs_only_what_needs_no_decision(journal, capsys):
    ended = kvj.replay(journal).requests["req-2"].segments[0].key  # nothing live refers to it
    needed = kvj.replay(journal).requests["req-0"].segments[1].key
    flip_byte(segment_file(journal, ended))
    last, size, _torn = append_torn_tail(journal)
    result = fsck(journal, preen=True)
    assert result.exit_code == 1 and os.path.getsize(last) == size  # tail cut, bytes kept
    assert ("segment-damaged", True) in errors(result) and not os.path.exists(segment_file(journal, ended))
    flip_byte(segment_file(journal, needed))  # recovery's plan depends on it: a person decides
    status, out, _ = run_cli(capsys, "fsck", "-p", "-j", journal)
    assert status == 4 and "left for kvj fsck --repair" in out and "UNEXPECTED INCONSISTENCY" in out
    assert os.path.exists(segment_file(journal, needed))
    assert run_cli(capsys, "fsck", "-p", "--repair", "-j", journal)[0] == 16


def test_read_only_mode_refuses_every_write_it_could_make(journal, capsys):
    """Without --repair fsck works through READ_ONLY_FS: a write would fail loudly (status 8),
    so a clean run proves that none was attempted, even with everything --repair would fix."""
    import errno

    from kvj.fileio import READ_ONLY_FS

    with pytest.raises(OSError) as refused:
        READ_ONLY_FS.open(os.path.join(journal, "x"), os.O_WRONLY | os.O_CREAT)
    assert refused.value.errno == errno.EROFS and not os.path.exists(os.path.join(journal, "x"))
    flip_byte(segment_file(journal, kvj.replay(journal).requests["req-2"].segments[0].key))
    append_torn_tail(journal)
    status, out, err = run_cli(capsys, "fsck", "-n", "-j", journal)
    assert status == 4 and err == "" and "torn tail" in out and "quarantined" not in out


def test_read_data_subset_reads_a_sample_and_checks_every_header(journal, capsys):
    import json

    status, out, _ = run_cli(capsys, "fsck", "-j", journal, "--read-data-subset", "30%", "--json")
    result = json.loads(out)
    total = result["segments_checked"]
    assert status == 0 and total == 9  # 7 needed (4 KV blocks, 3 training) and 2 orphans (the ended request's)
    assert result["data_verified"] == 3 and result["headers_checked"] == 6 and result["sample_seed"] is not None
    missing = kvj.replay(journal).requests["req-1"].segments[0].key
    os.unlink(segment_file(journal, missing))  # found whether or not the sample holds it
    result = fsck(journal, sample=0.01)
    assert result.data_verified == 1 and errors(result) == [("segment-missing", False)]
    assert run_cli(capsys, "fsck", "-j", journal, "--read-data-subset", "0%")[0] == 16


def test_progress_is_reported_for_the_log_and_the_segments(tmp_path):
    path = str(tmp_path / "j")
    build(path, requests=1, blocks=2, ended=0, training=False)
    with Journal.open(path) as j:
        for i in range(5000):
            j.alloc("cuda:0", i, 64, "x")
    calls = []
    fsck(path, progress=lambda what, done, total: calls.append((what, done, total)))
    assert any(what == "reading the log" and 0 < done <= total for what, done, total in calls)
    assert ("verifying segments", 2, 2) in calls


@pytest.mark.parametrize("content", [
    {"kvj_config": 1, "policy": {"max_delay": -1}},  # before: fsck exited 0, as if the journal were usable
    {"kvj_config": 1, "policy": {"max_delay": 20000 * 7 * 86400.0}},
    "{",  # not JSON: fsck exited 8
], ids=["policy max_delay -1", "policy max_delay 20000w", "not JSON"])
def test_a_kvj_conf_every_reader_refuses_is_an_operational_error(journal, capsys, content):
    conf = os.path.join(journal, "kvj.conf")
    with open(conf, "w") as f:
        f.write(content if isinstance(content, str) else json.dumps(content))
    before = tree(journal)
    for args in ([], ["--repair"], ["--preen"]):
        status, out, err = run_cli(capsys, "fsck", "-j", journal, *args)
        assert status == 8 and conf in err and len(err.strip().splitlines()) == 1 and not out, (status, out, err)
    assert tree(journal) == before
    with pytest.raises(kvj.FormatError, match="kvj.conf"):
        fsck(journal)


def test_a_malformed_snapshot_body_is_reported_with_a_reason(journal, capsys):
    """Regression: a body the decoder refuses (0xc1, the byte MessagePack never uses) was reported
    as "malformed snapshot body: " and nothing more: the reason names the error and what it says."""
    import struct

    from crc32c import crc32c

    from kvj.journal.snapshot import SNAP_HEADER, SNAP_MAGIC, SNAP_VERSION, snapshot_name

    lsn = kvj.replay(journal).last_lsn
    body = b"\xc1"
    head = SNAP_HEADER.pack(SNAP_MAGIC, SNAP_VERSION, 0, lsn, len(body), 0)[:-4]
    with open(os.path.join(journal, snapshot_name(lsn)), "wb") as f:
        f.write(head + struct.pack("<I", crc32c(body, crc32c(head))) + body)
    (finding,) = [f for f in fsck(journal).findings if f.kind == "snapshot"]
    assert "malformed snapshot body: DecodeError: MessagePack data is malformed" in finding.message, finding.message
    status, out, _err = run_cli(capsys, "fsck", "-j", journal)
    assert status == 4 and "malformed snapshot body: DecodeError: MessagePack data is malformed" in out, out


def _use_log(journal: str) -> str:
    return os.path.join(journal, "segments", "uses.kvjuse")


def test_every_damaged_record_of_the_use_log_is_reported(journal, capsys):
    """Regression: a flipped bit in segments/uses.kvjuse went unreported (the reader stopped
    at the first bad record, silently). A record failing its CRC before a valid one is damage:
    a warning and status bit 64; the last record's flips are what a torn append leaves: a note."""
    import random

    from kvj.segments.uses import RECORD, parse

    path = _use_log(journal)
    good = open(path, "rb").read()
    records = len(good) // RECORD.size
    assert records >= 3 and len(good) == records * RECORD.size
    last = (records - 1) * RECORD.size
    assert fsck(journal).exit_code == 0
    for bit in range(len(good) * 8):  # the reader, on every bit
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << bit % 8
        uses = parse(bytes(bad))
        if bit // 8 < last:
            assert (uses.damaged, uses.damage_offset, uses.ignored_bytes) == (1, bit // 8 // RECORD.size * RECORD.size, 0)
        else:
            assert (uses.damaged, uses.ignored_bytes) == (0, RECORD.size)
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")  # which bit of each byte fsck sees flipped
    rng = random.Random(seed)
    for byte in range(len(good)):
        bad = bytearray(good)
        bad[byte] ^= 1 << rng.randrange(8)
        with open(path, "wb") as f:
            f.write(bad)
        result = fsck(journal)
        kinds = [(f.severity, f.kind) for f in result.findings if f.kind.startswith("use-log")]
        if byte < last:
            assert kinds == [("warning", "use-log-damaged")] and result.exit_code == 64, (byte, kinds)
        else:
            assert kinds == [("note", "use-log-torn")] and result.exit_code == 0, (byte, kinds)
    bad = bytearray(good)
    bad[60] ^= 4
    with open(path, "wb") as f:
        f.write(bad)
    status, out, _err = run_cli(capsys, "fsck", "-j", journal)
    assert status == 64 and "warning: 1 records of the store's use log fail their CRC" in out and path in out, out


def test_the_summary_says_what_becomes_of_a_damaged_use_log(journal, capsys):
    """Regression: with a damaged use log as its only warning, the summary said "(recovery
    handles them)", but recovery never reads the use log: the next compaction rewrites it
    (``UseLog.fold``), and fsck is then clean."""
    path = _use_log(journal)
    good = open(path, "rb").read()

    def damage() -> None:
        bad = bytearray(open(path, "rb").read())
        bad[60] ^= 4  # in the second record, with valid records after it
        with open(path, "wb") as f:
            f.write(bad)

    damage()
    status, out, _err = run_cli(capsys, "fsck", "-j", journal)
    summary = out.strip().splitlines()[-1]
    assert status == 64 and summary.endswith(
        "; no errors, 1 warnings (the store's use log is advisory: eviction order and the hit rate may be off, its "
        "damaged records left out; the next kvj compact rewrites it)"), summary
    compact(journal)
    assert open(path, "rb").read() != good and fsck(journal).exit_code == 0  # rewritten without the damaged record
    damage()
    append_torn_tail(journal)  # a warning recovery handles, beside it
    status, out, _err = run_cli(capsys, "fsck", "-j", journal)
    summary = out.strip().splitlines()[-1]
    assert status == 64 and summary.endswith("the next kvj compact rewrites it; recovery handles the others)"), summary


def test_a_torn_append_to_the_use_log_is_a_note_not_damage(journal, capsys):
    """What a crash while appending leaves (part of a record, zeros where records were being
    written) ends the log: `kvj fsck && kvj recover` still recovers."""
    path = _use_log(journal)
    good = open(path, "rb").read()
    for tail in (good[:20], bytes(53 * 3), bytes(30)):
        with open(path, "wb") as f:
            f.write(good + tail)
        status, out, _err = run_cli(capsys, "fsck", "-j", journal)
        assert status == 0 and f"note: the store's use log ends in {len(tail)} bytes of a torn append" in out, out


def test_a_crash_that_kept_some_of_compactions_unlinks_is_not_damage(journal):
    """Regression (crash suite, seed 21, plan reorder-subset): compaction wrote its snapshot, made
    it durable, then crashed while unlinking the files it covered; the directory kept the unlink of
    every file but the oldest, and the writer's next file had no header yet. What is left
    ends before the snapshot: fsck called that damage ("snapshot ahead of the log"), where
    recovery and the writer rightly go on from the snapshot. A note now, and nothing is lost."""
    import shutil

    from kvj.journal.config import CommitPolicy

    with Journal.open(journal, policy=CommitPolicy(file_size_limit=1)) as j:  # a file per group
        for n in range(4):
            j.start(f"r{n}")
    logs = list_logs(journal)
    assert len(logs) >= 3
    kept = shutil.copy(logs[0], logs[0] + ".kept")
    compact(journal, collect=False)
    (snap_lsn, _snap), = list_snapshots(journal)
    os.replace(kept, logs[0])  # the oldest file's unlink did not reach the disk
    assert list_logs(journal)[-1] == logs[-1] and os.path.getsize(logs[-1]) > 0
    os.truncate(logs[-1], 0)  # the writer's next file: created, its header not yet on the disk
    result = fsck(journal)
    assert not errors(result) and not warnings(result), result.findings
    assert any(f.kind == "covered-gap" and f"snapshot at LSN {snap_lsn}" in f.message for f in result.findings)
    assert kvj.replay(journal).last_lsn == snap_lsn
    with Journal.open(journal) as j:
        lsn = j.start("after-the-crash")
    assert lsn == snap_lsn + 1 and "after-the-crash" in kvj.replay(journal).requests
