"""Disk errors: ENOSPC and EIO on write and on fsync, transient and persistent.

The contract (fsyncgate, ATC'20 "Can Applications Recover from fsync Failures?"): the
first failed write or fsync puts the writer into a failed state; every ``sync()`` waiter
and every later call gets ``JournalFailed``; nothing after the failure is reported
durable; fsync is never retried; everything acknowledged before it survives a power
loss (checked on crash states built from the recorded I/O).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import zlib
from typing import List, Optional, Tuple

import pytest
from support.crashcheck import Truth, add_figure, check_journal, random_record
from support.crashfs import FAST_FS, FIXED_PLANS, Fault, FaultFS, RecordingFS, crash_state, random_plans
from support.wait import wait_for

from kvj import CommitPolicy, Journal
from kvj.errors import JournalFailed, KvjError
from kvj.fileio import FS
from kvj.journal.writer import log_name
from kvj.journal.reader import list_logs, log_seq
from kvj.journal.replay import RecordStream

ERRNOS = [errno.ENOSPC, errno.EIO]
DETERMINISTIC = dict(max_delay=3600.0, max_records=1 << 30)


def setup(tmp_path, policy: Optional[CommitPolicy] = None) -> Tuple[FaultFS, RecordingFS, str, Journal, Truth]:
    """A journal on FaultFS(RecordingFS): faults can be armed later, crash states built."""
    rec = RecordingFS(str(tmp_path / "root"))
    fs = FaultFS([], inner=rec)
    path = os.path.join(rec.root, "j")
    j = Journal.open(path, fs=fs, policy=policy or CommitPolicy(**DETERMINISTIC))
    return fs, rec, path, j, Truth()


def append(j: Journal, truth: Truth, rng: random.Random, durable: bool = False) -> int:
    rtype, payload = random_record(rng)
    lsn = j.writer.append(rtype, payload, durable)
    truth.add(lsn, rtype, payload)
    return lsn


def stable_seed(*params: object) -> int:
    """A seed that is the same in every process for the same parameters (``hash()`` is not)."""
    return zlib.crc32(repr(params).encode()) & 0xFFFF


def durable_prefix(j: Journal, rec: RecordingFS, truth: Truth, rng: random.Random, groups: int = 3) -> int:
    """Append and sync a few groups; returns the acknowledged LSN."""
    for _ in range(groups):
        for _ in range(rng.randrange(1, 6)):
            append(j, truth, rng)
        lsn = j.sync()
        truth.ack(lsn)
        rec.note(("acked", lsn))
    return truth.acked


def check_after_failure(fs: FaultFS, rec: RecordingFS, path: str, truth: Truth, tmp_path, seed: int) -> int:
    """Power loss after the failure, in the states the model allows: every acknowledged
    record replays and nothing else appears; then the real (page-cache) state recovers too."""
    rng = random.Random(seed)
    rel = os.path.relpath(path, rec.root)
    n = 0
    for i, plan in enumerate(list(FIXED_PLANS) + random_plans(rng, 8)):
        dest = str(tmp_path / f"state-{i}")
        crash_state(rec, len(rec.ops), plan, dest)
        check_journal(os.path.join(dest, rel), truth, truth.acked, reopen_fs=FAST_FS, context=plan.name)
        n += 1
    add_figure("crash states checked", n)
    return n


def assert_no_retry(fs: FaultFS) -> None:
    """After the first injected failure: no fsync/fdatasync and no write to a log file."""
    later = fs.calls_after_first_failure(("fsync", "fdatasync", "write"))
    assert later == [], f"I/O after the failure (fsync retried or data written): {later}"


@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("err", ERRNOS, ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("op,partial", [("write", 0), ("write", 37), ("fdatasync", 0)],
                         ids=["write", "short-write", "fdatasync"])
def test_group_commit_failure(tmp_path, op, partial, err, persistent):
    """A failed group write/fdatasync: every waiter gets JournalFailed, nothing later is
    durable, fsync is not retried, and the acknowledged prefix survives power loss."""
    seed = stable_seed(op, partial, err, persistent)
    rng = random.Random(seed)
    fs, rec, path, j, truth = setup(tmp_path)
    acked = durable_prefix(j, rec, truth, rng)
    gate = threading.Event()
    fault = Fault(op, err, persistent=persistent, partial=partial, path_contains=".log", gate=gate)
    fs.faults.append(fault)
    results: List[object] = []

    def waiter(i: int) -> None:
        try:
            lsn = append(j, truth, random.Random(i))  # recorded in the truth before any wait
            if i % 2:
                j.sync()
            else:
                j.writer.wait_durable(lsn)  # what append(..., durable=True) does
            results.append(("durable", lsn))
        except JournalFailed as exc:
            results.append(exc)
        except BaseException as exc:  # pragma: no cover - reported by the assertion below
            results.append(("unexpected", exc))

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert fault.entered.wait(10), "the fault never fired"
    wait_for(lambda: len(results) + len(j.writer._done._waiters) == 8, "every waiter to queue up behind the failing commit")
    gate.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a sync() waiter hung after the writer failed"
    assert len(results) == 8
    assert all(isinstance(r, JournalFailed) for r in results), f"a waiter was not told of the failure: {results}"
    assert j.writer.failed is not None
    assert j.durable_lsn == acked, "something after the failure was reported durable"
    with pytest.raises(JournalFailed):
        j.alloc("cuda:0", 1, 1)
    with pytest.raises(JournalFailed):
        j.sync()
    with pytest.raises(JournalFailed):
        j.close()
    assert_no_retry(fs)
    if op == "fdatasync":
        syncs = [c for c in fs.calls if c.op in ("fsync", "fdatasync") and c.failed is not None]
        assert len(syncs) == 1, "fdatasync was attempted again after it failed"
    check_after_failure(fs, rec, path, truth, tmp_path, seed)
    # the disk recovers (or is replaced): the page-cache state opens and holds the acknowledged prefix
    check_journal(path, truth, acked, reopen_fs=FS())


@pytest.mark.parametrize("err", ERRNOS, ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("op", ["open", "write", "fsync", "fsync_dir"])
def test_rotation_failure(tmp_path, op, err):
    """Creating the next log file fails (open, header write, header fsync, directory
    fsync): the writer fails, the records before the rotation stay acknowledged."""
    rng = random.Random(stable_seed(op, err))
    fs, rec, path, j, truth = setup(tmp_path, CommitPolicy(file_size_limit=400, **DETERMINISTIC))
    durable_prefix(j, rec, truth, rng, groups=1)
    # the committer rotates after a group is durable: wait until no rotation is pending, so
    # the fault below targets the file the writer creates next, not one it already made
    wait_for(lambda: os.path.getsize(list_logs(path)[-1]) < 400, "the pending rotation")
    # fail the first matching call while creating the next log file
    next_log = log_name(log_seq(list_logs(path)[-1]) + 1)
    fault = Fault(op, err, path_contains=None if op == "fsync_dir" else next_log)
    fs.faults.append(fault)
    failed = False
    for _ in range(50):
        try:
            append(j, truth, rng)
            lsn = j.sync()
            truth.ack(lsn)
            rec.note(("acked", lsn))
        except JournalFailed:
            failed = True
            break
    assert failed and fault.fired == 1, "rotation never failed"
    assert j.durable_lsn == truth.acked
    with pytest.raises(JournalFailed):
        j.close()
    assert_no_retry(fs)
    check_after_failure(fs, rec, path, truth, tmp_path, 7)
    check_journal(path, truth, truth.acked, reopen_fs=FS())


def test_appenders_blocked_on_a_full_buffer_get_the_error(tmp_path):
    """Backpressure waiters (append blocked on a full buffer) are waiters too."""
    rng = random.Random(5)
    fs, rec, path, j, truth = setup(tmp_path, CommitPolicy(max_delay=0.001, max_records=4, max_buffer_bytes=2048))
    durable_prefix(j, rec, truth, rng, groups=1)
    gate = threading.Event()
    fault = Fault("fdatasync", errno.EIO, gate=gate, persistent=True)
    fs.faults.append(fault)
    outcome: List[object] = []

    def flood() -> None:
        try:
            for i in range(10_000):
                j.alloc("cuda:0", i, 1, tag="x" * 200)
            outcome.append("never blocked")
        except JournalFailed as exc:
            outcome.append(exc)

    t = threading.Thread(target=flood)
    t.start()
    assert fault.entered.wait(10)
    wait_for(lambda: j.writer._done._waiters or not t.is_alive(), "the flood to block or finish")
    assert t.is_alive(), "append did not block on the full buffer while the disk was stuck"
    gate.set()
    t.join(10)
    assert not t.is_alive() and isinstance(outcome[0], JournalFailed)
    with pytest.raises(JournalFailed):
        j.close()
    assert_no_retry(fs)


@pytest.mark.parametrize("err", ERRNOS, ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("op,path_part", [("mkdir", None), ("open", ".log"), ("write", ".log"),
                                          ("fsync", ".log"), ("fsync_dir", None)])
def test_open_failure_is_loud_and_releases_the_lock(tmp_path, op, path_part, err):
    """Journal.open on a failing disk raises (OSError or a KvjError), leaves no writer
    behind and releases the lock, so the next open (disk healthy again) succeeds."""
    path = str(tmp_path / "j")
    if op != "mkdir":
        with Journal.open(path) as j:
            j.alloc("cuda:0", 1, 1, durable=True)
    fs = FaultFS([Fault(op, err, path_contains=path_part)])
    committers = committer_threads()
    with pytest.raises((OSError, KvjError)):
        # the newest file is full, so the writer creates a new one (a clean one it would continue)
        Journal.open(path, fs=fs, policy=CommitPolicy(file_size_limit=1))
    assert fs.fired == 1
    assert committer_threads() == committers, "a failed open left a committer thread running"
    with Journal.open(path) as j:
        lsn = j.alloc("cuda:0", 2, 1, durable=True)
    assert [r.lsn for r in RecordStream(path)] == list(range(1, lsn + 1))


def committer_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvj-committer" and t.is_alive())


@pytest.mark.parametrize("err", ERRNOS, ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("op", ["write", "fsync", "rename", "ftruncate"])
def test_failure_while_cutting_a_torn_tail(tmp_path, op, err):
    """Recovery itself hits a disk error while setting a torn tail aside: open fails loudly
    and the journal is unchanged (nothing acknowledged lost, tail still cut-able later)."""
    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        for i in range(5):
            j.alloc("cuda:0", i, 1)
        last = j.sync()
    log = sorted(n for n in os.listdir(path) if n.endswith(".log"))[-1]
    with open(os.path.join(path, log), "ab") as f:
        f.write(b"KVJG" + os.urandom(300))  # a torn group
    before = open(os.path.join(path, log), "rb").read()
    fs = FaultFS([Fault(op, err)])
    with pytest.raises((OSError, KvjError)):
        Journal.open(path, fs=fs)
    assert fs.fired == 1
    if op != "ftruncate":
        assert open(os.path.join(path, log), "rb").read() == before, "a failed recovery changed the log"
    with Journal.open(path) as j:
        assert j.writer.last_lsn == last
        assert j.alloc("cuda:0", 99, 1, durable=True) == last + 1


# -- segment store and compaction --------------------------------------------------------------

def flush_setup(tmp_path):
    """A journal on FaultFS(RecordingFS) with one request started and one segment flushed."""
    import torch
    fs, rec, path, j, truth = setup(tmp_path)
    rid = "req-seg"
    payload = {"id": rid, "prompt_hash": None, "tokens": None, "meta": {}}
    truth.add(j.start(rid), 1, payload)
    flush_one(j, truth, rid, 0, torch.arange(512, dtype=torch.float32).reshape(8, 64))
    truth.ack(j.sync())
    rec.note(("acked", truth.acked))
    return fs, rec, path, j, truth, rid


def flush_one(j: Journal, truth: Truth, rid: str, seg: int, tensor) -> int:
    """Flush ``tensor`` as segment ``seg`` and record it in the truth."""
    layout = {"model": "io"}
    lsn = j.flush(rid, seg, tensor, token_range=(16 * seg, 16 * seg + 16), layout=layout).result(30)
    info = j.store.info(j.store.key_for(tensor, layout))
    truth.tensors[info.key] = tensor
    truth.add(lsn, 2, {"id": rid, "seg": seg, "key": info.key, "tokens": [16 * seg, 16 * seg + 16],
                       "layout": dict(info.layout or {}), "raw_size": info.raw_size, "stored_size": info.stored_size,
                       "digest": info.digest, "codec": info.codec})
    return lsn


@pytest.mark.parametrize("err", ERRNOS, ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("op,where", [("write", ".tmp"), ("fsync", ".tmp"), ("rename", ".kvjseg"),
                                      ("fsync_dir", "objects"), ("mkdir", "objects")])
def test_segment_write_failure(tmp_path, op, where, err):
    """A segment that cannot be made durable is never journaled: its flush fails loudly,
    later flushes fail too (the store does not retry fsync), no record points at it, and
    after a power loss every journaled segment restores bit-exactly."""
    import torch
    fs, rec, path, j, truth, rid = flush_setup(tmp_path)
    records_before = dict(truth.records)
    fs.faults.append(Fault(op, err, path_contains=where))
    tensor = torch.full((8, 64), 7.0)
    fut = j.flush(rid, 1, tensor, token_range=(16, 32), layout={"model": "io"})
    with pytest.raises((OSError, KvjError)):
        fut.result(30)
    assert fs.fired == 1
    with pytest.raises((OSError, KvjError)):
        j.flush(rid, 2, torch.zeros(4, 4), token_range=(32, 48)).result(30)
    # the journal failed as a whole: nothing after the failure is reported durable
    for record in (lambda: j.start("later", durable=True), lambda: j.end(rid, durable=True), j.sync):
        with pytest.raises(JournalFailed):
            record()
    try:
        j.close()
    except (OSError, KvjError):
        pass
    retried = [c for c in fs.calls_after_first_failure() if "segments" in (c.path or "")]
    assert not retried, f"segment I/O was retried after the failure: {retried}"
    # no record may point at the failed segment: check_journal rejects any record not in
    # the truth, and the truth only holds flushes whose future succeeded
    assert truth.records == records_before
    check_after_failure(fs, rec, path, truth, tmp_path, 11)
    check_journal(path, truth, truth.acked, reopen_fs=FS())


@pytest.mark.parametrize("err", ERRNOS, ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("op", ["write", "fsync", "rename", "fsync_dir", "unlink"])
def test_compaction_failure_leaves_a_replayable_journal(tmp_path, op, err):
    """Compaction hits a disk error (writing the snapshot, or deleting logs): it raises,
    and the journal still replays every acknowledged record, before and after a power loss."""
    from kvj.ops.compact import compact
    rng = random.Random(stable_seed(op, err))
    fs, rec, path, j, truth = setup(tmp_path, CommitPolicy(file_size_limit=500, **DETERMINISTIC))
    durable_prefix(j, rec, truth, rng, groups=8)
    while len(list_logs(path)) < 3:  # compaction needs sealed logs to fold, or it writes nothing
        durable_prefix(j, rec, truth, rng, groups=1)
    fault = Fault(op, err, path_contains=None if op in ("fsync_dir",) else ("snap" if op != "unlink" else ".log"))
    # The fault is compaction's alone: the writer, still open on ``fs``, may rotate to a new log
    # file meanwhile, and its directory fsync must not take the compactor's fault.
    with pytest.raises((OSError, KvjError)):
        compact(path, fs=FaultFS([fault], inner=rec))
    assert fault.fired == 1
    append(j, truth, rng)
    truth.ack(j.sync())  # the writer does not care
    rec.note(("acked", truth.acked))
    j.close()
    check_after_failure(fs, rec, path, truth, tmp_path, 13)
    check_journal(path, truth, truth.acked, reopen_fs=FS())
