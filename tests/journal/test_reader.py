"""Replay of damaged, rotated and snapshotted journals."""

import os

import pytest

import kvj
from kvj.errors import CorruptionError, FormatError
from kvj.journal import framing as F
from kvj.journal.journal import Journal
from kvj.journal.writer import log_name
from kvj.journal.reader import list_logs
from kvj.journal.records import RecordType
from kvj.journal.snapshot import write_snapshot
from kvj.journal.config import CommitPolicy


def write_journal(path, n, policy=None, sync_every=1):
    """n alloc records, synced every ``sync_every`` so each sync is its own group."""
    with Journal.open(path, policy=policy) as j:
        for i in range(n):
            j.alloc("cuda:0", i, 4096 + i, f"t{i}")
            if (i + 1) % sync_every == 0:
                j.sync()
    return [i for i in range(n)]


def addrs(state):
    return sorted(state.allocations.get("cuda:0", {}))


def test_clean_journal_replays_everything(tmp_path):
    write_journal(tmp_path, 50)
    state = kvj.replay(str(tmp_path))
    assert addrs(state) == list(range(50))
    assert (state.first_lsn, state.last_lsn, state.tail) == (1, 50, None)


def test_rotation_spreads_records_over_many_files(tmp_path):
    write_journal(tmp_path, 300, CommitPolicy(file_size_limit=2000))
    assert len(list_logs(str(tmp_path))) > 5
    assert addrs(kvj.replay(str(tmp_path))) == list(range(300))


@pytest.mark.parametrize("cut", [1, 7, 23, 24, 40, 60])
def test_truncated_last_group_is_a_torn_tail(tmp_path, cut):
    write_journal(tmp_path, 10)
    last = list_logs(str(tmp_path))[-1]
    size = os.path.getsize(last)
    with open(last, "r+b") as f:
        f.truncate(size - cut)
    state = kvj.replay(str(tmp_path))
    assert addrs(state) == list(range(9))
    assert state.tail["path"] == last and state.tail["length"] > 0
    with pytest.raises(CorruptionError, match="torn tail"):
        kvj.replay(str(tmp_path), strict=True)


@pytest.mark.parametrize("fill", [b"\0", b"\xff", b"\xa5"])
def test_zero_or_garbage_fill_after_the_log_is_a_torn_tail(tmp_path, fill):
    write_journal(tmp_path, 10)
    last = list_logs(str(tmp_path))[-1]
    with open(last, "ab") as f:
        f.write(fill * 4096)
    state = kvj.replay(str(tmp_path))
    assert addrs(state) == list(range(10))
    assert state.tail["length"] == 4096


def test_damage_followed_by_a_valid_group_is_corruption_not_a_tail(tmp_path):
    write_journal(tmp_path, 10)
    last = list_logs(str(tmp_path))[-1]
    data = bytearray(open(last, "rb").read())
    data[F.FILE_HEADER_SIZE + 30] ^= 0x10  # inside the first group
    open(last, "wb").write(data)
    with pytest.raises(CorruptionError) as info:
        kvj.replay(str(tmp_path))
    assert info.value.path == last and info.value.offset == F.FILE_HEADER_SIZE


def test_damage_in_a_sealed_file_is_corruption(tmp_path):
    write_journal(tmp_path, 200, CommitPolicy(file_size_limit=2000))
    logs = list_logs(str(tmp_path))
    victim = logs[1]
    data = bytearray(open(victim, "rb").read())
    data[-3] ^= 0x01  # last group of a sealed file: nothing valid follows in this file
    open(victim, "wb").write(data)
    with pytest.raises(CorruptionError, match="sealed") as info:
        kvj.replay(str(tmp_path))
    assert info.value.path == victim


def test_a_missing_middle_file_is_corruption(tmp_path):
    write_journal(tmp_path, 200, CommitPolicy(file_size_limit=2000))
    os.unlink(list_logs(str(tmp_path))[2])
    with pytest.raises(CorruptionError, match="expected"):
        kvj.replay(str(tmp_path))


def test_unknown_record_types_are_skipped_with_a_warning(tmp_path):
    with Journal.open(tmp_path) as j:
        j.alloc("cuda:0", 1, 10)
        j.writer.append(999, {"from": "the future"})
        j.alloc("cuda:0", 2, 10)
    state = kvj.replay(str(tmp_path))
    assert addrs(state) == [1, 2]
    assert any("unknown type 999" in w for w in state.warnings)


def test_well_framed_but_malformed_payload_is_corruption(tmp_path):
    with Journal.open(tmp_path) as j:
        j.writer.append(RecordType.ALLOC, {"device": "cuda:0"})  # lacks addr/size/tag
    with pytest.raises(CorruptionError, match="missing required field `addr`"):
        kvj.replay(str(tmp_path))


def test_point_in_time_layout(tmp_path):
    with Journal.open(tmp_path) as j:
        a = j.alloc("cuda:0", 0x1000, 100, "kv")
        b = j.alloc("cuda:0", 0x2000, 100, "kv")
        c = j.free("cuda:0", 0x1000)
    assert addrs(kvj.replay(str(tmp_path), at_lsn=a)) == [0x1000]
    assert addrs(kvj.replay(str(tmp_path), at_lsn=b)) == [0x1000, 0x2000]
    assert addrs(kvj.replay(str(tmp_path), at_lsn=c)) == [0x2000]


def test_replay_from_snapshot_plus_later_logs(tmp_path):
    write_journal(tmp_path, 100, CommitPolicy(file_size_limit=2000))
    full = kvj.replay(str(tmp_path))
    logs = list_logs(str(tmp_path))
    sealed_state = kvj.replay(str(tmp_path), at_lsn=60)
    write_snapshot(str(tmp_path), sealed_state)
    from kvj.journal.framing import decode_file_header
    bases = [decode_file_header(open(p, "rb").read(F.FILE_HEADER_SIZE)).base_lsn for p in logs]
    for path, next_base in zip(logs, bases[1:]):  # drop files wholly covered, as compaction does
        if next_base <= 61:
            os.unlink(path)
    assert len(list_logs(str(tmp_path))) < len(logs)
    state = kvj.replay(str(tmp_path))
    assert state.snapshot_lsn == 60
    assert addrs(state) == addrs(full)
    with pytest.raises(FormatError, match="precedes the snapshot"):
        kvj.replay(str(tmp_path), at_lsn=10)


def test_damaged_newest_snapshot_is_an_error_not_skipped(tmp_path):
    write_journal(tmp_path, 10)
    path = write_snapshot(str(tmp_path), kvj.replay(str(tmp_path)))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(data)
    with pytest.raises(CorruptionError, match="snapshot"):
        kvj.replay(str(tmp_path))


def test_writer_resumes_after_a_torn_tail_and_keeps_the_cut_bytes(tmp_path):
    write_journal(tmp_path, 10)
    last = list_logs(str(tmp_path))[-1]
    with open(last, "ab") as f:
        f.write(b"partial group bytes")
    with Journal.open(tmp_path) as j:
        assert j.cut_tail and open(j.cut_tail, "rb").read() == b"partial group bytes"
        assert j.alloc("cuda:0", 99, 1) == 11
    state = kvj.replay(str(tmp_path), strict=True)
    assert addrs(state) == list(range(10)) + [99]


def test_writer_refuses_a_journal_with_mid_log_corruption(tmp_path):
    write_journal(tmp_path, 10)
    last = list_logs(str(tmp_path))[-1]
    data = bytearray(open(last, "rb").read())
    data[F.FILE_HEADER_SIZE + 30] ^= 0x10
    open(last, "wb").write(data)
    with pytest.raises(CorruptionError):
        Journal.open(tmp_path)


def test_empty_new_file_with_torn_header_is_dropped_on_open(tmp_path):
    write_journal(tmp_path, 5)
    torn = tmp_path / log_name(99)
    torn.write_bytes(F.encode_file_header(99, 6, 0)[:10])
    assert addrs(kvj.replay(str(tmp_path))) == list(range(5))
    with Journal.open(tmp_path) as j:
        assert j.alloc("cuda:0", 5, 1) == 6
    assert addrs(kvj.replay(str(tmp_path), strict=True)) == list(range(6))


def test_missing_journal_is_a_format_error(tmp_path):
    with pytest.raises(FormatError, match="no journal"):
        kvj.replay(str(tmp_path / "nope"))


def test_damaged_header_of_a_newest_file_with_records_is_corruption(tmp_path):
    write_journal(tmp_path, 5)
    last = list_logs(str(tmp_path))[-1]
    data = bytearray(open(last, "rb").read())
    data[3] ^= 0xFF
    open(last, "wb").write(data)
    with pytest.raises(CorruptionError, match="bad log file header"):
        kvj.replay(str(tmp_path))
    with pytest.raises(CorruptionError, match="bad log file header"):
        Journal.open(tmp_path)
    assert open(last, "rb").read() == bytes(data)  # the writer touched nothing


def test_replay_is_not_fooled_by_a_compaction_between_snapshot_and_log_listing(tmp_path, monkeypatch):
    """Found by 200 kills with a concurrent compactor: replay loaded the old snapshot, the
    compactor then folded every sealed log into a newer one and deleted them, and the only
    log left was a writer's empty newest file (killed while creating it). Nothing failed, so
    replay returned the old snapshot's state and missed acknowledged records."""
    import importlib

    from kvj.ops.compact import compact
    R = importlib.import_module("kvj.journal.replay")  # the package's ``kvj.replay`` is the function
    path = str(tmp_path / "j")
    policy = CommitPolicy(file_size_limit=600)
    with Journal.open(path, policy=policy) as j:
        for i in range(40):
            j.alloc("cuda:0", i, 1, durable=True)
    compact(path, collect=False)
    with Journal.open(path, policy=policy) as j:
        for i in range(40, 80):
            j.alloc("cuda:0", i, 1, durable=True)
    newest = list_logs(path)[-1]
    open(os.path.join(path, log_name(int(os.path.basename(newest)[:16]) + 1)), "wb").close()
    real = R.load_latest
    calls = []

    def racing_load_latest(directory, files):
        state = real(directory, files)
        if not calls:
            removed = compact(directory, collect=False).logs_removed  # between the snapshot read and the logs
            assert removed and not any(os.path.exists(p) for p in removed)
        calls.append(state.snapshot_lsn)
        return state

    monkeypatch.setattr(R, "load_latest", racing_load_latest)
    state = kvj.replay(path)
    assert len(calls) == 1
    assert state.last_lsn == 80 and addrs(state) == list(range(80))


def test_a_reporter_hears_each_damage_and_the_scan_goes_on_past_it(tmp_path):
    """As LevelDB's log::Reader with a Reporter: a damaged group followed by a valid one is
    reported and the walk resyncs at the valid group; a sealed file with a bad header is
    reported and skipped; everything after the damage is still read."""
    from kvj.journal.reader import CORRUPTION, Scan

    write_journal(tmp_path, 200, CommitPolicy(file_size_limit=2000))
    logs = list_logs(str(tmp_path))
    assert len(logs) >= 5
    data = bytearray(open(logs[1], "rb").read())
    data[F.FILE_HEADER_SIZE + 30] ^= 0x10  # the first group of a sealed file; valid groups follow
    open(logs[1], "wb").write(data)
    data = bytearray(open(logs[3], "rb").read())
    data[3] ^= 0xFF  # a sealed file's header
    open(logs[3], "wb").write(data)
    damage = []
    scan = Scan(str(tmp_path), reporter=damage.append)
    seen = [rec.lsn for rec in scan.records()]
    assert [(d.kind, d.path, d.offset) for d in damage] == [
        (CORRUPTION, logs[1], F.FILE_HEADER_SIZE), (CORRUPTION, logs[3], 0)]
    assert "followed by a valid one" in damage[0].reason and "sealed" in damage[1].reason
    assert seen == sorted(seen) and seen[-1] == 200 and scan.next_lsn == 201
    assert 150 < len(seen) < 200  # only the damaged group and the unreadable file are missing
    with pytest.raises(CorruptionError) as info:  # the default reporter stops at the first damage
        list(Scan(str(tmp_path)))
    assert info.value.path == logs[1]


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
@pytest.mark.parametrize("mirrored", [False, True])
def test_a_pass_holds_at_most_its_cap_of_files_open_and_closes_every_one(tmp_path, mirrored):
    """A long-lived process (a server's drain, a status loop) replays again and again: each
    pass holds at most MAX_PINNED_LOGS log files per copy and the snapshot, and leaks none."""
    import importlib

    from kvj.ops.compact import compact
    R = importlib.import_module("kvj.journal.replay")
    path, mirror = str(tmp_path / "j"), str(tmp_path / "m")
    with Journal.open(path, policy=CommitPolicy(file_size_limit=300), mirror=mirror if mirrored else None) as j:
        for i in range(20):
            j.alloc("cuda:0", i, 1, durable=True)
        compact(path)
        for i in range(20, 400):
            j.alloc("cuda:0", i, 1, durable=True)
    assert len(list_logs(path)) > R.MAX_PINNED_LOGS
    before, during = open_fds(), []
    state = kvj.replay(path, on_group=lambda _g: during.append(open_fds()))
    assert addrs(state) == list(range(400)) and not state.warnings
    copies = 2 if mirrored else 1
    assert before < max(during) <= before + copies * (R.MAX_PINNED_LOGS + 1) + 2, (before, max(during))
    for _ in range(3):
        kvj.replay(path)
    assert open_fds() == before
