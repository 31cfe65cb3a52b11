"""The replica manifest and the log trimming restore uses: formats checked, continuity enforced."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvj import Journal
from kvj.errors import CorruptionError, FormatError
from kvj.journal import framing as F
from kvj.journal.reader import list_logs
from kvj.journal.replay import RecordStream, replay
from kvj.journal.config import CommitPolicy
from kvj.replica import manifest as mf
from kvj.replica.pull import trim_log


A, B, C = mf.part_object(1, 0, 60, 3), mf.part_object(1, 60, 100, 3), mf.part_object(2, 0, 50, 3)
S, OLD = mf.snapshot_object(10, 3), mf.snapshot_object(5, 2)


def _manifest() -> mf.Manifest:
    log1 = mf.LogEntry(1, 11, 7, 100, 20, True, [mf.Part(A, 0, 60, "x"), mf.Part(B, 60, 100, "y")])
    log2 = mf.LogEntry(2, 21, 9, 50, 30, False, [mf.Part(C, 0, 50, "z")])
    return mf.Manifest(generation=3, updated=5.0, last_lsn=30, snapshot=mf.SnapshotEntry(10, S, 9, "w"),
                       logs=[log1, log2], history=[[100.0, 20], [200.0, 30]], garbage={OLD: 1.0})


def test_json_round_trip_and_continuity():
    m = _manifest()
    back = mf.Manifest.from_json(m.to_json(), "m")
    assert back == m
    back.check("m")
    assert back.objects() == {A: "x", B: "y", C: "z", S: "w"}


@pytest.mark.parametrize("damage, message", [
    (lambda m: m.logs[0].parts.pop(0), "does not continue at byte 0"),
    (lambda m: setattr(m.logs[1], "base_lsn", 22), "expected 21"),
    (lambda m: setattr(m.logs[0], "base_lsn", 12), "LSNs after 10 are needed"),
    (lambda m: setattr(m.logs[0], "sealed", False), "not sealed"),
    (lambda m: setattr(m.logs[1], "size", 60), "cover 50 of 60"),
    (lambda m: setattr(m, "last_lsn", 31), "logs end at 30"),
])
def test_breaks_in_continuity_are_corruption(damage, message):
    m = _manifest()
    damage(m)
    with pytest.raises(CorruptionError, match=message):
        m.check("m")


def test_malformed_or_foreign_manifests_are_refused():
    with pytest.raises(CorruptionError):
        mf.Manifest.from_json(b"{not json", "m")
    with pytest.raises(FormatError):
        mf.Manifest.from_json(b'{"format": "other"}', "m")
    with pytest.raises(FormatError, match="version 9"):
        mf.Manifest.from_json(b'{"format": "kvj-replica", "version": 9}', "m")
    with pytest.raises(CorruptionError, match="malformed"):
        mf.Manifest.from_json(b'{"format": "kvj-replica", "version": 1, "generation": "x"}', "m")


def test_time_maps_to_the_lsn_replicated_then():
    m = _manifest()
    assert m.lsn_at(150.0) == 20 and m.lsn_at(200.0) == 30 and m.lsn_at(1e12) == 30
    with pytest.raises(FormatError, match="nothing was replicated"):
        m.lsn_at(99.0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=25), st.data())
def test_trim_log_equals_replay_at_lsn(tmp_path_factory, groups, data):
    """Cutting a log after any LSN (mid-group included) replays exactly as replay(at_lsn)."""
    path = str(tmp_path_factory.mktemp("j"))
    with Journal.open(path, policy=CommitPolicy(max_delay=10, max_records=1000)) as j:
        for n, size in enumerate(groups):
            for i in range(size):
                j.alloc("cpu", n * 100 + i, size, f"g{n}")
            j.sync()
    log = list_logs(path)[0]
    with open(log, "rb") as f:
        raw = f.read()
    last = replay(path).last_lsn
    at = data.draw(st.integers(0, last))
    out = str(tmp_path_factory.mktemp("t"))
    with open(os.path.join(out, os.path.basename(log)), "wb") as f:
        f.write(trim_log(raw, at, log))
    assert replay(out, strict=True).to_dict() == replay(path, at_lsn=at).to_dict()


def _groups(raw: bytes, path: str):
    """(version, [(time_ns, [lsn...]) per group]) of a log file's bytes."""
    header = F.decode_file_header(raw)
    off, out = F.FILE_HEADER_SIZE, []
    while off < len(raw):
        time_ns = F.group_header_at(raw, off, header.salt, header.version)[3]
        records, off = F.parse_group(raw, off, path, header.salt, version=header.version)
        out.append((time_ns, [r.lsn for r in records]))
    return header.version, out


def test_trim_log_keeps_the_files_version_and_its_groups_times(tmp_path):
    """A 0.1.0 (version 1) log cut mid-group stays a version 1 file (no time in its group
    headers); a version 2 log cut mid-group keeps the group's time, and every group before."""
    v1 = os.path.join(os.path.dirname(__file__), "..", "journal", "data", "journal-0.1.0", "0000000000000003.log")
    raw = open(v1, "rb").read()
    assert _groups(raw, v1) == (1, [(None, [4, 5, 6])])
    cut = trim_log(raw, 5, v1)
    assert _groups(cut, v1) == (1, [(None, [4, 5])]) and cut[:F.FILE_HEADER_SIZE] == raw[:F.FILE_HEADER_SIZE]

    path = str(tmp_path / "j")
    with Journal.open(path, policy=CommitPolicy(max_delay=10, max_records=1000)) as j:
        for n in range(3):
            for i in range(3):
                j.alloc("cpu", n * 10 + i, 1, "t")
            j.sync()
            time.sleep(0.002)  # distinct group times
    log = list_logs(path)[0]
    raw = open(log, "rb").read()
    version, groups = _groups(raw, log)
    assert version == 2 and [lsns for _t, lsns in groups] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert len({t for t, _l in groups}) == 3 and all(t > 0 for t, _l in groups)
    cut = trim_log(raw, 5, log)
    assert _groups(cut, log) == (2, [groups[0], (groups[1][0], [4, 5])])
    out = tmp_path / "t"
    out.mkdir()
    (out / os.path.basename(log)).write_bytes(cut)
    assert [r.time for r in RecordStream(str(out))] == [r.time for r in RecordStream(path)][:5]


def test_trim_log_refuses_a_damaged_or_short_replicated_file(tmp_path):
    """A replicated log file is whole, so whatever the reader reports in the part kept is an
    error: a damaged group before the cut, a damaged or short last group (which in a local log
    would be a tail that ends it), never a shorter file."""
    path = str(tmp_path / "j")
    with Journal.open(path, policy=CommitPolicy(max_delay=10, max_records=1000)) as j:
        for n in range(3):
            for i in range(3):
                j.alloc("cpu", n * 10 + i, 1, "t")
            j.sync()
    log = list_logs(path)[0]
    raw = open(log, "rb").read()
    assert trim_log(raw, 9, log) == raw
    middle = bytearray(raw)
    middle[len(raw) // 2] ^= 0xFF
    last = bytearray(raw)
    last[-1] ^= 0xFF
    for bad, at in ((bytes(middle), 8), (bytes(last), 8), (raw[:-3], 8), (bytes(last), 9)):
        with pytest.raises(CorruptionError, match="in a replicated log"):
            trim_log(bad, at, log)
