"""kvj status: a journal at a glance (writer, last write and its age, last minute's rates,
what is in flight, sizes, last recovery and compaction, damage), read-only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from support.wait import wait_for
from support.cli_helpers import Holder, append_torn_tail, assert_fails, build, in_process, kvj, tree

from kvj.journal.journal import Journal
from kvj.journal.replay import RecordStream
from kvj.journal.snapshot import list_snapshots
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.ops.recover import recover


def test_status_of_a_live_busy_journal(tmp_path):
    path = tmp_path / "j"
    began = time.time()
    build(str(path))  # a commit group at least, and the allocs below in another
    with Journal.open(path) as j:
        for i in range(300):
            j.alloc("cuda:1", i, 64, "x")
    built = time.time()
    with Holder(str(path), "writer") as holder:
        before = tree(path)
        proc = kvj("status", "-j", path, "--json")
        assert proc.returncode == 0, proc.stderr
        s = json.loads(proc.stdout)
        assert tree(path) == before  # read-only, even the lock file
        assert s["writer"] == {"pid": holder.pid} and s["compactor"] is None
        assert s["last_lsn"] == 320 and 0 <= s["last_write_age"] < 60
        m = s["last_minute"]
        assert m["records"] == 320 and m["bytes"] > 320 * 20
        assert m["groups"] >= 2 and m["records_per_group"] == 320 / m["groups"]
        assert 0 < m["commit_lag"] <= built - began  # the longest gap between two of those groups
        assert (s["in_flight"], s["ended"], s["needed_segments"], s["training_step"]) == (2, 1, 9, 12)
        assert s["store"]["segments"] == 12 and s["store"]["bytes"] > 0 and s["damage"] is None
        text = kvj("status", "-j", path).stdout
    assert f"writer running (pid {holder.pid})" in text and "LSN 320, " in text and " s ago (" in text
    assert "5.3 records/s" in text and "2 requests (1 ended)" in text and "none found in the log" in text
    assert f"{m['groups']} groups of " in text and "commit lag at most " in text


def test_status_after_recovery_and_compaction_and_with_damage(tmp_path, capsys):
    path = tmp_path / "j"
    build(str(path))
    append_torn_tail(str(path))
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert s["writer"] is None and s["tail"]["length"] == 30 and s["incomplete_tail"] == 30
    assert "damaged or torn tail of 30 bytes" in in_process(capsys, "status", "-j", path).stdout
    recover(str(path))
    with Journal.open(path, policy=CommitPolicy(file_size_limit=1)) as j:
        j.start("later")  # past the size limit: the log rotates, so compaction has a sealed file to fold
    compact(str(path), collect=False)
    text = in_process(capsys, "status", "-j", path).stdout
    assert "epoch 1 at LSN 21" in text and "snapshot at LSN" in text and "compacted " in text
    assert "set aside torn/ 30 B, recovery/ " in " ".join(text.split())  # the cut tail, the manifest
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert s["set_aside"]["torn"] == 30 and s["set_aside"]["recovery"] == os.path.getsize(
        path / "recovery" / "manifest-000001.json")
    assert 0 < s["disk"]["free"] <= s["disk"]["size"] and s["store"]["disk"]["device"] == s["disk"]["device"]
    (_lsn, snap), = list_snapshots(str(path))
    with open(snap, "r+b") as f:  # the snapshot replay starts from
        f.seek(40)
        f.write(b"\xff")
    proc = in_process(capsys, "status", "-j", path)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "snapshot checksum mismatch" in text and "kvj fsck -j" in text


def test_status_of_an_empty_journal(tmp_path, capsys):
    path = tmp_path / "j"
    Journal.open(path).close()
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert s["last_lsn"] == 0 and s["last_write"] is None and s["in_flight"] == 0 and not s["store"]["exists"]
    assert os.listdir(path)  # nothing was created by looking


def test_status_exit_statuses_as_its_man_page_says(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_fails(kvj("status", "-j", tmp_path / "missing"), 66, "No such file or directory")
    assert_fails(kvj("status", "-j", tmp_path / "empty"), 66, "not a kvj journal")
    assert_fails(kvj("status"), 64, "no journal given")
    assert os.listdir(tmp_path / "empty") == [] and not (tmp_path / "missing").exists()
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "man", "kvj-status.1")) as f:
        assert "kvj status exits 0 whenever it could read the journal" in f.read()


def test_status_shows_the_mirror_and_how_far_each_copy_reaches(tmp_path, capsys):
    path, mirror = tmp_path / "j", tmp_path / "m"
    with Journal.open(path, mirror=mirror) as j:
        for i in range(5):
            j.alloc("cuda:0", i, 64, "x", durable=True)  # one commit group each
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert s["mirror"]["path"] == str(mirror) and s["mirror"]["linked"]
    assert s["mirror"]["journal_lsn"] == s["mirror"]["mirror_lsn"] == s["last_lsn"] == 5
    text = kvj("status", "-j", path, extra_env={"COLUMNS": "300"}).stdout
    assert f"{mirror}, in step (both copies to LSN 5)" in text and "on the journal's own file" in text

    newest = sorted(p for p in os.listdir(mirror) if p.endswith(".log"))[-1]
    with open(mirror / newest, "r+b") as f:  # the mirror's last group torn off
        f.truncate(os.path.getsize(mirror / newest) - 3)
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert (s["mirror"]["journal_lsn"], s["mirror"]["mirror_lsn"], s["last_lsn"]) == (5, 4, 5)
    assert "the mirror reaches LSN 4, the other LSN 5" in kvj("status", "-j", path, extra_env={"COLUMNS": "300"}).stdout

    os.rename(mirror / newest, mirror / "moved")
    os.mkfifo(mirror / newest)  # a copy that cannot be read: status still answers, and says so
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert s["mirror"]["error"] and newest in s["mirror"]["error"] and s["last_lsn"] == 5
    proc = kvj("status", "-j", path, extra_env={"COLUMNS": "300"})
    assert proc.returncode == 0 and "a copy cannot be read" in proc.stdout
    os.unlink(mirror / newest)
    os.rename(mirror / "moved", mirror / newest)

    os.unlink(mirror / "MIRROR")  # the journal still names it; it no longer names the journal back
    s = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)
    assert s["mirror"] == {"path": str(mirror), "linked": False, "journal_lsn": None, "mirror_lsn": None, "disk": None,
                           "error": None}
    assert "is named as the mirror but is missing or does not name this journal back" in \
        kvj("status", "-j", path, extra_env={"COLUMNS": "300"}).stdout


def test_status_of_an_unmirrored_journal_has_no_mirror(tmp_path, capsys):
    path = tmp_path / "j"
    build(str(path))
    assert json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)["mirror"] is None
    assert not re.search(r"^ *mirror ", kvj("status", "-j", path, extra_env={"COLUMNS": "300"}).stdout, re.M)


def test_commit_lag_leaves_out_the_pauses_between_writers(tmp_path, capsys):
    # A writer commits a few groups and dies; recovery writes its epoch group later, a new writer
    # appends later still, and another after it: no interval between them is a record waiting.
    path = tmp_path / "j"

    def pause() -> None:
        """Until the pause since the last group is twice the longest wait between groups so far:
        visible next to the fsyncs, whatever the machine's load (a condition, not a fixed time)."""
        times = sorted({r.time for r in RecordStream(str(path))})
        longest = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        wait_for(lambda: time.time() > times[-1] + 2 * longest + 0.05, "a pause longer than the waits")

    with Journal.open(path) as j:
        for i in range(4):
            j.alloc("cuda:0", i, 64, durable=True)  # a group each
    pause()
    recover(str(path))
    pause()
    with Journal.open(path) as j:
        for i in range(3):
            j.alloc("cuda:1", i, 64, durable=True)
    pause()
    opened = time.time()
    with Journal.open(path) as j:  # the newest writer: its lock file says when it opened
        for i in range(2):
            j.alloc("cuda:2", i, 64, durable=True)
    records = [json.loads(line) for line in in_process(capsys, "inspect", "-j", path, "--json").stdout.splitlines()]
    times = sorted({r["time"] for r in records})
    epoch_time = next(r["time"] for r in records if r["type"] == "epoch")
    first = [t for t in times if t < epoch_time]
    second = [t for t in times if epoch_time < t < opened]
    third = [t for t in times if t >= opened]
    assert (len(first), len(second), len(third)) == (4, 3, 2)
    waits = [b - a for run in (first, second, third) for a, b in zip(run, run[1:])]
    m = json.loads(in_process(capsys, "status", "-j", path, "--json").stdout)["last_minute"]
    assert m["groups"] == 10 and m["commit_lag"] == max(waits)  # no pause between writers is a lag
    assert min(b - a for a, b in ((first[-1], epoch_time), (second[-1], third[0]))) > max(waits)


def test_status_shows_a_kvj_conf_it_cannot_use_instead_of_failing(tmp_path, capsys):
    path = tmp_path / "j"
    Journal.open(path).close()
    for content, needle in (("[" * 20_000 + "]" * 20_000, "nested more than"),
                            ('{"kvj_config": 1, "policy": {"max_buffer_bytes": 0}}', "max_buffer_bytes")):
        (path / "kvj.conf").write_text(content)
        proc = in_process(capsys, "status", "-j", path, "--json")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert needle in json.loads(proc.stdout)["config_error"]
        text = " ".join(in_process(capsys, "status", "-j", path).stdout.split())
        assert "kvj.conf" in text and needle in text


#: Runs the ``kvj`` console script's code on ARGS, then prints, as its last stderr line, the
#: modules of kvj, of torch and of rich that the process loaded.
_LOADED = ("import sys\n"
           "from kvj.cli.launch import kvj\n"
           "sys.argv[0] = 'kvj'\n"
           "try:\n"
           "    kvj()\n"
           "finally:\n"
           "    loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('kvj', 'torch', 'rich'))\n"
           "    sys.stderr.write('\\nmodules ' + ' '.join(loaded) + '\\n')\n")


#: kvj's commands, by the module under kvj.cli each comes from (``migrate`` is init's)
COMMAND_MODULES = ["status", "init", "record", "flush", "replay", "recover", "handoff", "inspect", "compact",
                   "prune", "fsck", "dump", "replicate", "restore", "verify", "bench", "demo"]


def _modules_loaded(*args):
    proc = subprocess.run([sys.executable, "-c", _LOADED, *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("modules"), proc.stderr
    return proc, set(lines[-1].split()[1:])


def test_status_imports_only_its_own_command(tmp_path):
    """``kvj status`` (the first command in an incident) pays for no other command's imports,
    and none of torch; ``kvj --help`` still lists every command."""
    path = tmp_path / "j"
    with Journal.open(path) as j:
        j.start("r1", tokens=[1])
        j.sync()
    proc, loaded = _modules_loaded("status", "-j", path, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["in_flight"] == 1
    assert not any(m.split(".")[0] == "torch" for m in loaded), loaded
    commands = {f"kvj.cli.{module}" for module in COMMAND_MODULES}
    assert loaded & commands == {"kvj.cli.status"}
    proc, loaded = _modules_loaded("--help")
    assert proc.returncode == 0 and commands <= loaded
    assert all(f" {name} " in proc.stdout for name in COMMAND_MODULES + ["migrate"]), proc.stdout


#: What a reader of the journal needs none of: the writer, the segment store, recovery,
#: salvage, the handoff manifest, and rich's console and tables (which only a person's view draws).
NOT_FOR_READING = {"kvj.journal.writer", "kvj.journal.journal", "kvj.segments.store", "kvj.ops.recover",
                   "kvj.ops.salvage", "kvj.ops.handoff", "kvj.cli.render", "rich.console", "rich.table"}


def test_status_json_imports_none_of_the_writers_modules(tmp_path):
    """``kvj status --json`` of a journal that has stored no segment imports only what reading
    the log takes (kvj.conf's commit policy, the handoff control file and the names of
    recovery's entries come without the modules that write them); the view for a person
    adds rich, and a store adds the store."""
    path = tmp_path / "j"
    with Journal.open(path) as j:
        j.start("r1", tokens=[1])
        j.sync()
    (path / "kvj.conf").write_text(json.dumps({"kvj_config": 1, "policy": {"max_records": 7}}))
    proc, loaded = _modules_loaded("status", "-j", path, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["in_flight"] == 1 and report["config_error"] is None and report["store"]["exists"] is False
    assert loaded & NOT_FOR_READING == set(), loaded
    proc, loaded = _modules_loaded("status", "-j", path)
    assert proc.returncode == 0 and "r1" not in proc.stderr, proc.stderr
    assert loaded & NOT_FOR_READING == {"kvj.cli.render", "rich.console", "rich.table"}
    (path / "kvj.conf").write_text(json.dumps({"kvj_config": 1, "policy": {"max_records": 0}}))
    proc, loaded = _modules_loaded("status", "-j", path, "--json")
    assert "max_records" in json.loads(proc.stdout)["config_error"]  # the policy is still checked
