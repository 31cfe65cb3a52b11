"""kvj record, flush, replay and inspect: what they write and show, checked against the journal."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

import numpy
import pytest
import torch
from support.cli_helpers import KVJ, build, interruptible, ndjson, run_cli
from support.cli_helpers import kvj as kvj_proc

import kvj
from kvj.journal.journal import Journal
from kvj.journal.records import RecordType
from kvj.journal.config import CommitPolicy


def test_record_each_op_is_durable_and_replays(tmp_path, capsys):
    j = tmp_path / "j"
    cmds = [["start", "req-1", "--tokens", "1,2,3", "--prompt-hash", "ab", "--meta", "temp=0.5", "--meta", "who=me"],
            ["end", "req-1", "--status", "aborted"]]
    assert run_cli(capsys, "init", "-j", j)[0] == 0
    for lsn, cmd in enumerate(cmds, 1):
        status, out, err = run_cli(capsys, "record", *cmd, "-j", j, "--json")
        assert status == 0, err
        assert json.loads(out) == {"lsn": lsn, "type": cmd[0], "durable": True}
    state = kvj.replay(str(j))
    req = state.requests["req-1"]
    assert (req.tokens, req.prompt_hash, req.meta, req.ended, req.status) == ([1, 2, 3], "ab",
                                                                             {"temp": 0.5, "who": "me"}, True, "aborted")


def test_record_ndjson_takes_alloc_and_free_records(tmp_path, capsys, monkeypatch):
    """kvj 0.1.0's alloc/free records are still read and appended from NDJSON (no command makes them)."""
    j = tmp_path / "j"
    lines = [{"type": "alloc", "device": "cuda:0", "addr": 0x1000, "size": 4096, "tag": "kv:req-1"},
             {"type": "alloc", "device": "cuda:0", "addr": 0x3000, "size": 0x2000, "tag": "kv:req-2"},
             {"type": "free", "device": "cuda:0", "addr": 4096}]
    assert run_cli(capsys, "init", "-j", j)[0] == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(line) + "\n" for line in lines)))
    status, out, err = run_cli(capsys, "record", "ndjson", "-j", j, "--json")
    assert status == 0, err
    assert [r["type"] for r in ndjson(out)] == ["alloc", "alloc", "free"]
    allocations = kvj.replay(str(j)).allocations["cuda:0"]
    assert {a: (x.size, x.tag) for a, x in allocations.items()} == {0x3000: (0x2000, "kv:req-2")}


def test_mirror_option_and_environment_for_the_writing_commands(tmp_path, capsys, monkeypatch):
    """--mirror (or KVJ_MIRROR) on init links the mirror; record, flush and recover then write
    both copies without being told again; a second, different mirror is refused (status 64);
    recover reads a deleted log file from the mirror and gives it back."""
    from kvj.journal.mirror import mirror_of
    from kvj.journal.reader import list_logs

    j, m, m2 = tmp_path / "j", tmp_path / "m", tmp_path / "m2"
    assert run_cli(capsys, "init", "-j", j, "--mirror", m)[0] == 0
    assert mirror_of(str(j)) == str(m)
    assert run_cli(capsys, "record", "start", "req-1", "-j", j)[0] == 0
    monkeypatch.setenv("KVJ_MIRROR", str(m2))
    status, _out, err = run_cli(capsys, "record", "end", "req-1", "-j", j)
    assert status == 64 and "is mirrored to" in err, err
    monkeypatch.setenv("KVJ_MIRROR", str(m))
    assert run_cli(capsys, "record", "end", "req-1", "-j", j, "--mirror-policy", "degrade")[0] == 0
    monkeypatch.delenv("KVJ_MIRROR")
    numpy.save(tmp_path / "w.npy", numpy.arange(16, dtype=numpy.float32))
    assert run_cli(capsys, "flush", tmp_path / "w.npy", "-j", j, "--checkpoint", "1")[0] == 0
    names = [os.path.basename(p) for p in list_logs(str(j))]
    assert names == [os.path.basename(p) for p in list_logs(str(m))]
    for name in names:
        assert (j / name).read_bytes() == (m / name).read_bytes()
    os.unlink(list_logs(str(j))[0])
    status, _out, err = run_cli(capsys, "recover", "-j", j, "--json")
    assert status == 0, err
    assert [os.path.basename(p) for p in list_logs(str(j))] == names
    assert kvj.replay(str(j)).checkpoint["step"] == 1 and not os.path.exists(m2)
    status, _out, err = run_cli(capsys, "record", "start", "req-2", "-j", j, "--mirror-policy", "sometimes")
    assert status == 64 and "mirror policy" in err, err


def test_ndjson_round_trip_through_inspect(tmp_path, capsys, monkeypatch):
    src, dst = tmp_path / "a", tmp_path / "b"
    build(str(src), requests=2, blocks=2, ended=1)
    status, out, _ = run_cli(capsys, "inspect", "-j", src, "--json")
    assert status == 0
    records = ndjson(out)
    assert [r["lsn"] for r in records] == list(range(1, len(records) + 1))
    # The segments must exist in the target store before records may point at them: share the store.
    monkeypatch.setattr(sys, "stdin", io.StringIO(out))
    assert run_cli(capsys, "init", "-j", dst)[0] == 0
    status, _, err = run_cli(capsys, "record", "ndjson", "-j", dst, "--store", src / "segments")
    assert status == 0, err
    a, b = kvj.replay(str(src)).to_dict(), kvj.replay(str(dst)).to_dict()
    assert a["requests"] == b["requests"] and a["allocations"] == b["allocations"]
    assert (a["checkpoint"]["keys"], a["counts"]) == (b["checkpoint"]["keys"], b["counts"])


def test_inspect_filters(tmp_path, capsys):
    j = tmp_path / "j"
    build(str(j), requests=2, blocks=3, ended=1)
    def lsns(*args):
        status, out, err = run_cli(capsys, "inspect", "-j", j, "--json", *args)
        assert status == 0, err
        return [(r["lsn"], r["type"], r.get("id")) for r in ndjson(out)]
    everything = lsns()
    assert lsns("-r", "req-1") == [r for r in everything if r[2] == "req-1"]
    assert lsns("-t", "segment", "-t", "END") == [r for r in everything if r[1] in ("segment", "end")]
    assert lsns("--from-lsn", "5", "--to-lsn", "9") == [r for r in everything if 5 <= r[0] <= 9]
    assert lsns("--last", "3") == everything[-3:]
    # Records carry their commit group's time: --since/--until select records, not log files.
    with Journal.open(j) as jj:
        jj.start("late")
    times = {r["lsn"]: r["time"] for r in ndjson(run_cli(capsys, "inspect", "-j", j, "--json")[1])}
    assert all(times[lsn] <= times[lsn + 1] for lsn in range(1, 21)) and times[20] < times[21] <= time.time()
    assert lsns("--since", f"@{times[21]!r}") == [(21, "start", "late")]  # same file as the rest
    assert lsns("--until", f"@{times[20]!r}") == everything
    assert lsns("--until", "2020-01-01") == [] and lsns("--since", "1h") == everything + [(21, "start", "late")]
    status, out, _ = run_cli(capsys, "inspect", "-j", j, "-r", "req-0", "-t", "segment")
    lines = out.splitlines()
    assert len(lines) == 3 and all("segment" in line and "id=req-0" in line for line in lines)


def test_stats(tmp_path, capsys):
    j = tmp_path / "j"
    with Journal.open(j, policy=CommitPolicy(max_delay=10, max_records=1000)) as jj:
        for i in range(30):
            jj.alloc("cuda:0", i * 4096, 4096, "kv")
        jj.sync()
        jj.start("big")
        for s in range(4):
            jj.flush("big", s, torch.zeros(2, 16, 8, 64) + s, token_range=(s * 16, s * 16 + 16)).result()
        jj.sync()
    status, out, _ = run_cli(capsys, "inspect", "-j", j, "--stats", "--json")
    stats = json.loads(out)
    assert stats["records"] == 35 and stats["by_type"]["alloc"]["count"] == 30
    assert stats["largest_commit"] == 30 and stats["records_per_commit"] > 5
    assert stats["segments"]["ratio"] > 10  # zeros compress
    assert stats["largest_requests"][0]["id"] == "big" and stats["largest_requests"][0]["tokens"] == 64
    status, out, _ = run_cli(capsys, "inspect", "-j", j, "--stats")
    assert "records per commit" in out and "big" in out


@pytest.mark.parametrize("fmt", ["npy", "pt", "safetensors"])
def test_flush_files_as_request_segments(tmp_path, capsys, fmt):
    j = tmp_path / "j"
    blocks = [torch.randn(2, 16, 2, 8) for _ in range(3)]
    files = []
    if fmt == "npy":
        for i, b in enumerate(blocks):
            numpy.save(tmp_path / f"b{i}.npy", b.numpy())
            files.append(tmp_path / f"b{i}.npy")
    elif fmt == "pt":
        torch.save({f"b{i}": b for i, b in enumerate(blocks)}, tmp_path / "b.pt")
        files.append(tmp_path / "b.pt")
    else:
        from safetensors.torch import save_file

        save_file({f"b{i}": b for i, b in enumerate(blocks)}, str(tmp_path / "b.safetensors"))
        files.append(tmp_path / "b.safetensors")
    assert run_cli(capsys, "init", "-j", j)[0] == 0
    assert run_cli(capsys, "record", "start", "r", "-j", j)[0] == 0
    status, out, err = run_cli(capsys, "flush", *files, "-j", j, "-r", "r", "--block-tokens", "16",
                               "--layout", "model=tiny", "--json")
    assert status == 0, err
    rows = ndjson(out)
    assert [r["segment"] for r in rows] == [0, 1, 2] and [r["tokens"] for r in rows] == [[0, 16], [16, 32], [32, 48]]
    state = kvj.replay(str(j))
    assert state.requests["r"].resume_position == 48
    from kvj.segments.store import SegmentStore

    with SegmentStore(j / "segments") as store:
        for row, b in zip(rows, blocks):
            assert torch.equal(store.get(row["key"]), b)
            assert store.info(row["key"]).layout == {"model": "tiny"}
    # numbering continues after the last segment; --tokens takes exactly one tensor
    status, out, err = run_cli(capsys, "flush", files[0], "-j", j, "-r", "r", "--tokens", "48:64", "--json",
                               "--layout", "model=tiny")
    if fmt == "npy":
        assert status == 0 and ndjson(out)[0]["segment"] == 3
    else:
        assert status == 64 and "hold 3" in err


def test_flush_checkpoint_and_delta(tmp_path, capsys):
    j = tmp_path / "j"
    torch.save({"w": torch.ones(4, 4), "b": torch.zeros(4)}, tmp_path / "ck.pt")
    assert run_cli(capsys, "init", "-j", j)[0] == 0
    assert run_cli(capsys, "flush", tmp_path / "ck.pt", "-j", j, "--checkpoint", "100")[0] == 0
    assert run_cli(capsys, "flush", tmp_path / "ck.pt", "-j", j, "--delta", "101", "--base-step", "100")[0] == 0
    state = kvj.replay(str(j))
    assert state.checkpoint["step"] == 100 and set(state.checkpoint["keys"]) == {"w", "b"}
    assert [d["step"] for d in state.deltas] == [101]
    assert run_cli(capsys, "flush", tmp_path / "ck.pt", "-j", j, "--request", "nope", "--tokens", "0:1")[0] == 64
    assert run_cli(capsys, "flush", tmp_path / "ck.pt", "-j", j, "-r", "nope", "--block-tokens", "4")[0] == 64


def test_replay_summary_and_point_in_time(tmp_path, capsys):
    j = tmp_path / "j"
    build(str(j), requests=2, blocks=3, ended=1)
    status, out, _ = run_cli(capsys, "replay", "-j", j)
    assert status == 0 and "in flight: 2 requests" in out and "req-0" in out and "48" in out
    assert "checkpoint step 10" in out and "2 deltas" in out and "damage: none" in out
    status, out, _ = run_cli(capsys, "replay", "-j", j, "--at", "3", "--json")
    state = json.loads(out)
    assert state["last_lsn"] == 3 and state["requests"][0]["resume_position"] == 32


def test_follow_never_shows_an_incomplete_record(tmp_path):
    """tail -f on a live journal: the writer commits groups while inspect --follow prints them;
    a half-written group is appended by hand and must never appear."""
    j = tmp_path / "j"
    with Journal.open(j) as jj:
        jj.alloc("cuda:0", 0, 1, "before")
    follower = interruptible([*KVJ, "inspect", "-j", str(j), "--follow", "--json"])
    try:
        first = json.loads(follower.stdout.readline())
        assert first["lsn"] == 1 and first["tag"] == "before"
        with Journal.open(j, policy=CommitPolicy(file_size_limit=600)) as jj:  # rotates several times
            for i in range(40):
                jj.alloc("cuda:0", i + 1, 1, f"live{i}", durable=(i % 5 == 4))
        # A group header and part of its body: what a writer killed mid-write leaves behind.
        from support.cli_helpers import append_torn_tail

        append_torn_tail(str(j), 40)
        seen = [json.loads(follower.stdout.readline()) for _ in range(40)]
        assert [r["lsn"] for r in seen] == list(range(2, 42))
        assert [r["tag"] for r in seen] == [f"live{i}" for i in range(40)]
        with Journal.open(j) as jj:  # cuts the torn tail, continues in a new file
            jj.alloc("cuda:0", 99, 1, "after")
        assert json.loads(follower.stdout.readline())["tag"] == "after"
    finally:
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=10)
    assert follower.returncode == 0 and out == "" and "Traceback" not in err


def test_record_through_the_console_script(tmp_path):
    """The installed entry point appends and reports the LSN only once the record is durable."""
    j = tmp_path / "j"
    assert kvj_proc("init", "-j", j).returncode == 0
    proc = kvj_proc("record", "start", "req-9", "-j", j)
    assert proc.returncode == 0 and proc.stdout.strip() == "LSN 1 durable"
    from kvj.journal.replay import RecordStream

    assert [(r.lsn, r.rtype) for r in RecordStream(str(j))] == [(1, RecordType.START)]


def test_bench_reports_and_recommends(tmp_path, capsys):
    status, out, err = run_cli(capsys, "bench", "--seconds", "0.05", "--no-codecs", "--dir", tmp_path, "--json")
    assert status == 0, err
    result = json.loads(out)
    assert set(result["fsync"]) == {"write + fdatasync", "write + fsync", "O_DSYNC write"}
    assert all(r["ops_per_s"] > 0 and r["p99_us"] >= r["p50_us"] > 0 for r in result["fsync"].values())
    assert [r["policy"] for r in result["journal"]][-1] == "durable=True each record"
    assert all(r["records_per_s"] > 0 for r in result["journal"]) and result["advice"]
    assert os.listdir(tmp_path) == []  # it cleans up after itself


def test_0_1_0_records_without_times(tmp_path, capsys):
    """A journal of kvj 0.1.0 (no times) is listed with no time and selected by its log files' windows."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "journal", "data", "journal-0.1.0"), old,
                    copy_function=shutil.copy)  # written now, as far as the files' times tell
    rows = ndjson(run_cli(capsys, "inspect", "-j", old, "--json")[1])
    assert rows and all(r["time"] is None for r in rows if r["type"] != "epoch")
    recent = ndjson(run_cli(capsys, "inspect", "-j", old, "--json", "--since", "1h")[1])
    assert recent == [r for r in rows if r["type"] != "epoch"]  # an epoch says when it was written
