"""kvj recover (and journal_replay) through the real entry point: arguments that cannot work are
refused before anything is written; what recovery prints and records."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.cli_helpers import JOURNAL_REPLAY, append_torn_tail, assert_fails, block, build, in_process, kvj, tree

from kvj.journal.journal import Journal
from kvj.journal.reader import list_logs
from kvj.journal.replay import replay
from kvj.journal.config import CommitPolicy

USAGE, DATAERR, NOINPUT = 64, 65, 66


@pytest.fixture
def torn_journal(tmp_path):
    """A journal whose in-flight requests need segments, with a torn tail recovery would cut."""
    path = tmp_path / "j"
    build(str(path))
    append_torn_tail(str(path))
    return path


@pytest.mark.parametrize("how", ["--store", "KVJ_STORE", "journal_replay", "dry-run", "empty dir"])
def test_a_missing_or_empty_store_is_refused_before_anything_is_written(tmp_path, torn_journal, how):
    wrong = tmp_path / "segmnets"
    if how == "empty dir":
        wrong.mkdir()
    before = tree(torn_journal)
    if how == "KVJ_STORE":
        proc = kvj("recover", "-j", torn_journal, extra_env={"KVJ_STORE": str(wrong)})
    elif how == "journal_replay":
        proc = kvj("--log", torn_journal, "--kv-store", wrong, "--recover", prog=JOURNAL_REPLAY)
    elif how == "dry-run":
        proc = kvj("recover", "-j", torn_journal, "--store", wrong, "--dry-run")
    else:
        proc = kvj("recover", "-j", torn_journal, "--store", wrong)
    prog = "journal_replay" if how == "journal_replay" else "kvj"
    assert_fails(proc, NOINPUT, str(wrong), "needs 9 segments", prog=prog)
    assert tree(torn_journal) == before  # no cut tail, no manifest, no epoch record, no new log file
    if how != "empty dir":
        assert not wrong.exists()


def test_a_journal_that_needs_no_segments_recovers_without_a_store(tmp_path):
    from kvj.journal.journal import Journal

    path = tmp_path / "j"
    with Journal.open(path) as j:
        j.start("req-1", tokens=[1, 2, 3])
    proc = kvj("recover", "-j", path)
    assert proc.returncode == 0, proc.stderr
    assert "requests to resume: 1" in proc.stdout


def _unusable_cuda() -> str:
    return f"cuda:{torch.cuda.device_count()}"  # one past the last GPU; cuda:0 when there is none


@pytest.mark.parametrize("device", ["bogus", "cuda:x", _unusable_cuda()])
@pytest.mark.parametrize("dry_run", [False, True], ids=["recover", "dry-run"])
def test_an_unusable_device_is_a_usage_error_and_writes_nothing(torn_journal, device, dry_run):
    before = tree(torn_journal)
    proc = kvj("recover", "-j", torn_journal, "--device", device, *(["--dry-run"] if dry_run else []))
    assert_fails(proc, USAGE, f"cannot load onto device {device!r}")
    assert tree(torn_journal) == before
    proc = kvj("--log", torn_journal, "--device", device, "--recover", prog=JOURNAL_REPLAY)
    assert_fails(proc, USAGE, "cannot load onto device", prog="journal_replay")
    assert tree(torn_journal) == before


def test_a_usable_device_still_recovers_and_loads(torn_journal):
    proc = kvj("recover", "-j", torn_journal, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "loaded 9 segments" in proc.stdout and "onto cpu" in proc.stdout


NOT_JOURNALS = {
    "one.json": b'{"a": 1}',
    "lines.json": b'{"a": 1}\n{"b": 2}\n',
    "blob.bin": bytes(range(1, 256)).replace(b"\n", b"") * 8,
    "blob-lines.bin": bytes(range(256)) * 8,
    "empty.jsonl": b"",
    "legacy-torn-only.jsonl": b'{"op": "start", "id": "r1"',
}


@pytest.mark.parametrize("name", sorted(NOT_JOURNALS))
@pytest.mark.parametrize("args", [["recover"], ["recover", "--dry-run"], ["fsck", "--repair"], ["fsck"],
                                  ["replay"], ["inspect"], ["journal_replay"]], ids=" ".join)
def test_a_file_that_is_not_a_journal_is_refused_and_left_alone(tmp_path, capsys, name, args):
    target = tmp_path / name
    target.write_bytes(NOT_JOURNALS[name])
    before = tree(tmp_path)
    if args == ["journal_replay"]:
        proc = in_process(capsys, "--log", target, "--recover", prog="journal_replay")
    else:
        proc = in_process(capsys, *args, "-j", target)
    assert_fails(proc, 8 if args[0] == "fsck" else DATAERR, "is not a journal",
                 prog="journal_replay" if args == ["journal_replay"] else "kvj")
    assert tree(tmp_path) == before  # not cut, no torn/, no recovery/


def test_the_library_refuses_a_file_that_is_not_a_journal(tmp_path):
    from kvj.errors import FormatError
    from kvj.ops.fsck import fsck
    from kvj.ops.recover import recover

    target = tmp_path / "one.json"
    target.write_bytes(NOT_JOURNALS["one.json"])
    before = tree(tmp_path)
    for run in (lambda: recover(str(target)), lambda: fsck(str(target), repair=True)):
        with pytest.raises(FormatError, match="is not a journal"):
            run()
    assert tree(tmp_path) == before


def test_a_seed_era_journal_with_a_torn_last_line_is_refused_and_left_alone(tmp_path):
    """Before issue 23 item 5, recover cut the torn line and wrote a manifest; only kvj
    migrate reads the seed-era format now, and the file stays as it is."""
    target = tmp_path / "seed.jsonl"
    content = b'{"op": "start", "id": "r1", "prompt_hash": "h"}\n{"op": "seg_flush", "id": "r1", "se'
    target.write_bytes(content)
    assert_fails(kvj("recover", "-j", target), DATAERR, "is a seed-era JSON-lines journal", "kvj migrate")
    assert target.read_bytes() == content and sorted(os.listdir(tmp_path)) == ["seed.jsonl"]


def test_tail_damage_is_called_damaged_or_torn_and_its_bytes_are_kept_where_named(torn_journal):
    """The newest log's last group may have been acknowledged before a disk damaged it: no
    command calls it "never acknowledged", and the bytes recovery cuts are kept at the path
    it names."""
    for args in (["replay"], ["fsck"], ["recover", "--dry-run"]):
        proc = kvj(*args, "-j", torn_journal)
        assert proc.returncode == 0 and "torn tail" in proc.stdout, proc.stdout + proc.stderr
        assert "never acknowledged" not in proc.stdout and "torn/" in proc.stdout
    from kvj.journal.reader import list_logs

    last = list_logs(str(torn_journal))[-1]
    with open(last, "rb") as f:
        tail = f.read()[-30:]
    proc = kvj("recover", "-j", torn_journal)
    kept = proc.stdout.split("torn tail: 30 bytes, kept at ")[1].split()[0]
    with open(kept, "rb") as f:
        assert f.read() == tail


def test_recover_tells_the_story(tmp_path):
    """Restorable and lost tokens per request and in total, what changed since the previous
    recovery, and the next step; notes are whole lines, never wrapped inside a table cell."""
    import os

    from support.cli_helpers import block, segment_file

    from kvj.journal.journal import Journal

    path = tmp_path / "j"
    written = build(str(path))
    first = kvj("recover", "-j", path, "--dry-run")
    assert "since the journal began: 20 records, 3 requests started, 1 ended, 9 segments flushed" in first.stdout
    assert "tokens: 96 restorable from segments, 0 lost" in first.stdout
    assert "next: kvj recover -j " in first.stdout and "(this was a dry run" in first.stdout
    first = kvj("recover", "-j", path)
    assert first.stdout.rstrip().splitlines()[-1].startswith("next: start the server: it resumes from ")
    with Journal.open(path) as j:
        j.start("new", tokens=[1])
        j.flush("new", 0, block(7, 0), token_range=(0, 16)).result()
        j.end("req-1")
    os.unlink(segment_file(str(path), written["keys"]["req-0"][2]))
    second = kvj("recover", "-j", path, extra_env={"COLUMNS": "80"})
    lines = second.stdout.splitlines()
    assert any(line.startswith("since epoch 1 (LSN 21, ") and line.endswith(
        "): 3 records, 1 requests started, 1 ended, 1 segments flushed") for line in lines), second.stdout
    assert "  req-0: tokens 32..48 lost (1 segments unusable)" in lines
    assert "tokens: 48 restorable from segments, 16 lost" in second.stdout  # req-0 32 of 48, new 16
    assert lines[-1].startswith("next: start the server") and "kvj fsck -j" in lines[-1]


def test_a_salvage_names_the_requests_that_lose_tokens_and_counts_the_rest(tmp_path, capsys):
    path = str(tmp_path / "j")
    build(path, requests=1, blocks=1, ended=0, training=False)
    with Journal.open(path, policy=CommitPolicy(file_size_limit=1)) as j:  # each group its own file
        j.start("victim")
        j.sync()
        for i in range(14):  # in flight after the damage: each loses its 16 tokens
            j.start(f"lost-{i}")
            j.flush(f"lost-{i}", 0, block(7, i), token_range=(0, 16), layout={"model": "tiny"}).result()
        for i in range(30):  # started and ended after the damage: delivered, nothing to resume
            j.start(f"done-{i}")
            j.end(f"done-{i}")
        j.sync()
    victim = next(p for p in list_logs(path) if b"victim" in open(p, "rb").read())
    data = bytearray(open(victim, "rb").read())
    data[-3] ^= 0xFF  # a sealed file: damage in the middle of the log
    open(victim, "wb").write(data)
    proc = in_process(capsys, "recover", "-j", path, "--recovery-mode", "point-in-time")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    named = [line for line in lines if line.startswith("  lost-")]
    assert len(named) == 10 and all("not recovered (16 tokens lost)" in line for line in named)
    assert "  4 requests: lose tokens too (kvj recover --json lists each)" in lines
    assert "  30 requests: started and ended after the damage: nothing to resume" in lines
    assert not any(line.startswith("  done-") for line in lines) and len(lines) < 40
    manifest = json.loads(open(os.path.join(path, replay(path).epochs[-1]["manifest"])).read())
    salvage = manifest["salvage"]  # the manifest still names every request
    assert sum(r["what"] == "started and ended after the damage: nothing to resume" for r in salvage["requests"]) == 30
