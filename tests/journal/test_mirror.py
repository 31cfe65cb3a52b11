"""Issue 11 item 1: the synchronous mirror. Every group is written and fdatasynced to both
copies before it is acknowledged; replay, fsck and recover take each group from whichever
copy holds it intact and say which copy was bad; a failing mirror fails the writer (policy
fail) or is dropped with a logged warning (policy degrade)."""

import errno
import logging
import os
import random
import shutil

import pytest
from support.crashcheck import Truth, check_journal, random_record
from support.crashfs import FAST_FS, FIXED_PLANS, Fault, FaultFS, RecordingFS, iter_crash_states, random_plans

import kvj
from kvj.errors import FormatError, InvalidArgument, JournalFailed
from kvj.fileio import DurabilityError
from kvj.journal import framing as F
from kvj.journal.journal import Journal
from kvj.journal.mirror import MIRROR_NAME, mirror_of
from kvj.journal.reader import COPY, Scan, list_logs
from kvj.journal.records import RecordType
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.ops.fsck import fsck
from kvj.ops.recover import recover

SMALL = CommitPolicy(file_size_limit=2000)


def alloc(i):
    return {"device": "cuda:0", "addr": i, "size": 1, "tag": "t" * 30}


def write(path, mirror=None, n=60, start=0, **kw):
    """Append ``n`` allocs one durable group each; returns the LSNs acknowledged."""
    with Journal.open(path, mirror=mirror, policy=SMALL, **kw) as j:
        return [j.append(RecordType.ALLOC, alloc(i), durable=True) for i in range(start, start + n)]


def addrs(path, alone=False):
    """The allocs replayed from ``path`` (with ``alone``, from that copy only, not its mirror)."""
    return [r.payload["addr"] for r in Scan(str(path), mirror=not alone).records() if r.rtype == RecordType.ALLOC]


def groups(path):
    """(offset, end) of each commit group of a log file."""
    data = open(path, "rb").read()
    salt, off, out = F.decode_file_header(data).salt, F.FILE_HEADER_SIZE, []
    while off < len(data):
        _records, end = F.parse_group(data, off, path, salt)
        out.append((off, end))
        off = end
    return out


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def pair(tmp_path):
    return str(tmp_path / "j"), str(tmp_path / "m")


def test_both_copies_hold_the_same_bytes_and_name_each_other(pair):
    path, mirror = pair
    write(path, mirror)
    assert mirror_of(path) == mirror and mirror_of(mirror) == path
    names = [os.path.basename(p) for p in list_logs(path)]
    assert len(names) > 2 and names == [os.path.basename(p) for p in list_logs(mirror)]
    for name in names:
        assert open(os.path.join(path, name), "rb").read() == open(os.path.join(mirror, name), "rb").read()
    write(path, n=5, start=60)  # the journal remembers its mirror: no need to name it again
    for name in [os.path.basename(p) for p in list_logs(path)]:
        assert open(os.path.join(path, name), "rb").read() == open(os.path.join(mirror, name), "rb").read()
    assert addrs(path, alone=True) == addrs(mirror, alone=True) == list(range(65))  # each copy is a journal


def test_a_group_is_acknowledged_only_once_both_copies_are_synced(pair):
    path, mirror = pair
    fs = FaultFS()
    with Journal.open(path, mirror=mirror, fs=fs) as j:
        lsn = j.append(RecordType.ALLOC, alloc(0), durable=True)
        synced = [c.path for c in fs.calls if c.op == "fdatasync"]
    log = os.path.basename(list_logs(path)[-1])
    assert lsn == 1 and os.path.join(path, log) in synced and os.path.join(mirror, log) in synced


@pytest.mark.parametrize("bad", ["journal", "mirror"])
def test_a_damaged_group_in_one_copy_is_read_from_the_other(pair, bad):
    path, mirror = pair
    acked = write(path, mirror)
    victim_dir = path if bad == "journal" else mirror
    log = list_logs(victim_dir)[1]
    start, end = groups(log)[2]
    flip(log, start + (end - start) // 2)
    state = kvj.replay(path)
    assert state.last_lsn == acked[-1] and addrs(path) == list(range(60))
    if bad == "journal":  # replay reads the mirror only where the journal's copy fails, and says so
        assert any(log in w and "damaged" in w for w in state.warnings), state.warnings
    else:
        assert state.warnings == []
        with pytest.raises(kvj.CorruptionError):
            addrs(mirror, alone=True)  # the mirror's copy alone is damaged
    result = fsck(path)
    copy = [f for f in result.findings if f.kind == "mirror-copy"]
    assert [(f.path, f.offset, f.severity) for f in copy] == [(log, start, "warning")], result.findings
    assert result.exit_code == 0 and not result.errors
    rec = recover(path)
    assert rec.manifest["recovered_lsn"] == acked[-1]
    assert addrs(path)[:60] == list(range(60))


def test_damage_in_every_copy_is_corruption(pair):
    path, mirror = pair
    write(path, mirror)
    for d in (path, mirror):
        log = list_logs(d)[1]
        start, end = groups(log)[1]
        flip(log, start + 30)
    with pytest.raises(kvj.CorruptionError, match="every copy"):
        kvj.replay(path)


@pytest.mark.parametrize("bad", ["journal", "mirror"])
def test_a_deleted_log_file_copy_is_read_from_the_other_and_restored_by_the_next_writer(pair, bad):
    path, mirror = pair
    acked = write(path, mirror)
    victim = list_logs(path if bad == "journal" else mirror)[1]
    os.unlink(victim)
    state = kvj.replay(path)
    assert state.last_lsn == acked[-1] and addrs(path) == list(range(60))
    if bad == "journal":
        assert any(victim in w and "missing" in w for w in state.warnings), state.warnings
    assert any(f.kind == "mirror-copy" and f.path == victim for f in fsck(path).findings)
    rec = recover(path)  # the writer it opens gives the copy back
    assert rec.manifest["recovered_lsn"] == acked[-1] and os.path.exists(victim)
    assert not [f for f in fsck(path).findings if f.kind == "mirror-copy"]


def test_the_journals_own_copy_lost_entirely_reads_from_the_mirror(pair):
    path, mirror = pair
    acked = write(path, mirror)
    for log in list_logs(path):
        os.unlink(log)
    assert kvj.replay(path).last_lsn == acked[-1] and addrs(path) == list(range(60))
    assert kvj.replay(mirror).last_lsn == acked[-1]  # the mirror alone is a journal
    recover(path)
    assert [os.path.basename(p) for p in list_logs(path)] == [os.path.basename(p) for p in list_logs(mirror)]
    assert not [f for f in fsck(path).findings if f.kind == "mirror-copy"]


def test_a_lost_mirror_directory_fails_the_writer_until_it_is_named_again(pair, caplog):
    path, mirror = pair
    acked = write(path, mirror)
    shutil.rmtree(mirror)
    assert kvj.replay(path).last_lsn == acked[-1]  # readers go on with the journal's copy
    with pytest.raises(InvalidArgument, match="missing or does not name it back"):
        Journal.open(path)
    with caplog.at_level(logging.WARNING, logger="kvj"):
        assert write(path, n=1, start=60, mirror_policy="degrade") == [acked[-1] + 1]
    assert "mirror policy degrade" in caplog.text
    write(path, mirror, n=1, start=61)  # named again: rebuilt from the journal's copy
    assert addrs(mirror) == list(range(62)) and mirror_of(path) == mirror


def test_a_mirror_must_start_empty_and_cannot_serve_two_journals(tmp_path):
    write(str(tmp_path / "other"), n=2)
    with pytest.raises(InvalidArgument, match="journal files of its own"):
        Journal.open(str(tmp_path / "j"), mirror=str(tmp_path / "other"))
    write(str(tmp_path / "a"), str(tmp_path / "m"), n=2)
    with pytest.raises(InvalidArgument, match="is the mirror of"):
        Journal.open(str(tmp_path / "b"), mirror=str(tmp_path / "m"))
    with pytest.raises(InvalidArgument, match="is mirrored to"):
        Journal.open(str(tmp_path / "a"), mirror=str(tmp_path / "m2"))
    with pytest.raises(InvalidArgument, match="policy"):
        Journal.open(str(tmp_path / "a"), mirror_policy="sometimes")


def test_a_one_sided_pointer_is_ignored(tmp_path):
    """A planted MIRROR file that the other directory does not return sends kvj nowhere."""
    path, elsewhere = str(tmp_path / "j"), tmp_path / "elsewhere"
    write(path, n=2)
    elsewhere.mkdir()
    (tmp_path / "j" / MIRROR_NAME).write_text(f"{elsewhere}\n")
    assert mirror_of(path) is None and kvj.replay(path).last_lsn == 2
    with pytest.raises(InvalidArgument):
        Journal.open(path)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("op", ["write", "fdatasync"])
def test_a_failing_mirror_fails_the_writer_under_policy_fail(pair, op):
    path, mirror = pair
    fs = FaultFS([Fault(op, after=8, persistent=True, path_contains=os.sep + "m" + os.sep)])
    j = Journal.open(path, mirror=mirror, fs=fs, policy=SMALL)
    acked = []
    with pytest.raises(JournalFailed, match="mirror"):
        for i in range(50):
            acked.append(j.append(RecordType.ALLOC, alloc(i), durable=True))
    with pytest.raises(JournalFailed):
        j.close()
    assert fs.fired and acked and len(acked) < 50
    for d in (path, mirror):  # everything acknowledged is in each copy on its own
        assert addrs(d, alone=True)[:len(acked)] == list(range(len(acked)))


def test_a_failing_mirror_is_dropped_with_a_warning_under_policy_degrade(pair, caplog):
    path, mirror = pair
    fs = FaultFS([Fault("fdatasync", after=3, path_contains=os.sep + "m" + os.sep)])
    with caplog.at_level(logging.WARNING, logger="kvj"):
        with Journal.open(path, mirror=mirror, fs=fs, policy=SMALL, mirror_policy="degrade") as j:
            lsns = [j.append(RecordType.ALLOC, alloc(i), durable=True) for i in range(40)]
            assert j.mirror is None and isinstance(j.mirror_error, OSError)
    assert "journal mirror" in caplog.text and "degrade" in caplog.text
    assert lsns == list(range(1, 41)) and addrs(path) == list(range(40))
    assert len(addrs(mirror, alone=True)) < 40 and addrs(mirror) == list(range(40))  # the mirror's copy lags ...
    assert [f for f in fsck(path).findings if f.kind == "mirror-copy"]  # ... and fsck says so
    write(path, n=1, start=40)  # the next writer restores the mirror's missing files
    assert addrs(path) == list(range(41))


def test_a_mirror_that_cannot_be_created_fails_or_degrades_at_open(tmp_path, caplog):
    path, mirror = str(tmp_path / "j"), str(tmp_path / "m")
    fs = FaultFS([Fault("mkdir", err=errno.EROFS, persistent=True, path_contains=os.sep + "m")])
    with pytest.raises(DurabilityError, match="mirror"):
        Journal.open(path, mirror=mirror, fs=fs)
    with caplog.at_level(logging.WARNING, logger="kvj"):
        with Journal.open(path, mirror=mirror, fs=fs, mirror_policy="degrade") as j:
            assert j.append(RecordType.ALLOC, alloc(0), durable=True) == 1 and j.mirror is None
    assert "degrade" in caplog.text and not os.path.exists(mirror)


def test_compaction_snapshots_into_both_copies_and_the_mirror_drops_what_it_covers(pair):
    path, mirror = pair
    acked = write(path, mirror, n=80)
    result = compact(path, grace=0.0)
    assert result.snapshot and result.logs_removed
    name = os.path.basename(result.snapshot)
    assert os.path.exists(os.path.join(mirror, name))
    assert [os.path.basename(p) for p in list_logs(mirror)] == [os.path.basename(p) for p in list_logs(path)]
    os.unlink(result.snapshot)  # the journal's snapshot lost: the mirror's copy stands in
    state = kvj.replay(path)
    assert state.last_lsn == acked[-1] and state.snapshot_lsn == result.snapshot_lsn
    assert f"snapshot {name} is missing from {path}; {os.path.join(mirror, name)} was used" in state.warnings
    assert kvj.replay(mirror).last_lsn == acked[-1]
    write(path, n=1, start=80)
    assert os.path.exists(os.path.join(path, name))  # the next writer gave it back


def test_without_a_mirror_nothing_changes(tmp_path):
    path = str(tmp_path / "j")
    write(path, n=5)
    assert not os.path.exists(os.path.join(path, MIRROR_NAME))
    scan = Scan(path)
    assert list(scan) and scan.mirror is None and scan.copies == []
    with pytest.raises(FormatError):
        Scan(str(tmp_path / "nothing"))
    assert COPY == "copy"


# -- crash states ---------------------------------------------------------------------------

DETERMINISTIC = CommitPolicy(max_delay=3600.0, max_records=1 << 30, file_size_limit=1500)


def mirrored_workload(fs, path, mirror, rng, truth, steps):
    """Appends, syncs, durable appends, re-opens (the mirror named once, then remembered) and
    simulated kills on a mirrored journal; every acknowledgement is noted in the op log."""
    def ack(lsn):
        fs.note(("acked", lsn))
        truth.ack(lsn)

    def open_writer(first=False):
        j = Journal.open(path, mirror=mirror if first else None, fs=fs, policy=DETERMINISTIC)
        truth.resume(j.writer.last_lsn + 1)
        return j

    j = open_writer(first=True)
    for _ in range(steps):
        try:
            r = rng.random()
            if r < 0.55:
                rtype, payload = random_record(rng)
                truth.add(j.writer.append(rtype, payload), rtype, payload)
            elif r < 0.75:
                ack(j.sync())
            elif r < 0.85:
                rtype, payload = random_record(rng)
                lsn = j.writer.last_lsn + 1
                truth.add(lsn, rtype, payload)
                assert j.writer.append(rtype, payload, durable=True) == lsn
                ack(lsn)
            elif r < 0.93:
                j.close()
                ack(j.writer.last_lsn)
                j = open_writer()
            else:  # SIGKILL a few operations from now (often between the two copies' syncs)
                fs.kill_at = len(fs.ops) + rng.randrange(1, 6)
        except Exception:
            if not fs.killed:
                raise
        if fs.killed:
            try:
                j.close()
            except Exception:
                pass
            fs.revive()
            j = open_writer()
    j.close()
    ack(j.writer.last_lsn)


def relink(state_dir):
    """Point the MIRROR files of a materialised crash state at its own two directories."""
    for here, there in (("j", "m"), ("m", "j")):
        pointer = os.path.join(state_dir, here, MIRROR_NAME)
        if os.path.exists(pointer):
            with open(pointer, "w") as f:
                f.write(os.path.join(state_dir, there) + "\n")


@pytest.mark.parametrize("seed", [31, 32])
def test_every_crash_state_of_a_mirrored_journal_keeps_each_acknowledged_record_in_each_copy(tmp_path, seed):
    """Power loss at every logged operation of a mirrored writer (kills, rotations, re-opens):
    the journal replays every acknowledged record; so it does with either copy's log files
    deleted (each copy alone holds everything acknowledged, as both are synced before the
    acknowledgement); and a re-opened writer continues right after."""
    rng = random.Random(seed)
    root = str(tmp_path / "rec")
    fs = RecordingFS(root)
    truth = Truth()
    mirrored_workload(fs, os.path.join(root, "j"), os.path.join(root, "m"), rng, truth, steps=45)
    acked, best = [0], 0
    for op in fs.ops:
        if op.kind == "note" and op.note[0] == "acked":
            best = max(best, op.note[1])
        acked.append(best)
    points = fs.crash_points
    points = sorted(rng.sample(points, 60)) if len(points) > 60 else points
    n = 0
    for k, plan, state in iter_crash_states(fs, points, lambda k: list(FIXED_PLANS) + random_plans(rng, 1),
                                            str(tmp_path / "scratch")):
        ctx = f"seed {seed}, crash after {k} ops ({fs.ops[k - 1].describe() if k else 'start'}), plan {plan.name}"
        relink(state)
        if not os.path.isdir(os.path.join(state, "j")):
            assert acked[k] == 0, ctx
            continue
        try:
            for lose in ("m", "j"):  # one copy's log files lost with its disk
                alone = str(tmp_path / f"alone-{lose}")
                shutil.copytree(state, alone)
                relink(alone)
                for log in list_logs(os.path.join(alone, lose)) if os.path.isdir(os.path.join(alone, lose)) else []:
                    os.unlink(log)
                check_journal(os.path.join(alone, "j"), truth, acked[k], reopen_fs=FAST_FS,
                              context=f"{ctx}, {lose} lost")
                shutil.rmtree(alone)
            check_journal(os.path.join(state, "j"), truth, acked[k], reopen_fs=FAST_FS, context=ctx)
        except Exception as exc:
            exc.add_note("recent ops:\n  " + "\n  ".join(op.describe() for op in fs.ops[max(0, k - 16):k]))
            raise
        n += 1
    print(f"\nmirrored crash states (seed {seed}): {n}")
    assert n >= 40
