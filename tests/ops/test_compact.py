"""Compaction: folds sealed logs into a durable snapshot before deleting them, never loses a record
of a live writer in another process, and collects only unreferenced segments past the grace period."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support.cli_helpers import build, run_cli, segment_file

import kvj
from kvj.errors import JournalLocked
from kvj.fileio import FS
from kvj.journal.journal import Journal
from kvj.journal.recovery import DirLock
from kvj.journal.reader import list_logs
from kvj.journal.replay import replay
from kvj.journal.snapshot import list_snapshots
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.ops.recover import recover


def live(state):
    d = state.to_dict(include_ended=False)
    return {k: d[k] for k in ("requests", "allocations", "checkpoint", "deltas", "epochs", "last_lsn")}


def sessions(path, n=4):
    """Several writer sessions, each filling a log file past its size limit, so the journal has
    several sealed log files and an empty newest one (a writer continues a file below the limit)."""
    for s in range(n):
        with Journal.open(path, policy=CommitPolicy(file_size_limit=100)) as j:
            j.start(f"s{s}")
            j.alloc("cuda:0", s * 4096, 4096, f"s{s}")
            if s % 2:
                j.end(f"s{s - 1}")
                j.free("cuda:0", (s - 1) * 4096)


def test_compaction_folds_sealed_logs_and_keeps_the_state(tmp_path, capsys):
    j = str(tmp_path / "j")
    sessions(j)
    before = live(kvj.replay(j))
    logs = list_logs(j)
    status, out, err = run_cli(capsys, "compact", "-j", j)
    assert status == 0, err
    # sessions of 2, 4, 2 and 4 records, one file each: all four (LSN 1..12) are sealed
    assert "snapshot at LSN 12" in out and "removed 4 log files" in out and "reclaimed" in out
    assert list_logs(j) == logs[-1:] and [lsn for lsn, _ in list_snapshots(j)] == [12]
    after = kvj.replay(j)
    assert live(after) == before and after.snapshot_lsn == 12 and after.ended_compacted == 2
    sessions(j, 2)
    again = compact(j)
    assert again.snapshot_lsn == 18 and len(again.snapshots_removed) == 1 and again.bytes_reclaimed > 0
    assert [lsn for lsn, _ in list_snapshots(j)] == [18]
    nothing = compact(j)  # only the newest file is left: nothing sealed to fold
    assert nothing.snapshot is None and nothing.logs_removed == [] and nothing.bytes_reclaimed == 0


class RecordingFS(FS):
    def __init__(self, fail_unlink_after=None):
        self.ops = []
        self.unlinks = 0
        self.fail_unlink_after = fail_unlink_after

    def rename(self, src, dst):
        self.ops.append(("rename", os.path.basename(dst)))
        super().rename(src, dst)

    def fsync_dir(self, path):
        self.ops.append(("fsync_dir", path))
        super().fsync_dir(path)

    def unlink(self, path):
        if self.fail_unlink_after is not None and self.unlinks >= self.fail_unlink_after:
            raise OSError(errno.EIO, "injected", path)
        self.unlinks += 1
        self.ops.append(("unlink", os.path.basename(path)))
        super().unlink(path)


def test_snapshot_is_durable_before_any_log_is_deleted(tmp_path):
    j = str(tmp_path / "j")
    sessions(j)
    fs = RecordingFS()
    compact(j, fs=fs, collect=False)
    names = fs.ops
    renamed = names.index(("rename", "snapshot-0000000000000012.snap"))
    assert names[renamed + 1] == ("fsync_dir", j)  # durable before ...
    first_unlink = next(i for i, op in enumerate(names) if op[0] == "unlink")
    assert renamed < first_unlink  # ... anything it covers is deleted
    unlinked = [op[1] for op in names if op[0] == "unlink"]
    assert unlinked == sorted(unlinked)  # oldest first
    assert names[-1] == ("fsync_dir", j)


@pytest.mark.parametrize("after", [0, 1, 2])
def test_a_crash_midway_leaves_a_journal_that_replays_the_same(tmp_path, after):
    j = str(tmp_path / "j")
    sessions(j)
    before = live(kvj.replay(j))
    with pytest.raises(OSError):
        compact(j, fs=RecordingFS(fail_unlink_after=after), collect=False)
    assert live(kvj.replay(j)) == before
    compact(j)
    assert live(kvj.replay(j)) == before and len(list_logs(j)) == 1


def test_segments_are_collected_only_when_unreferenced_and_old(tmp_path):
    j = str(tmp_path / "j")
    built = build(j, requests=2, blocks=2, ended=1)
    ended = built["keys"]["req-2"]
    with Journal.open(j) as jj:  # stored, its record not yet written: young and unreferenced
        fresh = jj.store.put(torch.full((4, 4), 7.0)).key
    now = time.time()
    kept = compact(j, grace=3600, now=now)
    assert kept.segments_removed == [] and kept.segments_kept_young == 3
    sizes = sum(os.path.getsize(segment_file(j, key)) for key in ended + [fresh])
    gone = compact(j, grace=3600, now=now + 7200)
    assert sorted(gone.segments_removed) == sorted(ended + [fresh])
    assert gone.logs_removed == [] and gone.bytes_reclaimed == sizes
    for rid in ("req-0", "req-1"):
        for key in built["keys"][rid]:
            assert os.path.exists(segment_file(j, key))
    for key in built["training"].values():
        assert os.path.exists(segment_file(j, key))
    assert recover(j, dry_run=True).manifest["segments_unusable"] == 0


def test_second_compactor_is_refused_naming_the_first(tmp_path):
    j = str(tmp_path / "j")
    sessions(j, 1)
    lock = DirLock(j, "COMPACT", "compactor").acquire()
    try:
        with pytest.raises(JournalLocked, match=f"compactor \\(pid {os.getpid()}\\)"):
            compact(j)
    finally:
        lock.release()


WRITER = textwrap.dedent("""
    import sys
    from kvj.journal.journal import Journal
    from kvj.journal.config import CommitPolicy

    with Journal.open(sys.argv[1], policy=CommitPolicy(max_delay=0.002, file_size_limit=2048)) as j:
        i = 0
        while True:
            j.alloc("cuda:0", i, 64, f"t{i}")
            i += 1
            if i % 25 == 0:
                j.sync()
                print(i, flush=True)
""")


def test_compaction_with_a_live_writer_in_another_process_loses_nothing(tmp_path):
    j = str(tmp_path / "j")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, j], stdout=subprocess.PIPE, text=True)
    acked = 0
    compactions = 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline or compactions < 5:
            acked = int(writer.stdout.readline())
            if acked % 100 == 0:
                result = compact(j, collect=False)
                compactions += result.snapshot is not None
    finally:
        writer.kill()
        writer.wait()
    state = kvj.replay(j)
    addrs = sorted(state.allocations["cuda:0"])
    assert addrs[:acked] == list(range(acked))  # every acknowledged record, in order, no holes
    assert addrs == list(range(len(addrs)))
    assert state.snapshot_lsn > 0 and compactions >= 5
    compact(j, collect=False)
    assert sorted(kvj.replay(j).allocations["cuda:0"]) == addrs


def _moved_and_live(path):
    """Sealed log files holding a request handed off to another engine, one in flight and one
    ended, each with a stored block; the newest file holds one more live request."""
    keys = {}
    for s, rid in enumerate(["moved", "live", "done"]):
        with Journal.open(path, policy=CommitPolicy(file_size_limit=100)) as j:
            j.start(rid)
            info = j.store.put(torch.full((4, 4), float(s)))
            j.flush(rid, 0, token_range=(0, 16), info=info).result()
            keys[rid] = info.key
            if rid == "moved":
                j.handoff(rid, "engine-b")
            elif rid == "done":
                j.end(rid)
    with Journal.open(path) as j:
        j.start("newest")
        info = j.store.put(torch.full((4, 4), 9.0))
        j.flush("newest", 0, token_range=(0, 16), info=info).result()
        keys["newest"] = info.key
        j.sync()
    return keys


def test_compaction_reads_each_record_once_and_its_dry_run_says_what_it_collects(tmp_path, monkeypatch):
    """One pass: compaction decodes each record of the journal once (the sealed logs for the
    snapshot, then only the log after them for the segments still referenced, not the whole
    journal again), and collects exactly what its dry run said: the blocks of the ended and
    of the moved request, which the snapshot no longer holds."""
    path = str(tmp_path / "j")
    keys = _moved_and_live(path)
    assert len(list_logs(path)) > 2
    later = time.time() + 7200
    dry = compact(path, grace=3600, now=later, dry_run=True)
    decoded = []
    from kvj.journal import reader

    for name in ("decode_fields", "decode_payload"):
        real = getattr(reader, name)
        monkeypatch.setattr(reader, name, lambda rtype, data, real=real: decoded.append(data) or real(rtype, data))
    done = compact(path, grace=3600, now=later)
    monkeypatch.undo()
    assert sorted(done.segments_removed) == sorted(dry.segments_removed) == sorted([keys["moved"], keys["done"]])
    state = replay(path)
    assert set(state.requests) == {"live", "newest"}
    assert len(decoded) == state.last_lsn, f"{len(decoded)} decodes for {state.last_lsn} records"
