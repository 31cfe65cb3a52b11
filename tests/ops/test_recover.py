"""Recovery: from a SIGKILLed writer to a verified manifest with the CLI alone, fallbacks to the
newest good segment, training chains, dry runs, repeated recoveries; seed-era journals refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from support.cli_helpers import (
    BLOCK_TOKENS,
    JOURNAL_REPLAY,
    append_torn_tail,
    assert_fails,
    block,
    build,
    flip_byte,
    run_cli,
    segment_file,
)
from support.cli_helpers import kvj as kvj_proc

import kvj
from kvj.ops.recover import load_manifest, recover

WRITER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[2])
    from support.cli_helpers import BLOCK_TOKENS, block
    from kvj.journal.journal import Journal

    j = Journal.open(sys.argv[1])
    for r in range(3):
        j.start(f"req-{r}", prompt_hash=f"h{r}", tokens=list(range(10 + r)))
        for b in range(2 + r):
            j.flush(f"req-{r}", b, block(r, b), token_range=(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS)).result()
    j.end("req-0")
    ckpt = j.store.put(block(9, 9)).key
    j.checkpoint(7, {"w": ckpt})
    acked = j.sync()
    print(json.dumps({"acked_lsn": acked, "checkpoint": ckpt}), flush=True)
    i = 0
    while True:  # keeps the committer busy with records nobody waits for, until the kill
        j.alloc("cuda:0", i, 64, "noise")
        i += 1
        if i % 256 == 0:
            time.sleep(0.001)
""")


def test_crashed_writer_to_verified_manifest_with_the_cli_alone(tmp_path, capsys):
    j = tmp_path / "journal"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(j), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))],
                             stdout=subprocess.PIPE, text=True)
    ack = json.loads(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    last, size, torn = append_torn_tail(str(j), 45)  # the half-written group a power cut leaves

    check = kvj_proc("fsck", "-j", j, "--json")  # the end of the log after a crash: recovery cuts it
    assert check.returncode == 0, check.stdout + check.stderr
    findings = json.loads(check.stdout)["findings"]
    assert [f["kind"] for f in findings if f["severity"] in ("error", "warning")] == ["torn-tail"]

    proc = kvj_proc("recover", "-j", j, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    manifest = out["manifest"]
    with open(out["manifest_path"]) as f:
        assert json.load(f) == manifest  # what was printed is what is on disk
    assert manifest["recovered_lsn"] >= ack["acked_lsn"] and manifest["fallbacks"] == []
    resume = {r["id"]: (r["resume_position"], len(r["segments"]), r["prompt_hash"]) for r in manifest["requests"]}
    assert resume == {"req-1": (3 * BLOCK_TOKENS, 3, "h1"), "req-2": (4 * BLOCK_TOKENS, 4, "h2")}
    assert manifest["training"]["checkpoint"]["keys"] == {"w": ack["checkpoint"]}
    assert manifest["segments_verified"] == 8 and manifest["segments_unusable"] == 0
    kept = manifest["torn_tail"]["kept_at"]
    with open(kept, "rb") as f:
        assert f.read().endswith(torn)  # the cut bytes are kept (after any the kill itself left)
    assert os.path.getsize(last) <= size  # and gone from the log

    replayed = json.loads(kvj_proc("replay", "-j", j, "--json").stdout)
    assert replayed["epochs"][0]["manifest"] == os.path.relpath(out["manifest_path"], j)
    assert replayed["epochs"][0]["lsn"] == out["epoch_lsn"] and replayed["tail"] is None

    status, printed, _ = run_cli(capsys, "fsck", "-j", j)
    assert status == 0, printed
    status, printed, _ = run_cli(capsys, "recover", "-j", j, "--dry-run", "--device", "cpu", "--json")
    load = json.loads(printed)["load"]
    assert load["failed"] == [] and load["segments"] == 8 and load["bytes"] == 8 * block(0, 0).nbytes


def test_newest_segment_missing_falls_back_to_the_newest_good_one(tmp_path):
    j = str(tmp_path / "j")
    keys = build(j, requests=2, blocks=3, ended=0, training=False)["keys"]
    os.unlink(segment_file(j, keys["req-0"][2]))
    m = recover(j, dry_run=True).manifest
    req = {r["id"]: r for r in m["requests"]}
    assert req["req-1"]["fallback"] is None and req["req-1"]["resume_position"] == 48
    r0 = req["req-0"]
    assert r0["resume_position"] == 32 and r0["recorded_position"] == 48
    assert [s["seg"] for s in r0["segments"]] == [0, 1]
    assert [(d["seg"], d["problem"]) for d in r0["fallback"]["dropped"]] == [(2, "segment-missing")]
    assert r0["fallback"]["lost_tokens"] == [32, 48]
    assert len(m["fallbacks"]) == 1 and "req-0" in m["fallbacks"][0]


def test_damaged_middle_segment_drops_everything_after_the_gap(tmp_path, capsys):
    j = str(tmp_path / "j")
    keys = build(j, requests=1, blocks=3, ended=0, training=False)["keys"]
    flip_byte(segment_file(j, keys["req-0"][1]))
    status, out, _ = run_cli(capsys, "recover", "-j", j)
    assert status == 0 and "fallback" in out and "tokens 16..48 lost" in out
    r0 = recover(j, dry_run=True).manifest["requests"][0]
    assert r0["resume_position"] == 16
    assert [(d["seg"], d["problem"]) for d in r0["fallback"]["dropped"]] == [(1, "segment-damaged"),
                                                                             (2, "after-gap")]


@pytest.mark.parametrize("damaged, step, deltas", [("d12", 11, [11]), ("d11", 10, []), ("w", None, [])])
def test_training_resumes_from_the_longest_verified_chain(tmp_path, damaged, step, deltas):
    j = str(tmp_path / "j")
    train = build(j, requests=0, blocks=0, ended=0)["training"]
    flip_byte(segment_file(j, train[damaged]))
    t = recover(j, dry_run=True).manifest["training"]
    assert t["step"] == step and [d["step"] for d in t["deltas"]] == deltas
    assert t["fallback"] is not None


def _tree(path):
    found = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                found[p] = (f.read(), os.stat(p).st_mtime_ns)
    return found


def test_dry_run_changes_nothing(tmp_path, capsys):
    j = str(tmp_path / "j")
    build(j, requests=1, blocks=2)
    append_torn_tail(j)
    before = _tree(j)
    status, out, _ = run_cli(capsys, "recover", "-j", j, "--dry-run")
    assert status == 0 and "would recover" in out and "torn tail" in out
    status, out, _ = run_cli(capsys, "--log", j, "--kv-store", os.path.join(j, "segments"), prog="journal_replay")
    assert status == 0 and "would recover" in out
    assert _tree(j) == before


def test_each_recovery_is_a_new_epoch(tmp_path):
    j = str(tmp_path / "j")
    build(j, requests=1, blocks=1, training=False)
    first = recover(j)
    second = recover(j)
    assert (first.manifest["epoch"], second.manifest["epoch"]) == (1, 2)
    assert second.manifest["recovered_lsn"] == first.epoch_lsn
    assert [e["epoch"] for e in kvj.replay(j).epochs] == [1, 2]
    assert sorted(os.listdir(os.path.join(j, "recovery"))) == ["manifest-000001.json", "manifest-000002.json"]


def test_a_seed_era_journal_is_refused_pointing_at_kvj_migrate(tmp_path):
    """Before issue 23 item 5, journal_replay recovered a seed-era JSON-lines journal (a
    manifest of its pointers, its torn line cut); only kvj migrate reads that format now."""
    log = tmp_path / "log"
    log.mkdir()
    lines = [{"op": "start", "id": "a", "prompt_hash": "p1"}, {"op": "seg_flush", "id": "a", "seg": 0, "ptr": 0,
                                                               "size": 4096}, {"op": "end", "id": "a"}]
    seed = log / "journal.jsonl"
    seed.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"op": "seg_fl')
    before = seed.read_bytes()
    proc = kvj_proc("--log", log, "--kv-store", tmp_path / "kv", "--recover", prog=JOURNAL_REPLAY)
    assert_fails(proc, 65, f"{seed} is a seed-era JSON-lines journal", f"kvj migrate {seed} -j NEWDIR",
                 prog="journal_replay")
    for path in (str(log), str(seed)):
        for dry_run in (False, True):
            with pytest.raises(kvj.LegacyJournal, match="kvj migrate"):
                recover(path, dry_run=dry_run)
    assert seed.read_bytes() == before and os.listdir(log) == ["journal.jsonl"] and not (tmp_path / "kv").exists()
def test_load_reports_segments_that_fail_after_planning(tmp_path):
    j = str(tmp_path / "j")
    keys = build(j, requests=1, blocks=2, ended=0, training=False)["keys"]
    manifest = recover(j, dry_run=True).manifest
    flip_byte(segment_file(j, keys["req-0"][1]))
    load = load_manifest(manifest, os.path.join(j, "segments"), "cpu")
    assert load["segments"] == 1 and [f["key"] for f in load["failed"]] == [keys["req-0"][1]]
    assert load["bytes"] == block(0, 0).nbytes and load["gb_per_s"] > 0


def test_fsck_repair_quarantining_the_only_segment_then_fsck_and_recover_resume_at_token_0(tmp_path):
    """Regression (issue 26, item 2): after ``fsck --repair`` quarantined a request's only
    segment, the store holds no segment, and recovery refused it as a mistyped store (66)
    although fsck had just said "recovery handles them". The store that quarantined the
    needed segment is the journal's own: recovery resumes the request at token 0."""
    import numpy as np

    j = tmp_path / "j"
    blk = tmp_path / "blk0.npy"
    np.save(blk, np.random.default_rng(0).standard_normal((2, 16, 4, 8)).astype("float32"))
    assert kvj_proc("init", "-j", j).returncode == 0
    assert kvj_proc("record", "start", "-j", j, "r1").returncode == 0
    assert kvj_proc("flush", "-j", j, "-r", "r1", "--block-tokens", 16, blk).returncode == 0
    key = kvj.replay(str(j)).requests["r1"].segments[0].key
    path = segment_file(str(j), key)
    with open(path, "r+b") as f:  # the repro's damage: a byte at offset 40 of the one segment file
        f.seek(40)
        byte = f.read(1)[0]
        f.seek(40)
        f.write(bytes([byte ^ 0xFF]))
    repaired = kvj_proc("fsck", "-j", j, "--repair")
    assert repaired.returncode == 1 and "quarantined" in repaired.stdout, repaired.stdout + repaired.stderr
    again = kvj_proc("fsck", "-j", j)
    assert again.returncode == 0, again.stdout + again.stderr
    for args in (("--dry-run",), ()):
        proc = kvj_proc("recover", "-j", j, "--json", *args)
        assert proc.returncode == 0, proc.stderr
        manifest = json.loads(proc.stdout)["manifest"]
        (req,) = manifest["requests"]
        assert (req["id"], req["resume_position"], req["recorded_position"], req["segments"]) == ("r1", 0, 16, [])
        assert req["fallback"]["lost_tokens"] == [0, 16] and manifest["tokens"] == {"restorable": 0, "lost": 16}
    assert kvj.replay(str(j)).epochs[-1]["epoch"] == 1


def test_refusing_mid_log_damage_changes_nothing_even_with_an_empty_newest_log(tmp_path):
    """Regression: a journal damaged in a sealed log file whose newest log is empty (the
    writer was killed while rotating) was refused, "nothing was changed", after the writer
    recovery opened had already moved the empty file into torn/ (the incident walkthrough
    failed when its kill landed so). Recovery replays before the writer cuts anything."""
    from support.cli_helpers import tree

    path = tmp_path / "j"
    with kvj.Journal.open(path, policy=kvj.CommitPolicy(file_size_limit=2000)) as j:
        j.start("r1")
        j.flush("r1", 0, block(0, 0), token_range=(0, BLOCK_TOKENS)).result()
        for i in range(60):
            j.alloc("cuda:0", i, 1, "x" * 50, durable=True)
    logs = sorted(p for p in os.listdir(path) if p.endswith(".log"))
    assert len(logs) >= 4
    flip_byte(os.path.join(path, logs[1]), offset_from_end=os.path.getsize(os.path.join(path, logs[1])) - 200)
    open(os.path.join(path, f"{len(logs) + 1:016d}.log"), "wb").close()  # killed while rotating
    before = tree(path)
    with pytest.raises(kvj.errors.CorruptionError, match="followed by a valid one"):
        recover(str(path))
    after = tree(path)
    for lock in ("LOCK", "COMPACT"):  # recovery took the locks (its pid is written in them) before it stopped
        before.pop(lock, None), after.pop(lock)
    assert after == before
