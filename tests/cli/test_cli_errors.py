"""Every error path the CLI promises, through the real ``kvj`` entry point: one line on stderr,
no traceback, the documented exit status (kvj(1) EXIT STATUS; e2fsck's for fsck)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from support.cli_helpers import JOURNAL_REPLAY, KVJ, Holder, append_torn_tail, assert_fails, build, kvj
from support.cli_helpers import tree as files_of

from kvj import __version__ as kvj_version
from kvj.journal.journal import Journal
from kvj.journal.reader import list_logs

USAGE, DATAERR, NOINPUT, TEMPFAIL, NOPERM = 64, 65, 66, 75, 77
READERS = [["replay"], ["inspect"], ["inspect", "--stats"], ["recover", "--dry-run"], ["compact"]]


@pytest.fixture
def journal(tmp_path):
    path = tmp_path / "j"
    with Journal.open(path) as j:
        j.start("req-1")
        j.alloc("cuda:0", 4096, 1024, "kv")
    return path


def test_version_and_help():
    proc = kvj("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvj {kvj_version}"
    assert "Exit status" in kvj("--help").stdout
    assert "--kv-store" in kvj("--help", prog=JOURNAL_REPLAY).stdout


@pytest.mark.parametrize("args", READERS, ids=lambda a: " ".join(a))
def test_missing_journal(tmp_path, args):
    assert_fails(kvj(*args, "-j", tmp_path / "nope"), NOINPUT, "nope")


def test_missing_journal_fsck_is_operational(tmp_path):
    assert_fails(kvj("fsck", "-j", tmp_path / "nope"), 8, "nope")


def test_no_journal_given_names_the_variable():
    assert_fails(kvj("replay"), USAGE, "KVJ_JOURNAL")
    assert_fails(kvj("fsck"), 16, "KVJ_JOURNAL")


def test_journal_from_environment(journal):
    proc = kvj("replay", "--json", extra_env={"KVJ_JOURNAL": str(journal)})
    assert proc.returncode == 0 and '"last_lsn":2' in proc.stdout


def test_unreadable_journal_paths(tmp_path, journal):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_fails(kvj("replay", "-j", afile / "j"), NOINPUT, "Not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_fails(kvj("replay", "-j", empty), NOINPUT, "not a kvj journal")
    for args in (["compact"], ["replay"], ["record", "start", "r"]):  # a file is no journal, for every command
        assert_fails(kvj(*args, "-j", afile), 65, "is not a journal")


DROP_DAC = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]


def _drop_dac_works() -> bool:
    if os.geteuid() != 0:
        return True  # not root: plain chmod denies access already
    return shutil.which("setpriv") is not None and subprocess.run(DROP_DAC + ["true"]).returncode == 0


@pytest.mark.ci_required
@pytest.mark.skipif(not _drop_dac_works(), reason="root without setpriv: cannot give up CAP_DAC_OVERRIDE")
@pytest.mark.parametrize("args, status", [(["replay"], NOPERM), (["inspect"], NOPERM), (["recover"], NOPERM),
                                          (["record", "end", "req-1"], NOPERM), (["fsck"], 8)],
                         ids=lambda a: str(a))
def test_permission_denied(journal, args, status):
    # Root bypasses file modes, so the child runs as root without the capabilities that do so.
    os.chmod(journal, 0)
    try:
        prog = (DROP_DAC if os.geteuid() == 0 else []) + KVJ
        assert_fails(kvj(*args, "-j", journal, prog=prog), status, "ermission denied")
    finally:
        os.chmod(journal, 0o700)


@pytest.mark.parametrize("args", [["record", "start", "req-2"], ["recover"], ["flush", "x.npy", "-r", "req-1",
                                                                             "--tokens", "0:16"]],
                         ids=lambda a: a[0])
def test_locked_by_a_live_writer_names_its_pid(journal, args, monkeypatch):
    import numpy

    monkeypatch.chdir(journal.parent)
    numpy.save("x.npy", numpy.zeros((2, 16), dtype=numpy.float32))
    with Holder(str(journal), "writer") as holder:
        line = assert_fails(kvj(*args, "-j", journal), TEMPFAIL, f"pid {holder.pid}", "live writer")
    assert str(journal) in line


def test_fsck_repair_locked_by_writer_is_operational(journal):
    with Holder(str(journal), "writer") as holder:
        assert_fails(kvj("fsck", "--repair", "-j", journal), 8, f"pid {holder.pid}")
        assert kvj("fsck", "-j", journal).returncode == 0  # read-only fsck is fine next to a writer


def test_second_compactor_exits_clearly(journal):
    with Holder(str(journal), "compactor") as holder:
        assert_fails(kvj("compact", "-j", journal), TEMPFAIL, "compactor", f"pid {holder.pid}")


def test_corrupt_journal(journal):
    with Journal.open(journal) as j:  # a later file, so the damaged one is sealed
        j.start("req-2")
    first = list_logs(str(journal))[0]
    with open(first, "r+b") as f:
        f.seek(60)
        f.write(b"\xff\xff")
    for args in (["replay"], ["inspect"], ["recover"]):
        assert_fails(kvj(*args, "-j", journal), DATAERR, os.path.basename(first), "offset")
    assert kvj("fsck", "-j", journal).returncode == 4


def test_strict_replay_rejects_a_torn_tail(journal):
    append_torn_tail(str(journal))
    assert kvj("replay", "-j", journal).returncode == 0
    assert_fails(kvj("replay", "--strict", "-j", journal), DATAERR, "torn tail")


def test_corrupt_ndjson_appends_nothing(journal):
    lines = '{"type":"start","id":"a","prompt_hash":null,"tokens":null,"meta":{}}\n{"type":"start","id":"b","meta":3}\n'
    assert_fails(kvj("record", "ndjson", "-j", journal, input=lines), DATAERR, "line 2", "meta")
    assert_fails(kvj("record", "ndjson", "-j", journal, input="{not json\n"), DATAERR, "line 1")
    assert_fails(kvj("record", "ndjson", "-j", journal, input='{"type":"epoch","epoch":1}\n'), DATAERR, "epoch")
    assert kvj("replay", "--json", "-j", journal).stdout.count('"id":"a"') == 0


def test_corrupt_and_missing_tensor_files(tmp_path, journal):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY garbage")
    assert_fails(kvj("flush", bad, "-j", journal, "-r", "req-1", "--tokens", "0:16"), DATAERR, "bad.npy")
    assert_fails(kvj("flush", tmp_path / "gone.npy", "-j", journal, "-r", "req-1", "--tokens", "0:16"), NOINPUT,
                 "gone.npy")


def test_pickle_in_pt_files_is_refused(tmp_path, journal):
    import torch

    evil = tmp_path / "evil.pt"
    torch.save({"t": torch.zeros(2), "obj": object.__new__(Holder)}, evil)
    assert_fails(kvj("flush", evil, "-j", journal, "--checkpoint", "1"), DATAERR, "evil.pt")


def test_bad_record_arguments(journal):
    assert_fails(kvj("record", "start", "../etc", "-j", journal), USAGE, "invalid request id")
    assert_fails(kvj("record", "checkpoint", "5", "--key", "w=" + "a" * 64, "-j", journal), DATAERR, "not in the store")


@pytest.mark.parametrize("args, status", [(["replay", "--bogus"], USAGE), (["fsck", "--bogus"], 16),
                                          (["inspect", "--stats", "--follow"], USAGE),
                                          (["inspect", "--export", "x.png"], USAGE), (["nosuch"], USAGE),
                                          (["compact", "--grace", "soon"], USAGE)],
                         ids=lambda a: str(a))
def test_usage_errors(journal, args, status):
    assert_fails(kvj(*args, "-j", journal), status)


@pytest.mark.parametrize("args, needle", [(["inspect", "--layout"], "--layout"), (["inspect", "--timeline"], "--timeline"),
                                          (["inspect", "--at", "3"], "--at"), (["record", "alloc", "cuda:0", "0", "64"], "alloc"),
                                          (["record", "free", "cuda:0", "0"], "free"), (["recover", "--until-damage"], "--until-damage"),
                                          (["dump", "-r", "req-0", "--block", "0", "-o", "x.pt"], "--block")],
                         ids=lambda a: str(a))
def test_retired_options_and_commands_are_usage_errors(journal, args, needle):
    """0.2.0 retired the alloc/free pictures and verbs and two aliases: each is refused, nothing written."""
    before = files_of(journal)
    assert_fails(kvj(*args, "-j", journal), USAGE, needle)
    assert files_of(journal) == before


def test_journal_replay_errors_name_the_program(tmp_path):
    assert_fails(kvj("--log", tmp_path / "nope", "--recover", prog=JOURNAL_REPLAY), NOINPUT, "nope",
                 prog="journal_replay")


def test_no_color_means_no_escape_sequences(journal):
    build_dir = journal.parent / "b"
    build(str(build_dir), requests=1, blocks=1, ended=0, training=False)
    for args in (["replay"], ["inspect"]):
        assert "\x1b[" in kvj(*args, "-j", build_dir, extra_env={"FORCE_COLOR": "1", "NO_COLOR": None}).stdout
        assert "\x1b[" not in kvj(*args, "-j", build_dir, extra_env={"FORCE_COLOR": "1"}).stdout, args


#: Built-in exceptions kvj must not raise on purpose: a caller (and the CLI's exit statuses)
#: can only tell kvj's failures apart when they are kvj's own types (kvj/errors.py).
BARE = {"ValueError", "RuntimeError", "MemoryError", "TypeError", "KeyError", "IndexError", "Exception"}


def test_kvj_raises_its_own_exception_types():
    import ast

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kvj")
    found = []
    for dirpath, _dirs, files in os.walk(root):
        if os.path.relpath(dirpath, root).split(os.sep)[0] in ("bench", "demo"):  # tools, not the library
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                exc = node.exc if isinstance(node, ast.Raise) else None
                call = exc.func if isinstance(exc, ast.Call) else exc
                if isinstance(call, ast.Name) and call.id in BARE:
                    found.append(f"{os.path.relpath(path, root)}:{node.lineno}: raise {call.id}")
    assert not found, "\n".join(found)


def test_an_io_error_names_the_file_it_happened_on(journal, capsys, monkeypatch):
    """Regression: EIO from fdatasync (the OS names no file for a call on a descriptor) was
    reported as "I/O error: journal writer failed: [Errno 5] Input/output error", naming none."""
    import errno

    from support.cli_helpers import in_process

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))  # as the kernel's: no file name

    monkeypatch.setattr(os, "fdatasync", eio)
    line = assert_fails(in_process(capsys, "record", "start", "req-2", "-j", journal), 74, "Input/output error")
    assert os.path.realpath(list_logs(journal)[-1]) in line, line
