"""A privileged kvj must not be turned against its machine (issue 9 item 23).

Whoever can write a journal directory (the serving process's user) can plant symlinks,
FIFOs, device nodes, UNIX sockets and hard links in it. Every command is run against each planting: it must not write
to, truncate or move what the planting points at, must not hang on a FIFO, and must fail
(if it fails) with one line and no traceback. Run as root, kvj refuses a journal another
user owns, or one that everyone or a group other than root's may write, unless
KVJ_TRUST_OWNER=1.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess

import pytest
from support.cli_helpers import append_torn_tail, assert_fails, build, env, in_process, kvj, segment_file, tree

import kvj as kvj_lib
from kvj.journal.reader import list_logs

NOPERM = 77
VICTIM = b"victim bytes!"  # shorter than a log file header, as in the report

COMMANDS = [["record", "start", "new"], ["flush", "{block}", "-r", "req-0", "--tokens", "48:64"], ["status"], ["replay"],
            ["inspect"], ["inspect", "--stats"], ["recover", "--dry-run"], ["recover"], ["compact", "--grace", "0"],
            ["fsck"], ["fsck", "--repair"], ["prune", "--older-than", "0s", "--dry-run"],
            ["prune", "--older-than", "0s"], ["journal_replay"], ["dump", "-r", "req-0", "--segment", "1", "-o", "{out}"],
            ["init"], ["migrate", "{seed}"], ["replicate", "--to", "{bucket}"], ["restore", "--from", "{replica}"],
            ["verify", "--remote", "{replica}"]]

#: Plantings in the files every command reads: each command must refuse them.
READ_BY_ALL = {"log symlink", "log hard link", "log fifo", "log device", "log socket", "snapshot symlink"}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("planted") / "j"
    build(str(path))
    append_torn_tail(str(path))  # so that recovery and repair have a tail to cut and keep
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    path = tmp_path_factory.mktemp("clean") / "j"
    build(str(path))
    return path


@pytest.fixture(scope="module")
def moto():
    """moto's S3 server, for replicate, restore and verify (as the replica tests use it)."""
    from support.s3 import MotoEndpoint

    endpoint = MotoEndpoint()
    yield endpoint
    endpoint.stop()


@pytest.fixture(scope="module")
def replica(moto, clean):
    """A replica of a clean journal: what restore restores and verify verifies."""
    from support.s3 import s3_env

    url = f"s3://{moto.new_bucket()}/replica"
    proc = kvj("replicate", "-j", clean, "--to", url, extra_env=s3_env(moto.url))
    assert proc.returncode == 0, proc.stderr
    return url


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """A seed-era JSON-lines journal for kvj migrate."""
    path = tmp_path_factory.mktemp("seed") / "seed.jsonl"
    path.write_text('{"op": "start", "id": "a", "prompt_hash": "p"}\n{"op": "end", "id": "a"}\n')
    return path


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    import torch
    from support.cli_helpers import block as make_block

    path = tmp_path_factory.mktemp("block") / "b.pt"
    torch.save(make_block(0, 3), path)
    return path


def plant(journal, victims, what: str) -> None:
    """Put ``what`` into ``journal``, aimed at the victim file or directory."""
    logs = list_logs(str(journal))
    next_log = os.path.join(str(journal), f"{int(os.path.basename(logs[-1])[:16]) + 1:016d}.log")
    target = {"file": str(victims / "file"), "dir": str(victims / "dir")}
    if what == "log symlink":
        os.symlink(target["file"], next_log)
    elif what == "log hard link":
        os.link(target["file"], next_log)
    elif what == "log fifo":
        os.mkfifo(next_log)
    elif what in ("log device", "log socket"):
        make_special(next_log, what.split()[1])
    elif what == "snapshot symlink":
        os.symlink(target["file"], os.path.join(str(journal), "snapshot-0000000000000099.snap"))
    elif what == "snapshot hard link":
        os.link(target["file"], os.path.join(str(journal), "snapshot-0000000000000099.snap"))
    elif what in ("LOCK symlink", "COMPACT symlink", "LOCK hard link"):
        lock = os.path.join(str(journal), what.split()[0])
        if os.path.lexists(lock):
            os.unlink(lock)
        if what.endswith("hard link"):
            os.link(target["file"], lock)
        else:
            os.symlink(target["file"], lock)
    elif what in ("recovery/ symlink", "torn/ symlink", "segments/ symlink"):
        name = os.path.join(str(journal), what.split("/")[0])
        if os.path.isdir(name) and not os.path.islink(name):
            shutil.rmtree(name)
        os.symlink(target["dir"], name)
    elif what == "quarantine/ symlink":
        os.symlink(target["dir"], os.path.join(str(journal), "segments", "quarantine"))
    elif what.startswith("segment "):
        seg = segment_file(str(journal), kvj_lib.replay(str(journal)).requests["req-0"].segments[1].key)
        os.unlink(seg)
        if what == "segment fifo":
            os.mkfifo(seg)
        elif what == "segment symlink":
            os.symlink(target["file"], seg)
        elif what == "segment hard link":
            os.link(target["file"], seg)
        else:
            make_special(seg, what.split()[1])
    else:
        raise AssertionError(what)


def make_special(path: str, kind: str) -> None:
    """A character device (/dev/null's numbers; needs root) or a bound UNIX socket at ``path``."""
    if kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        return
    here = os.getcwd()
    os.chdir(os.path.dirname(path))  # bind a short relative name: a socket path is limited to 108 bytes
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(os.path.basename(path))
    finally:
        os.chdir(here)


def _hung(_signum, _frame):  # type: ignore[no-untyped-def]
    raise TimeoutError("the command hung (a FIFO opened blocking?)")


PLANTINGS = ["log symlink", "log hard link", "log fifo", "snapshot symlink", "LOCK symlink", "COMPACT symlink",
             "recovery/ symlink", "torn/ symlink", "segments/ symlink", "quarantine/ symlink", "segment fifo",
             "segment symlink", "log device", "log socket", "segment device", "segment socket", "segment hard link",
             "snapshot hard link", "LOCK hard link"]
NEEDS_ROOT = {"log device", "segment device"}


@pytest.mark.ci_required
@pytest.mark.parametrize("what", PLANTINGS)
def test_no_command_can_be_turned_against_what_a_planting_points_at(tmp_path, golden, clean, block, seed, moto, replica,
                                                                     monkeypatch, capsys, what):
    if what in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip("making a device node needs root; this run is not root")
    from support.s3 import set_env

    set_env(monkeypatch, moto.url)
    victims = tmp_path / "victims"
    (victims / "dir").mkdir(parents=True)
    (victims / "file").write_bytes(VICTIM)
    (victims / "dir" / "keep").write_bytes(VICTIM)
    os.chmod(victims / "file", 0o644)
    for args in COMMANDS:
        journal = tmp_path / f"j-{'-'.join(args[:2])}"
        # replicate refuses the golden journal (its torn tail) before it reaches a planting: ship a clean one
        shutil.copytree(clean if args[0] == "replicate" else golden, journal, symlinks=True)
        plant(journal, victims, what)
        before = tree(victims)
        values = {"{block}": str(block), "{out}": str(tmp_path / "dumped.npy"), "{seed}": str(seed),
                  "{replica}": replica, "{bucket}": f"s3://{moto.new_bucket()}/r" if "{bucket}" in args else ""}
        argv = [values.get(a, a) for a in args]
        signal.signal(signal.SIGALRM, _hung)
        signal.alarm(120)  # a FIFO opened without care blocks for ever: fail instead of hanging the suite
        try:
            if argv == ["journal_replay"]:
                proc = in_process(capsys, "--log", journal, "--recover", prog="journal_replay")
            elif argv[0] == "verify":  # reads only the replica: no local side to plant in
                proc = in_process(capsys, *argv)
            else:
                proc = in_process(capsys, *argv, "-j", journal)
        finally:
            signal.alarm(0)
        prog_name = "journal_replay" if argv == ["journal_replay"] else "kvj"
        context = f"{what}: {' '.join(argv)} -> {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr}"
        assert tree(victims) == before, context  # nothing written, truncated, moved or created there
        assert "Traceback" not in proc.stderr, context
        if proc.returncode not in (0, 1, 4):  # fsck's 1 and 4 report findings on stdout
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"{prog_name}: error: "), context
        # a writer reads no snapshot; prune reads no log or snapshot (it only removes what was set aside)
        reads_it = argv[0] not in ("prune", "verify") and not (what == "snapshot symlink" and argv[0] == "record")
        # replicate reads a hard-linked newest log (reading is allowed) and takes its short header for a log the
        # writer is still creating: it ships nothing of it (its target is checked unchanged above)
        reads_it = reads_it and not (what == "log hard link" and argv[0] == "replicate")
        if what in READ_BY_ALL and reads_it and argv == ["status"]:  # it reports damage and exits 0 (kvj-status(1))
            assert proc.returncode != 0 or "none found in the log" not in proc.stdout, context
        elif what in READ_BY_ALL and reads_it:  # refused, or stopped at the damage the planting makes before it
            assert proc.returncode not in (0, 1), context
        shutil.rmtree(journal)


@pytest.mark.parametrize("args", [["recover"], ["replay"], ["fsck", "--repair"], ["record", "start", "x"]],
                         ids=" ".join)
def test_the_issue_case_a_symlinked_newest_log_is_refused_not_truncated(tmp_path, clean, args):
    journal = tmp_path / "j"
    shutil.copytree(clean, journal)
    victim = tmp_path / "some-file"
    victim.write_bytes(VICTIM)
    os.symlink(victim, journal / "0000000000000002.log")
    before = tree(journal)
    assert_fails(kvj(*args, "-j", journal), 8 if args[0] == "fsck" else NOPERM,
                 "0000000000000002.log is a symbolic link: refused")
    assert victim.read_bytes() == VICTIM and not (journal / "torn").exists()
    after = tree(journal)
    for lock in ("LOCK", "COMPACT"):  # a writer takes its locks first: its own files, rewritten with its pid
        before.pop(lock, None), after.pop(lock, None)
    assert after == before


def test_a_symlinked_recovery_folder_is_refused(tmp_path, clean):
    journal = tmp_path / "j"
    shutil.copytree(clean, journal)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, journal / "recovery")
    assert_fails(kvj("recover", "-j", journal), NOPERM, "recovery is a symbolic link: refused")
    assert os.listdir(elsewhere) == []


@pytest.mark.ci_required
@pytest.mark.skipif(os.geteuid() != 0, reason="the owner check applies to a kvj run as root; this run is not root")
def test_as_root_a_journal_another_user_owns_is_refused_unless_trusted(tmp_path, golden):
    journal = tmp_path / "j"
    shutil.copytree(golden, journal)
    os.chown(journal, 4242, 4242)
    before = tree(journal)
    for args in (["replay"], ["recover"], ["fsck", "--repair"], ["record", "start", "x"]):
        proc = kvj(*args, "-j", journal)
        assert_fails(proc, 8 if args[0] == "fsck" else NOPERM, "belongs to uid 4242", "KVJ_TRUST_OWNER=1")
    assert tree(journal) == before
    proc = subprocess.run([*__import__("support.cli_helpers", fromlist=["KVJ"]).KVJ, "replay", "-j", str(journal)],
                          capture_output=True, text=True, env=env(KVJ_TRUST_OWNER="1"), timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.ci_required
@pytest.mark.skipif(os.geteuid() != 0, reason="the permission check applies to a kvj run as root; this run is not root")
@pytest.mark.parametrize("mode,gid,who", [(0o777, 0, "everyone"), (0o775, 4242, "group gid 4242")],
                         ids=["world-writable", "group-writable"])
def test_as_root_a_root_owned_journal_others_may_write_is_refused_unless_trusted(tmp_path, golden, mode, gid, who):
    journal = tmp_path / "j"
    shutil.copytree(golden, journal)
    os.chown(journal, 0, gid)
    os.chmod(journal, mode)
    before = tree(journal)
    for args in (["replay"], ["recover"], ["fsck", "--repair"], ["record", "start", "x"]):
        proc = kvj(*args, "-j", journal)
        assert_fails(proc, 8 if args[0] == "fsck" else NOPERM, f"is writable by {who}", "KVJ_TRUST_OWNER=1")
    assert tree(journal) == before
    os.chmod(journal, 0o775)
    os.chown(journal, 0, 0)  # writable by root's group only: as logrotate, that is root's own
    assert kvj("replay", "-j", journal).returncode == 0
    os.chmod(journal, mode)
    os.chown(journal, 0, gid)
    proc = subprocess.run([*__import__("support.cli_helpers", fromlist=["KVJ"]).KVJ, "replay", "-j", str(journal)],
                          capture_output=True, text=True, env=env(KVJ_TRUST_OWNER="1"), timeout=120)
    assert proc.returncode == 0, proc.stderr
