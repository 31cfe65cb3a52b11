"""A tensor-parallel engine's journal directory (``JOURNAL/ranks.json`` + ``JOURNAL/rank-T-P/``,
``kvj.journal.ranks``) is taken whole by every command that reads a journal, as ``kvj recover``
takes it: ``kvj fsck`` checks each rank (each finding names its rank, the worst status wins),
``status`` and ``inspect`` show each rank and the engine as a whole, ``compact`` compacts each,
``prune`` prunes each and the engine's own manifests, ``journal_replay --recover`` recovers it as
``kvj recover`` does, and the shipped systemd unit and cron job run unchanged on it. The TP=2 directory is made
without vLLM: two rank journals written with ``kvj.Journal`` (``build``), rank 1 a block behind."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
from support.cli_helpers import (JOURNAL_REPLAY, KVJ, Holder, append_torn_tail, assert_fails, build, flip_byte,
                                 in_process, kvj, ndjson, segment_file, tree)

from kvj.journal import ranks
from kvj.journal.journal import Journal
from kvj.journal.config import CommitPolicy
from kvj.journal.reader import list_logs
from kvj.journal.replay import replay
from kvj.journal.snapshot import list_snapshots

TP = 2
CONTRIB = os.path.join(os.path.dirname(__file__), "..", "..", "contrib")


def rank(engine: str, tp_rank: int) -> str:
    return ranks.rank_journal(engine, tp_rank, 0, TP, 1)


@pytest.fixture
def engine(tmp_path) -> str:
    """A TP=2 engine's directory after a crash: both ranks journaled two requests in flight and one
    ended; rank 1 made one block fewer of each durable."""
    path = str(tmp_path / "serve")
    ranks.claim(path, TP, 1)
    build(rank(path, 0), blocks=3, training=False)
    build(rank(path, 1), blocks=2, training=False)
    return path


def test_fsck_checks_every_rank_and_each_finding_names_its_rank(engine, capsys):
    clean = in_process(capsys, "fsck", "-j", engine)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    lines = clean.stdout.splitlines()
    summaries = [line for line in lines if ": 1 log files, " in line]
    assert [line.split(": ")[0] for line in summaries] == [rank(engine, 0), rank(engine, 1)]
    assert all(line.endswith("clean") for line in summaries) and lines[-1] == f"{engine}: 2 rank journals; clean"
    notes = [line for line in lines if "note: " in line]  # the ended request's segments, in each rank's store
    assert [line.split(": ")[0] for line in notes] == ["rank-0-0", "rank-1-0"]

    needed = replay(rank(engine, 1)).requests["req-0"].segments[1].key
    flip_byte(segment_file(rank(engine, 1), needed))
    damaged = in_process(capsys, "fsck", "-j", engine)
    assert damaged.returncode == 4
    (error,) = [line for line in damaged.stdout.splitlines() if "error:" in line]
    assert error.startswith("rank-1-0: error: ") and needed in error
    report = json.loads(in_process(capsys, "fsck", "-j", engine, "--json").stdout)
    assert report["exit_code"] == 4 and [r["rank"] for r in report["ranks"]] == ["rank-0-0", "rank-1-0"]
    assert [r["exit_code"] for r in report["ranks"]] == [0, 4]
    assert [(f["rank"], f["kind"]) for f in report["findings"] if f["severity"] == "error"] == [
        ("rank-1-0", "segment-damaged")]
    assert report["records"] == sum(r["records"] for r in report["ranks"]) > 0


def test_fsck_status_is_the_ranks_statuses_ored(engine, capsys):
    append_torn_tail(rank(engine, 0))  # rank 0: a crash's torn tail, which --repair cuts (1)
    with Journal.open(rank(engine, 1), policy=CommitPolicy(file_size_limit=1)) as j:
        j.start("later")  # rank 1: a second log file, so that damage in the first is mid-log (4)
    first = list_logs(rank(engine, 1))[0]
    with open(first, "r+b") as f:
        f.seek(80)
        f.write(b"\x00\x00\x00")
    repaired = json.loads(in_process(capsys, "fsck", "--repair", "-j", engine, "--json").stdout)
    assert [r["exit_code"] for r in repaired["ranks"]] == [1, 4] and repaired["exit_code"] == 5
    assert in_process(capsys, "fsck", "--repair", "-j", engine).returncode == 4  # the cut is done; rank 1 stays


def test_fsck_goes_on_past_a_rank_it_cannot_check(engine, capsys):
    flip_byte(segment_file(rank(engine, 0), replay(rank(engine, 0)).requests["req-2"].segments[0].key))
    with Holder(rank(engine, 1), "writer"):  # --repair needs the writer stopped: rank 1 cannot be repaired now
        proc = kvj("fsck", "--repair", "-j", engine)
    assert_fails(proc, 1 | 8, "rank-1-0: ", rank(engine, 1))  # rank 0's orphan quarantined; rank 1 not checked
    assert "rank-0-0: error: " in proc.stdout and "quarantined" in proc.stdout
    assert f"{rank(engine, 1)}: not checked: " in proc.stdout and "not checked: rank-1-0" in proc.stdout


def test_a_rank_without_a_journal_is_a_warning_and_recovery_resumes_from_zero(engine, capsys):
    os.rename(rank(engine, 1), os.path.join(engine, "elsewhere"))
    proc = in_process(capsys, "fsck", "-j", engine)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank-1-0: warning: this rank has no journal" in proc.stdout
    status = json.loads(in_process(capsys, "status", "-j", engine, "--json").stdout)
    assert status["ranks"][1] == {"rank": "rank-1-0", "journal": rank(engine, 1), "missing": True}
    assert status["totals"]["missing"] == ["rank-1-0"] and status["totals"]["journals"] == 1


def test_status_shows_each_rank_and_the_engine_and_writes_nothing(engine, capsys):
    with Holder(rank(engine, 0), "writer") as holder:
        before = tree(engine)
        s = json.loads(in_process(capsys, "status", "-j", engine, "--json").stdout)
        text = in_process(capsys, "status", "-j", engine).stdout
        assert tree(engine) == before
    assert s["journal"] == engine and [r["rank"] for r in s["ranks"]] == ["rank-0-0", "rank-1-0"]
    r0, r1 = s["ranks"]
    assert r0["journal"] == rank(engine, 0) and r0["writer"] == {"pid": holder.pid} and r1["writer"] is None
    assert (r0["needed_segments"], r1["needed_segments"]) == (6, 4) and r0["in_flight"] == r1["in_flight"] == 2
    t = s["totals"]
    assert (t["ranks"], t["journals"], t["writers"], t["damaged"]) == (2, 2, 1, [])
    assert t["log_bytes"] == r0["log_bytes"] + r1["log_bytes"]
    assert t["segments"] == r0["store"]["segments"] + r1["store"]["segments"] == 9 + 6
    assert f"{rank(engine, 0)} — writer running (pid {holder.pid})" in text and f"{rank(engine, 1)} — no writer" in text
    engine_line = text.strip().splitlines()[-1]
    assert engine_line.startswith(f"engine {engine}: 2 of 2 rank journals; 1 of 2 writers running")
    assert "stores 15 segments" in engine_line and engine_line.endswith("no damage found")


def test_inspect_lists_each_rank_then_the_engine(engine, capsys):
    single = [ndjson(in_process(capsys, "inspect", "-j", rank(engine, t), "--json").stdout) for t in range(TP)]
    records = ndjson(in_process(capsys, "inspect", "-j", engine, "--json").stdout)
    assert [r.pop("rank") for r in records] == ["rank-0-0"] * len(single[0]) + ["rank-1-0"] * len(single[1])
    assert records == single[0] + single[1]
    text = in_process(capsys, "inspect", "-j", engine, "--last", "2").stdout.splitlines()
    assert text[0] == f"rank-0-0 {rank(engine, 0)}" and text[3] == f"rank-1-0 {rank(engine, 1)}"
    assert text[-1] == f"engine {engine}: 2 of 2 rank journals; 4 records shown" and len(text) == 7

    stats = json.loads(in_process(capsys, "inspect", "-j", engine, "--stats", "--json").stdout)
    assert [r["rank"] for r in stats["ranks"]] == ["rank-0-0", "rank-1-0"]
    assert stats["totals"]["records"] == len(records) and stats["totals"]["requests"] == 3
    assert stats["totals"]["by_type"]["segment"]["count"] == 9 + 6
    view = in_process(capsys, "inspect", "-j", engine, "--stats").stdout
    assert f"journal {rank(engine, 1)}" in view and f"engine {engine}: 2 of 2 rank journals; {len(records)} records" in view
    key = replay(rank(engine, 0)).requests["req-1"].segments[2].key  # a block only rank 0 made durable
    found = json.loads(in_process(capsys, "inspect", "-j", engine, "--segment", key[:12], "--json").stdout)
    assert [(r["rank"], r["key"]) for r in found["ranks"]] == [("rank-0-0", key)]
    assert found["ranks"][0]["users"][0]["request"] == "req-1"
    assert_fails(in_process(capsys, "inspect", "-j", engine, "--follow"), 64, f"-j {rank(engine, 0)}")


def live(journal: str) -> dict:
    """What recovery would resume of a journal: its requests in flight and their segments."""
    return {r.id: {seg: ref.key for seg, ref in r.segments.items()} for r in replay(journal).in_flight()}


def test_compact_compacts_each_rank_under_its_own_locks(engine, capsys):
    for t in range(TP):  # a sealed log file in each rank journal, for the snapshot to fold
        with Journal.open(rank(engine, t), policy=CommitPolicy(file_size_limit=1)) as j:
            j.start("later")
    states = [live(rank(engine, t)) for t in range(TP)]
    with Holder(rank(engine, 1), "compactor"):
        locked = in_process(capsys, "compact", "-j", engine, "--grace", "0")
    assert_fails(locked, 75, "rank-1-0: ", rank(engine, 1))  # the compactor of rank 1 runs: rank 0 is compacted
    assert locked.stdout.startswith("rank-0-0: snapshot at LSN ") and "rank-1-0: not compacted: " in locked.stdout
    assert len(list_snapshots(rank(engine, 0))) == 1 and list_snapshots(rank(engine, 1)) == []
    proc = in_process(capsys, "compact", "-j", engine, "--grace", "0", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert [(r["rank"], bool(r["snapshot"])) for r in result["ranks"]] == [("rank-0-0", False), ("rank-1-0", True)]
    # the ended request's segments, collected in each store (rank 0's by the first run)
    assert [len(r["segments_removed"]) for r in result["ranks"]] == [0, 2] and result["totals"]["segments_removed"] == 2
    assert list_snapshots(rank(engine, 1)) and [live(rank(engine, t)) for t in range(TP)] == states


def aside(journal: str) -> dict:
    """What kvj set aside in ``journal`` (a rank journal or the engine directory): folder -> names."""
    quarantine = os.path.join(journal, "segments", "quarantine")
    return {folder: sorted(os.listdir(where)) if os.path.isdir(where) else []
            for folder, where in (("torn", os.path.join(journal, "torn")),
                                  ("recovery", os.path.join(journal, "recovery")), ("quarantine", quarantine))}


def manifests(*epochs: int) -> list:
    return [f"manifest-{e:06d}.json" for e in epochs]


def test_prune_prunes_each_rank_and_the_engines_manifests_under_their_locks(engine, capsys):
    append_torn_tail(rank(engine, 0))
    for _ in range(2):  # the first cuts rank 0's torn tail into its torn/
        assert in_process(capsys, "recover", "-j", engine).returncode == 0
    flip_byte(segment_file(rank(engine, 0), replay(rank(engine, 0)).requests["req-2"].segments[0].key))
    assert in_process(capsys, "fsck", "--repair", "-j", engine).returncode == 1  # quarantined: nothing needs it
    states = [live(rank(engine, t)) for t in range(TP)]
    assert [len(names) for names in aside(rank(engine, 0)).values()] == [1, 2, 1]
    assert aside(engine)["recovery"] == aside(rank(engine, 1))["recovery"] == manifests(1, 2)

    before = tree(engine)
    dry = json.loads(in_process(capsys, "prune", "-j", engine, "--older-than", "0s", "--dry-run", "--json").stdout)
    assert tree(engine) == before
    assert [[len(r["removed"][f]) for f in ("torn", "recovery", "quarantine")] for r in dry["ranks"]] == [[1, 1, 1],
                                                                                                    [0, 1, 0]]
    assert dry["engine"]["removed"] == {"recovery": [os.path.join(engine, "recovery", manifests(1)[0])]}

    with Holder(engine, "compactor"):  # as kvj recover -j ENGINE holds it while it writes the engine's manifest
        held = tree(engine)
        assert_fails(in_process(capsys, "recover", "-j", engine), 75, engine)
        assert tree(engine) == held  # refused before any rank was recovered
        locked = in_process(capsys, "prune", "-j", engine, "--older-than", "0s")
    assert_fails(locked, 75, "engine: ", engine)  # the ranks are pruned; the engine's manifests wait
    assert f"engine {engine}: its manifests not pruned: " in locked.stdout
    assert aside(rank(engine, 0)) == aside(rank(engine, 1)) == {"torn": [], "recovery": manifests(2), "quarantine": []}
    assert aside(engine)["recovery"] == manifests(1, 2)

    assert in_process(capsys, "recover", "-j", engine).returncode == 0  # manifests 3
    with Holder(rank(engine, 1), "compactor"):
        proc = in_process(capsys, "prune", "-j", engine, "--older-than", "0s", "--json")
    assert_fails(proc, 75, "rank-1-0: ", rank(engine, 1))
    result = json.loads(proc.stdout)
    assert [r["rank"] for r in result["ranks"]] == ["rank-0-0", "rank-1-0"] and "error" in result["ranks"][1]
    assert result["engine"]["kept_newest_manifest"] == os.path.join(engine, "recovery", manifests(3)[0])
    assert result["totals"]["removed"] == {"torn": 0, "recovery": 1 + 2, "quarantine": 0}
    assert aside(rank(engine, 0))["recovery"] == aside(engine)["recovery"] == manifests(3)
    assert aside(rank(engine, 1))["recovery"] == manifests(2, 3)

    text = in_process(capsys, "prune", "-j", engine, "--older-than", "0s")
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert f"rank-1-0: removed {os.path.join(rank(engine, 1), 'recovery', manifests(2)[0])}" in lines
    assert lines[-1].startswith(f"engine {engine}: 2 of 2 rank journals pruned; reclaimed ")
    assert aside(rank(engine, 1))["recovery"] == manifests(3)
    assert [live(rank(engine, t)) for t in range(TP)] == states  # the journals themselves untouched


def test_a_store_names_one_journal_not_an_engine(engine, capsys):
    for command in (["status"], ["inspect"], ["compact"], ["prune", "--older-than", "7d"]):
        assert_fails(in_process(capsys, *command, "-j", engine, "--store", engine), 64, "own store", "rank-0-0")
    assert_fails(in_process(capsys, "fsck", "-j", engine, "--store", engine), 16, "own store")


def test_commands_that_take_one_journal_name_the_ones_that_take_the_engine(engine, capsys):
    line = assert_fails(in_process(capsys, "replay", "-j", engine), 66, "rank-0-0, rank-1-0")
    assert f"kvj recover -j {engine} recovers them all" in line and "fsck, status, inspect, compact and prune" in line


def _unit(name: str, key: str) -> list:
    with open(os.path.join(CONTRIB, name)) as f:
        return [line.split("=", 1)[1].strip() for line in f if line.startswith(f"{key}=")]


def test_the_after_reboot_sequence_and_the_shipped_units_run_unchanged_on_the_engine(engine):
    append_torn_tail(rank(engine, 0))  # the crash
    # kvj-recover.service: its environment, KVJ_JOURNAL pointed at the engine, and its ExecStart as is.
    environment = dict(item.split("=", 1) for item in _unit("kvj-recover.service", "Environment"))
    assert set(environment) == {"KVJ_JOURNAL", "NO_COLOR"}
    environment["KVJ_JOURNAL"] = engine
    (exec_start,) = _unit("kvj-recover.service", "ExecStart")
    argv = shlex.split(exec_start)
    assert argv[0] == "/usr/local/bin/kvj"
    fsck = kvj("fsck", extra_env=environment)  # the README's kvj fsck && kvj recover
    assert fsck.returncode == 0 and "rank-0-0: warning: torn tail" in fsck.stdout, fsck.stdout + fsck.stderr
    unit = kvj(*argv[1:], prog=KVJ, extra_env=environment)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    manifest = os.path.join(engine, "recovery", "manifest-000001.json")
    assert f"manifest: {manifest}" in unit.stdout
    with open(manifest) as f:
        plan = json.load(f)
    assert sorted(plan["ranks"]) == ["rank-0-0", "rank-1-0"]
    assert {r["id"]: r["resume_position"] for r in plan["requests"]} == {"req-0": 32, "req-1": 32}
    # The write-up's journal_replay --log DIR --recover, after it: a second manifest, the same plan.
    replayed = kvj("--log", engine, "--recover", prog=JOURNAL_REPLAY)
    again = os.path.join(engine, "recovery", "manifest-000002.json")
    assert replayed.returncode == 0 and f"manifest: {again}" in replayed.stdout, replayed.stdout + replayed.stderr
    with open(again) as f:
        assert json.load(f)["requests"] == plan["requests"]
    # kvj-compact.cron: the hourly compaction's command line, with the cron file's environment.
    with open(os.path.join(CONTRIB, "kvj-compact.cron")) as f:
        cron = f.read()
    (line,) = [entry for entry in cron.splitlines() if " compact " in entry and not entry.startswith("#")]
    command = re.search(r"/usr/local/bin/kvj (compact [^>]*)>>", line).group(1)
    compacted = kvj(*shlex.split(command), extra_env={"KVJ_JOURNAL": engine, "NO_COLOR": "1"})
    assert compacted.returncode == 0, compacted.stdout + compacted.stderr
    assert [r["rank"] for r in json.loads(compacted.stdout)["ranks"]] == ["rank-0-0", "rank-1-0"]
    # Its daily prune: what was set aside a week ago goes, in each rank and the engine's manifests.
    (line,) = [entry for entry in cron.splitlines() if " prune " in entry and not entry.startswith("#")]
    command = re.search(r"/usr/local/bin/kvj (prune [^>]*)>>", line).group(1)
    pruned = kvj(*shlex.split(command), extra_env={"KVJ_JOURNAL": engine, "NO_COLOR": "1"})
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    result = json.loads(pruned.stdout)
    assert [r["rank"] for r in result["ranks"]] == ["rank-0-0", "rank-1-0"] and result["totals"]["bytes_reclaimed"] == 0
    assert result["engine"]["kept_newest_manifest"] == again


def test_journal_replay_takes_the_engine_as_kvj_recover_does(engine):
    """The write-up's journal_replay --log DIR [--recover] is kvj recover [--dry-run]: on an engine
    directory too, every rank into one manifest in DIR/recovery/."""
    append_torn_tail(rank(engine, 0))
    before = tree(engine)
    dry = kvj("--log", engine, prog=JOURNAL_REPLAY)
    assert dry.returncode == 0 and "would recover" in dry.stdout and "2 rank journals" in dry.stdout, dry.stderr
    assert tree(engine) == before
    replayed = kvj("--log", engine, "--recover", "--json", prog=JOURNAL_REPLAY)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    result = json.loads(replayed.stdout)
    assert result["manifest_path"] == os.path.join(engine, "recovery", "manifest-000001.json")
    assert sorted(result["manifest"]["ranks"]) == ["rank-0-0", "rank-1-0"]
    assert {r["id"]: r["resume_position"] for r in result["manifest"]["requests"]} == {"req-0": 32, "req-1": 32}
    assert os.listdir(os.path.join(rank(engine, 0), "torn"))  # rank 0's torn tail cut, as kvj recover cuts it
    recovered = json.loads(kvj("recover", "-j", engine, "--json").stdout)  # the same code path: the same plan
    assert recovered["manifest"]["requests"] == result["manifest"]["requests"]
    assert_fails(kvj("--log", engine, "--kv-store", engine, "--recover", prog=JOURNAL_REPLAY), 64, "own store",
                 prog="journal_replay")
