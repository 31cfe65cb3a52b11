"""The writer's group commit, backpressure, locking and failure behaviour."""

import errno
import os
import subprocess
import sys
import threading
import time

import pytest
from support.wait import wait_for

import kvj
from kvj.errors import FormatError, JournalFailed, JournalLocked
from kvj.fileio import FS
from kvj.journal import framing as F
from kvj.journal.journal import Journal
from kvj.journal.reader import Scan, list_logs
from kvj.journal.records import RecordType
from kvj.journal.config import MAX_COUNT, MAX_DELAY, CommitPolicy


class SlowSyncFS(FS):
    """fdatasync takes ``delay`` seconds and can be held on an event; counts calls."""

    def __init__(self, delay=0.0):
        self.delay, self.calls, self.gate = delay, 0, threading.Event()
        self.gate.set()

    def fdatasync(self, fd):
        self.calls += 1
        self.gate.wait()
        time.sleep(self.delay)
        super().fdatasync(fd)


class FailingSyncFS(FS):
    def __init__(self, fail_on_call):
        self.fail_on_call, self.calls = fail_on_call, 0

    def fdatasync(self, fd):
        self.calls += 1
        if self.calls >= self.fail_on_call:
            raise OSError(errno.EIO, "injected EIO")
        super().fdatasync(fd)


def group_sizes(path):
    sizes = []
    for log in list_logs(str(path)):
        data = open(log, "rb").read()
        off, salt = F.FILE_HEADER_SIZE, F.decode_file_header(data).salt
        while off < len(data):
            records, off = F.parse_group(data, off, log, salt)
            sizes.append(len(records))
    return sizes


def test_sync_makes_everything_before_it_durable(tmp_path):
    with Journal.open(tmp_path) as j:
        lsns = [j.alloc("cuda:0", i, 1) for i in range(1000)]
        assert j.sync() == lsns[-1]
        assert j.durable_lsn >= lsns[-1]
    assert kvj.replay(str(tmp_path)).last_lsn == 1000


def test_durable_append_waits_for_its_own_record(tmp_path):
    fs = SlowSyncFS(delay=0.05)
    with Journal.open(tmp_path, fs=fs, policy=CommitPolicy(max_delay=30)) as j:
        lsn = j.alloc("cuda:0", 1, 1, durable=True)
        assert j.durable_lsn >= lsn


def test_a_lone_record_is_committed_within_the_delay_bound(tmp_path):
    with Journal.open(tmp_path, policy=CommitPolicy(max_delay=0.5, max_records=1000)) as j:
        lsn = j.alloc("cuda:0", 1, 1)
        # the committer took note of the record and waits out max_delay for company (a condition, not a time)
        wait_for(lambda: j.writer._wake._waiters and j.writer._count == 1, "the committer to wait for company")
        assert j.durable_lsn < lsn
        deadline = time.monotonic() + 5
        while j.durable_lsn < lsn and time.monotonic() < deadline:
            time.sleep(0.01)
        assert j.durable_lsn >= lsn


def test_the_record_count_bound_triggers_a_commit(tmp_path):
    with Journal.open(tmp_path, policy=CommitPolicy(max_delay=60, max_records=50)) as j:
        for i in range(50):
            last = j.alloc("cuda:0", i, 1)
        deadline = time.monotonic() + 5
        while j.durable_lsn < last and time.monotonic() < deadline:
            time.sleep(0.01)
        assert j.durable_lsn == last


def test_groups_take_whatever_accumulated_during_the_previous_fsync(tmp_path):
    fs = SlowSyncFS(delay=0.02)
    with Journal.open(tmp_path, fs=fs) as j:
        for i in range(20000):
            j.alloc("cuda:0", i, 1)
        j.sync()
    sizes = group_sizes(tmp_path)
    assert sum(sizes) == 20000
    assert max(sizes) > 1000  # not capped at 100 records per fsync
    assert len(sizes) < 200


def test_a_full_buffer_blocks_append_instead_of_growing(tmp_path):
    fs = SlowSyncFS()
    policy = CommitPolicy(max_buffer_bytes=4096, max_records=1)
    j = Journal.open(tmp_path, fs=fs, policy=policy)
    fs.gate.clear()  # the disk stalls
    done = threading.Event()
    peak = []

    def producer():
        for i in range(500):
            j.alloc("cuda:0", i, 1, "x" * 40)
            peak.append(len(j.writer._buf))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    # the producer ends up waiting for room (the stalled disk never makes any): a condition, not a time
    wait_for(lambda: j.writer._done._waiters, "the producer to wait for room in the buffer")
    assert not done.is_set()  # blocked by backpressure
    assert max(peak) < 4096 + 200
    fs.gate.set()
    t.join(10)
    assert done.is_set()
    j.close()
    assert kvj.replay(str(tmp_path)).last_lsn == 500


def test_second_writer_in_process_is_refused_naming_the_pid(tmp_path):
    with Journal.open(tmp_path):
        with pytest.raises(JournalLocked) as info:
            Journal.open(tmp_path)
        assert info.value.pid == os.getpid()
        assert str(os.getpid()) in str(info.value)
    Journal.open(tmp_path).close()  # released on close


def test_second_writer_in_another_process_is_refused_naming_its_pid(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from kvj import Journal\n"
        f"j = Journal.open({str(tmp_path)!r}); print('ready', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(JournalLocked, match=f"pid {child.pid}"):
            Journal.open(tmp_path)
    finally:
        child.kill()
        child.wait()
    Journal.open(tmp_path).close()  # the kernel dropped the dead writer's lock


def test_failed_fsync_is_final_and_never_retried(tmp_path):
    with Journal.open(tmp_path) as j:
        j.alloc("cuda:0", 0, 1, durable=True)
    fs = FailingSyncFS(fail_on_call=2)
    j = Journal.open(tmp_path, fs=fs)
    first = j.alloc("cuda:0", 1, 1, durable=True)  # fdatasync #1 succeeds
    j.alloc("cuda:0", 2, 1)
    waiters_errors = []

    def waiter():
        try:
            j.sync()
        except JournalFailed as exc:
            waiters_errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(waiters_errors) == 3
    with pytest.raises(JournalFailed):
        j.alloc("cuda:0", 3, 1)
    assert j.durable_lsn == first  # nothing after the failure is reported durable
    with pytest.raises(JournalFailed):
        j.close()
    assert fs.calls == 2  # the failed fdatasync was not retried
    state = kvj.replay(str(tmp_path))
    assert sorted(state.allocations["cuda:0"])[:2] == [0, 1]


def test_files_are_owner_only(tmp_path):
    path = tmp_path / "j"
    with Journal.open(path) as j:
        j.alloc("cuda:0", 0, 1)
    assert os.stat(path).st_mode & 0o777 == 0o700
    for log in list_logs(str(path)):
        assert os.stat(log).st_mode & 0o777 == 0o600


def test_a_failed_segment_flush_makes_sync_and_close_fail(tmp_path):
    import torch

    class NoSegmentFsync(FS):
        def fsync(self, fd):
            if "segments" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.EIO, "injected EIO on a segment")
            super().fsync(fd)

    j = Journal.open(tmp_path / "j", fs=NoSegmentFsync())
    j.start("r")
    future = j.flush("r", 0, torch.arange(64, dtype=torch.float32), token_range=(0, 16))
    with pytest.raises(JournalFailed):
        future.result(10)
    for _ in range(2):
        with pytest.raises(JournalFailed, match="segment flush failed"):
            j.sync()
    with pytest.raises(JournalFailed):
        j.close()
    assert not kvj.replay(str(tmp_path / "j")).counts.get("segment")


def test_a_failed_segment_write_fails_its_own_flush_future_with_journal_failed(tmp_path):
    """Issue 9 item 7: a durability failure always surfaces as JournalFailed, the failing
    flush's own future included (it used to raise the flusher's DurabilityError)."""
    import torch

    class NoSegmentWrite(FS):
        def write(self, fd, data):
            if "segments" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, "injected ENOSPC on a segment")
            super().write(fd, data)

    j = Journal.open(tmp_path / "j", fs=NoSegmentWrite())
    j.start("r")
    j.alloc("cuda:0", 0, 1)
    before = j.writer.last_lsn
    future = j.flush("r", 0, torch.arange(64, dtype=torch.float32), token_range=(0, 16))
    with pytest.raises(JournalFailed, match="segment flush failed") as failed:
        future.result(10)
    assert isinstance(failed.value.__cause__, OSError)
    with pytest.raises(JournalFailed):
        j.flush("r", 1, torch.arange(64, dtype=torch.float32), token_range=(16, 32))
    assert j.writer.last_lsn == before  # nothing appended after the failure
    with pytest.raises(JournalFailed):
        j.close()
    assert not kvj.replay(str(tmp_path / "j")).counts.get("segment")


def test_what_a_crash_can_lose_is_capped_however_slow_fsync_gets(tmp_path):
    """Issue 9 item 14: with a slow fdatasync, groups used to grow to thousands of records, all
    at risk. Now at most ``max_pending_records`` are appended but not durable: append waits."""
    fs = SlowSyncFS()
    policy = CommitPolicy(max_pending_records=50)
    with Journal.open(tmp_path, policy=policy, fs=fs) as j:
        fs.gate.clear()
        j.alloc("cuda:0", 0, 1)
        wait_for(lambda: fs.calls >= 1, "the first group's fdatasync")
        appender = threading.Thread(target=lambda: [j.alloc("cuda:0", i, 1) for i in range(1, 500)])
        appender.start()
        w = j.writer
        wait_for(lambda: w.last_lsn - w.durable_lsn == 50, "append to stop at the cap")
        assert appender.is_alive() and w.durable_lsn == 0  # held by the cap, not by an error
        fs.gate.set()
        appender.join(60)
        assert j.sync() == 500
    assert max(group_sizes(tmp_path)) <= 50
    fs = SlowSyncFS(delay=0.02)  # a slow disk under a steady writer: no group beyond the cap either
    with Journal.open(tmp_path / "slow", policy=policy, fs=fs) as j:
        for i in range(600):
            j.alloc("cuda:0", i, 1)
    assert max(group_sizes(tmp_path / "slow")) <= 50 and sum(group_sizes(tmp_path / "slow")) == 600


def alloc(addr):
    return RecordType.ALLOC, {"device": "cuda:0", "addr": addr, "size": 1, "tag": ""}


def test_append_many_checks_every_record_first_then_appends_them_in_order(tmp_path):
    with Journal.open(tmp_path) as j:
        j.start("r0")
        with pytest.raises(FormatError):
            j.append_many([alloc(1), alloc(2), (RecordType.FREE, {"device": "cuda:0", "addr": "x"})])
        assert j.sync() == 1  # a bad record anywhere in the batch: none of it appended
        assert j.append_many([alloc(i) for i in range(5)], durable=True) == [2, 3, 4, 5, 6]
        assert j.durable_lsn >= 6
        assert j.append_many([]) == []
    recs = list(Scan(str(tmp_path)).records())
    assert [(r.lsn, r.payload.get("addr")) for r in recs] == [(1, None)] + [(i + 2, i) for i in range(5)]


def test_append_many_waits_at_the_cap_on_what_a_crash_can_lose(tmp_path):
    """A batch larger than ``max_pending_records`` is not one unbounded group: it waits at the cap."""
    fs = SlowSyncFS()
    with Journal.open(tmp_path, policy=CommitPolicy(max_pending_records=50), fs=fs) as j:
        fs.gate.clear()
        j.alloc("cuda:0", 0, 1)
        wait_for(lambda: fs.calls >= 1, "the first group's fdatasync")
        batch = threading.Thread(target=lambda: j.append_many([alloc(i) for i in range(1, 301)]))
        batch.start()
        w = j.writer
        wait_for(lambda: w.last_lsn - w.durable_lsn == 50, "the batch to stop at the cap")
        assert batch.is_alive() and w.durable_lsn == 0
        fs.gate.set()
        batch.join(60)
        assert j.sync() == 301
    assert max(group_sizes(tmp_path)) <= 50
    assert [r.payload["addr"] for r in Scan(str(tmp_path)).records()] == list(range(301))


@pytest.mark.parametrize("field, value", [
    ("max_buffer_bytes", 0), ("max_buffer_bytes", -1), ("max_records", 0), ("max_pending_records", 0),
    ("file_size_limit", 0), ("max_delay", -0.1), ("max_delay", float("nan")), ("max_delay", float("inf")),
    ("max_records", 2.5), ("max_records", True), ("max_delay", "100ms"), ("file_size_limit", None),
    ("max_group_records", 0), ("max_group_records", 1.5),
    # past a day: 20000 weeks overflowed the committer's timed wait (threading.TIMEOUT_MAX) and killed it
    ("max_delay", 20000 * 7 * 86400.0), ("max_delay", MAX_DELAY + 1), ("file_size_limit", 1 << 63),
    ("max_records", 1 << 70)])
def test_a_commit_policy_that_cannot_work_is_refused_where_it_is_made(tmp_path, field, value):
    # max_buffer_bytes=0 used to block the first start() for ever: refused when the policy is made
    with pytest.raises(kvj.InvalidArgument, match=field):
        CommitPolicy(**{field: value})
    assert not os.listdir(tmp_path)


def test_the_smallest_commit_policy_values_work(tmp_path):
    policy = CommitPolicy(max_delay=0, max_records=1, max_buffer_bytes=1, max_pending_records=1, file_size_limit=1)
    with Journal.open(tmp_path, policy=policy) as j:
        for i in range(5):
            j.alloc("cuda:0", i, 64)
        assert j.sync() == 5


def test_the_largest_commit_policy_values_work(tmp_path):
    policy = CommitPolicy(max_delay=MAX_DELAY, max_records=MAX_COUNT, max_buffer_bytes=MAX_COUNT,
                          max_pending_records=MAX_COUNT, file_size_limit=MAX_COUNT, max_group_records=MAX_COUNT)
    with Journal.open(tmp_path, policy=policy) as j:
        j.start("r1")  # the committer waits up to a day for more: sync asks it to commit now
        assert j.sync() == 1
        assert j.writer.failed is None


class UserError(Exception):
    pass


def test_an_exception_in_the_with_block_is_not_replaced_by_a_failing_close(tmp_path):
    with Journal.open(tmp_path) as j:
        j.alloc("cuda:0", 0, 1, durable=True)
    with pytest.raises(UserError) as caught:
        with Journal.open(tmp_path, fs=FailingSyncFS(fail_on_call=1)) as j:
            j.alloc("cuda:0", 1, 1)  # its group's fdatasync fails: close() raises JournalFailed
            raise UserError("the caller's own failure")
    assert str(caught.value) == "the caller's own failure"  # the user's traceback, not close()'s
    assert any("closing the journal failed too: JournalFailed" in n for n in getattr(caught.value, "__notes__", []))
    with pytest.raises(JournalFailed):  # without an exception in the block, close()'s failure is raised
        with Journal.open(tmp_path, fs=FailingSyncFS(fail_on_call=1)) as j:
            j.alloc("cuda:0", 2, 1)


def test_max_group_records_caps_each_group_while_the_next_fills(tmp_path):
    """``max_group_records``: no group holds more, though more is pending (the 150 records
    appended behind a held fdatasync fill a group to the cap), and the next group fills while
    one is synced: appends go on during the fdatasync in flight."""
    fs = SlowSyncFS()
    policy = CommitPolicy(max_group_records=100, max_pending_records=250)
    with Journal.open(tmp_path, policy=policy, fs=fs) as j:
        fs.gate.clear()  # the first group's fdatasync is held
        for i in range(150):
            j.writer.append(RecordType.ALLOC, kvj.journal.records.encode(*alloc(i)))
        wait_for(lambda: fs.calls >= 1, "the first group's fdatasync")
        assert j.writer.durable_lsn == 0 and j.writer.last_lsn == 150  # appended while it is in flight
        fs.gate.set()
        for i in range(150, 1234):
            j.append(*alloc(i))
        assert j.sync() == 1234
    sizes = group_sizes(tmp_path)
    # no group above the cap, and the 150 records pending behind the held fdatasync filled one to
    # it (later groups may hold fewer: on a loaded machine the appender can fall behind the writer)
    assert max(sizes) == 100 and sum(sizes) == 1234, sizes
    assert [r.payload["addr"] for r in Scan(str(tmp_path)).records()] == list(range(1234))


def test_max_group_records_and_the_buffer_bound_hold_together(tmp_path):
    """Sealed groups count toward ``max_buffer_bytes``: with the disk stalled, append blocks
    once the sealed groups and the buffer reach it, and everything is written once it resumes."""
    fs = SlowSyncFS()
    policy = CommitPolicy(max_group_records=5, max_buffer_bytes=4096, max_pending_records=10_000)
    j = Journal.open(tmp_path, fs=fs, policy=policy)
    fs.gate.clear()
    done = threading.Event()
    appended = []

    def producer():
        for i in range(400):
            j.alloc("cuda:0", i, 1, "x" * 40)
            appended.append(i)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    wait_for(lambda: len(appended) > 20, "the first groups to be sealed")
    w = j.writer
    wait_for(lambda: len(w._buf) >= w._max_buffer, "append to reach the buffer bound (its next call waits)")
    assert not done.is_set()
    assert w._sealed_bytes + len(w._buf) < 4096 + 400  # at most one record past the bound
    fs.gate.set()
    t.join(30)
    assert done.is_set()
    j.close()
    assert kvj.replay(str(tmp_path)).last_lsn == 400 and max(group_sizes(tmp_path)) == 5
