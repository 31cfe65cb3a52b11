"""Planted control files never hang kvj, never cost a huge read, never end in a traceback (issue 41
items 3 and 5).

Whoever can write a journal directory can put a FIFO, a symlink to ``/dev/zero``, a 2 GiB sparse
file or a deeply nested document where kvj keeps ``handoff.json``, ``ranks.json`` or
``SALVAGE.json``. Each is read by the one bounded, no-follow reader (``kvj.untrusted.read_json``):
refused in one line with a documented status, or, for ``kvj status``, reported while the rest
is shown. Every command runs as a child with a timeout and a memory limit (``bounded``): a hang
or a huge read fails the test, it neither hangs the suite nor exhausts the machine. A planted ``SALVAGE.json`` (naming ``/etc/passwd``, ``../../../etc/hosts``, ...)
is refused as damaged: nothing moved, no manifest written.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess

import pytest
from support.cli_helpers import assert_fails, build, kvj, tree

from kvj.journal.reader import list_logs

DATAERR, NOPERM = 65, 77
#: A command that finishes in well under a second; a FIFO opened blocking would never finish.
TIMEOUT = 60
#: Far more than any of these commands needs (tens of MiB), far less than a planted file would cost.
MEMORY = 1 << 30
SPARSE = 2 << 30


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    path = tmp_path_factory.mktemp("clean") / "j"
    build(str(path))
    return path


def plant(path, what: str) -> str:
    """Put ``what`` at ``path``; the needle the refusal names."""
    if what == "fifo":
        os.mkfifo(path)
        return "is not a regular file"
    if what == "/dev/zero symlink":
        os.symlink("/dev/zero", path)
        return "is a symbolic link"
    if what == "2 GiB sparse":
        with open(path, "wb") as f:
            f.truncate(SPARSE)
        return f"is {SPARSE} bytes, more than the"  # refused by its size, before a byte is read
    if what == "deep nesting":
        with open(path, "w") as f:
            f.write("[" * 100_000 + "]" * 100_000)
        return "more than"  # too large or too deep: never a RecursionError
    if what == "nesting within the size":
        with open(path, "w") as f:
            f.write("[" * 1500 + "]" * 1500)  # past Python's recursion limit, within every size bound
        return "nested more than"
    raise AssertionError(what)


PLANTINGS = ["fifo", "/dev/zero symlink", "2 GiB sparse", "deep nesting", "nesting within the size"]
STATUS = {"fifo": NOPERM, "/dev/zero symlink": NOPERM}  # the others are malformed data: DATAERR


def _hung(_signum, _frame):  # type: ignore[no-untyped-def]
    raise AssertionError("a read blocked on a FIFO")  # no OSError: a caller that catches those would hide it


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY, MEMORY))


def bounded(*args: object) -> subprocess.CompletedProcess:
    """Run ``kvj args`` in a child bounded in time (``TimeoutExpired`` if it hangs) and in memory
    (a huge read fails there, not by exhausting this machine's memory)."""
    return kvj(*args, timeout=TIMEOUT, preexec_fn=_limited)


def journal_copy(tmp_path, clean):
    journal = tmp_path / "j"
    shutil.copytree(clean, journal)
    return journal


def unchanged(before, after) -> bool:
    """Equal trees but for the lock files a command rewrites with its pid."""
    for t in (before, after):
        t.pop("LOCK", None), t.pop("COMPACT", None)
    return before == after


@pytest.mark.ci_required
@pytest.mark.parametrize("what", PLANTINGS + ["wrong types"])
def test_status_reports_a_planted_handoff_json_and_shows_the_rest(tmp_path, clean, what):
    journal = journal_copy(tmp_path, clean)
    control = journal / "handoff.json"
    if what == "wrong types":
        control.write_text(json.dumps({"to": "\x1b[2J../x", "state": "armed", "mode": "abort"}))
        needle = "'to' is not an engine name"
    else:
        needle = plant(control, what)
    proc = bounded("status", "-j", journal, "--json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert report["handoff"] is None and needle in report["handoff_error"], report["handoff_error"]
    assert report["in_flight"] == 2 and report["damage"] is None  # the rest of the journal is shown
    human = bounded("status", "-j", journal)
    assert human.returncode == 0 and "hands nothing off" in " ".join(human.stdout.split()), human.stdout


@pytest.mark.ci_required
@pytest.mark.parametrize("what", PLANTINGS + ["wrong types", "too many ranks"])
@pytest.mark.parametrize("args", [["recover"], ["handoff", "--to", "b", "--timeout", "0"]], ids=" ".join)
def test_a_planted_ranks_json_is_refused_in_one_line(tmp_path, clean, what, args):
    journal = journal_copy(tmp_path, clean)
    before = tree(journal)  # without the planting: tree() would read a 2 GiB one
    ranks = journal / "ranks.json"
    if what == "wrong types":
        ranks.write_text(json.dumps({"tp_size": "2", "pp_size": 1.0}))
        needle = "must be positive integers"
    elif what == "too many ranks":  # a layout of 10^18 rank journals would be listed one by one
        ranks.write_text(json.dumps({"tp_size": 10 ** 9, "pp_size": 10 ** 9}))
        needle = "at most 65536 ranks"
    else:
        needle = plant(ranks, what)
    proc = bounded(*args, "-j", journal)
    assert_fails(proc, STATUS.get(what, DATAERR), "ranks.json", needle)
    os.unlink(ranks)
    assert unchanged(before, tree(journal))


@pytest.mark.ci_required
@pytest.mark.parametrize("what", PLANTINGS)
def test_a_planted_salvage_report_file_is_refused_in_one_line(tmp_path, clean, what):
    journal = journal_copy(tmp_path, clean)
    before = tree(journal)
    needle = plant(journal / "SALVAGE.json", what)
    for args in (["recover"], ["recover", "--recovery-mode", "point-in-time", "--dry-run"]):
        proc = bounded(*args, "-j", journal)
        assert_fails(proc, STATUS.get(what, DATAERR), "SALVAGE.json", needle)
    os.unlink(journal / "SALVAGE.json")
    assert unchanged(before, tree(journal))


def planted_report(journal, **change) -> dict:
    """A pending salvage report shaped as ``set_aside`` writes one, for this journal, but with
    ``change``: the issue's, by default (LSN 5 kept, /etc/passwd and ../../../etc/hosts set aside)."""
    log = list_logs(str(journal))[0]
    offset = 400
    report = {"damage": [{"kind": "corruption", "path": log, "offset": offset, "reason": "damaged commit group",
                          "records": None}],
              "kept_lsn": 5, "lost_to": 20, "cut_file": log, "cut_offset": offset, "later_files": [],
              "requests": [], "training": None, "tokens_lost": 0,
              "set_aside_to": ["/etc/passwd", "../../../etc/hosts"], "id": "5a1f" * 8, "resumed": False}
    report.update(change)
    return report


def _escapes(journal) -> dict:
    """Plantings that each name something outside the journal or contradict its log: what
    each changes in the issue's report, and what the refusal says."""
    log = list_logs(str(journal))[0]
    torn = os.path.join(str(journal), "torn")
    aside = [os.path.join(torn, os.path.basename(log) + ".400.torn")]
    outside = "is not a file set aside in this journal's torn/"
    return {
        "the issue's report": ({}, f"/etc/passwd {outside}"),
        "absolute outside": ({"set_aside_to": ["/etc/passwd"]}, outside),
        "relative traversal": ({"set_aside_to": ["../../../etc/hosts"]}, outside),
        "traversal from torn/": ({"set_aside_to": [os.path.join(torn, "..", "..", "..", "etc", "hosts")]}, outside),
        "a log file outside": ({"later_files": ["/etc/0000000000000009.log"], "set_aside_to": aside},
                               "is not a log file of this journal"),
        "a cut file outside": ({"cut_file": "/etc/0000000000000001.log", "set_aside_to": aside,
                                "damage": [{"kind": "corruption", "path": "/etc/0000000000000001.log", "offset": 400,
                                            "reason": "x", "records": None}]}, "is not a log file of this journal"),
        "kept past the end of the log": ({"kept_lsn": 10 ** 6, "lost_to": None, "set_aside_to": aside},
                                         "is past the end of the log"),
        "cut past the end of the file": ({"cut_offset": 10 ** 9, "set_aside_to": aside,
                                          "damage": [{"kind": "corruption", "path": log, "offset": 10 ** 9,
                                                      "reason": "x", "records": None}]}, "is shorter than the offset"),
        "lost before kept": ({"lost_to": 3, "set_aside_to": aside}, "lost_to after kept_lsn"),
        "tokens that do not add up": ({"tokens_lost": 7, "set_aside_to": aside}, "add up to tokens_lost"),
        "not a report's id": ({"id": "../x", "set_aside_to": aside}, "id, resumed or cut_file"),
    }


ESCAPES = ["the issue's report", "absolute outside", "relative traversal", "traversal from torn/",
           "a log file outside", "a cut file outside", "kept past the end of the log", "cut past the end of the file",
           "lost before kept", "tokens that do not add up", "not a report's id", "symlinked torn/"]


@pytest.mark.ci_required
@pytest.mark.parametrize("what", ESCAPES)
def test_a_planted_salvage_report_is_refused_as_damaged_not_trusted(tmp_path, clean, what):
    journal = journal_copy(tmp_path, clean)
    if what == "symlinked torn/":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        os.symlink(elsewhere, journal / "torn")
        report = planted_report(journal, set_aside_to=[str(journal / "torn" / "0000000000000001.log.400.torn")])
        needle = "torn is a symbolic link"
    else:
        change, needle = _escapes(journal)[what]
        report = planted_report(journal, **change)
    (journal / "SALVAGE.json").write_text(json.dumps(report, indent=1))
    victims = {p: open(p, "rb").read() for p in ("/etc/passwd", "/etc/hosts") if os.path.exists(p)}
    before = tree(journal)
    for args in (["recover", "--dry-run"], ["recover"]):
        proc = bounded(*args, "-j", journal)
        line = assert_fails(proc, DATAERR, "SALVAGE.json", "not a pending salvage report", needle)
        assert "recovering as of" not in proc.stdout + line and not proc.stdout
    assert unchanged(before, tree(journal))  # nothing moved or cut; no manifest, no epoch record
    assert not (journal / "recovery").exists()
    assert {p: open(p, "rb").read() for p in victims} == victims


@pytest.mark.ci_required
def test_a_fifo_handoff_manifest_does_not_hang_resume(tmp_path):
    from kvj.errors import UnsafePath
    from kvj.integrations.vllm.resuming import resume_plans

    manifest = tmp_path / "manifest-b.json"
    os.mkfifo(manifest)
    signal.signal(signal.SIGALRM, _hung)
    signal.alarm(TIMEOUT)
    try:
        with pytest.raises(UnsafePath, match="is not a regular file"):
            resume_plans(str(manifest))
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("what", ["fifo", "deep nesting"])
def test_a_planted_weights_digest_cache_is_no_cache(tmp_path, what):
    pytest.importorskip("vllm")
    from kvj.integrations.vllm import layout as connector

    model, journal = tmp_path / "model", tmp_path / "j"
    model.mkdir()
    journal.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    plant(journal / connector.DIGESTS, what)
    signal.signal(signal.SIGALRM, _hung)
    signal.alarm(TIMEOUT)
    try:
        digest = connector.weights_digest(str(model), str(journal))
    finally:
        signal.alarm(0)
    assert digest.startswith("blake3:") and os.path.isfile(journal / connector.DIGESTS)
    assert not os.path.islink(journal / connector.DIGESTS)  # the planting is replaced, its target untouched
    assert connector.weights_digest(str(model), str(journal)) == digest
