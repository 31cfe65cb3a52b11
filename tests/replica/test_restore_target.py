"""``kvj restore`` onto the directories it exists for: the empty mount point of a fresh disk
(a real tmpfs in a private mount namespace, ``unshare -rm``, no root needed), a prepared
directory with its own owner and mode, a read-only or too small file system; and a restore
cut short while it moves the journal into place."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from kvj import Journal
from kvj.errors import CorruptionError
from kvj.journal.replay import replay
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.replica.remote import open_remote
from kvj.replica.pull import STAGING, restore
from kvj.replica.ship import Replicator
from support.cli_helpers import KVJ, env
from support.s3 import s3_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1"', "sh", "/mnt"],
                           capture_output=True)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_work(),
                                      reason="this machine allows no private mount namespace (unshare -rm)")


class Disk:
    """A tmpfs mounted on ``mountpoint`` in a private mount namespace, held by a ``sleep``."""

    def __init__(self, mountpoint: str, options: str, then: str = "true"):
        os.makedirs(mountpoint, exist_ok=True)
        script = f'mount -t tmpfs -o "$2" tmpfs "$1" && {then} && echo mounted && exec sleep 3600'
        self.holder = subprocess.Popen(["unshare", "-rm", "sh", "-c", script, "sh", mountpoint, options],
                                       stdout=subprocess.PIPE, text=True)
        assert self.holder.stdout.readline() == "mounted\n"
        self.mountpoint = mountpoint

    def outside(self, path: str) -> str:
        """``path`` (as the namespace sees it) from this process."""
        return f"/proc/{self.holder.pid}/root{path}"

    def run(self, *argv: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", "-U", "--preserve-credentials", *argv],
                              capture_output=True, text=True, env=env(**extra), timeout=300)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


def _replicate(url: str, journal: str, segment_bytes: int = 64 << 10) -> None:
    """A journal with a snapshot, several log files and incompressible segments, replicated."""
    n = 24
    side = int((segment_bytes // 4) ** 0.5)
    with Journal.open(journal, policy=CommitPolicy(max_delay=0.001, file_size_limit=2048)) as j:
        for i in range(n):
            j.start(f"r{i}")
            j.flush(f"r{i}", 0, torch.randn(side, side, generator=torch.Generator().manual_seed(i)),
                    token_range=(0, 16)).result()
            if i == n // 2:
                for k in range(4):
                    j.end(f"r{k}")
        j.sync()
        assert compact(journal, grace=3600).snapshot_lsn
        for i in range(40):  # log files after the snapshot's
            j.alloc("cuda:0", i, 64, "after the snapshot " * 4)
        j.sync()
    with Replicator(journal, open_remote(url)) as rep:
        rep.round()


def _same(a: str, b: str) -> None:
    x, y = replay(a).to_dict(include_ended=False), replay(b).to_dict(include_ended=False)
    assert x["requests"] == y["requests"] and x["allocations"] == y["allocations"] and x["last_lsn"] == y["last_lsn"]


@pytest.mark.ci_required
@needs_namespaces
@pytest.mark.parametrize("fresh", ["tmpfs", "ext4-like"])
def test_restore_onto_an_empty_mount_point_keeps_it_and_its_mode(fresh, s3, moto, tmp_path):
    """Regression: staging was built on the parent file system and renamed over the mount
    point: exit 74 "Device or resource busy", after downloading everything. An empty
    lost+found, as a fresh ext4 has, does not count."""
    _replicate(s3, str(tmp_path / "src"))
    then = 'mkdir "$1/lost+found"' if fresh == "ext4-like" else "true"
    disk = Disk(str(tmp_path / "mnt"), "size=64m,mode=0750", then)
    try:
        before = os.stat(disk.outside(disk.mountpoint))
        proc = disk.run(*KVJ, "restore", "--from", s3, "-j", disk.mountpoint, **s3_env(moto.url))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        after = os.stat(disk.outside(disk.mountpoint))
        assert (after.st_ino, after.st_dev, stat.S_IMODE(after.st_mode)) == (before.st_ino, before.st_dev, 0o750)
        names = os.listdir(disk.outside(disk.mountpoint))
        assert STAGING not in names and ("lost+found" in names) == (fresh == "ext4-like")
        assert any(n.endswith(".snap") for n in names)
        _same(str(tmp_path / "src"), disk.outside(disk.mountpoint))
        proc = disk.run(*KVJ, "fsck", "-j", disk.mountpoint)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        disk.close()


@pytest.mark.ci_required
@needs_namespaces
def test_restore_onto_a_read_only_mount_fails_before_reading_the_replica(relay, moto, tmp_path):
    url = f"s3://{moto.new_bucket()}/replica"
    _replicate(url, str(tmp_path / "src"))
    disk = Disk(str(tmp_path / "mnt"), "size=64m,mode=0700", 'mount -o remount,ro "$1"')
    try:
        connections = relay.connections
        proc = disk.run(*KVJ, "restore", "--from", url, "-j", disk.mountpoint, **s3_env(relay.url))
        assert proc.returncode == 77 and "Read-only file system" in proc.stderr, proc.stdout + proc.stderr
        assert relay.connections == connections, "the replica was read before the target was found unwritable"
    finally:
        disk.close()


@pytest.mark.ci_required
@needs_namespaces
def test_restore_onto_a_mount_too_small_fails_before_the_segments_are_downloaded(relay, moto, tmp_path):
    url = f"s3://{moto.new_bucket()}/replica"
    _replicate(url, str(tmp_path / "src"), segment_bytes=256 << 10)  # 24 x 256 KiB of segments, 1 MiB of disk
    disk = Disk(str(tmp_path / "mnt"), "size=1m,mode=0700")
    try:
        proc = disk.run(*KVJ, "restore", "--from", url, "-j", disk.mountpoint, **s3_env(relay.url))
        assert proc.returncode == 74 and "free (nothing was restored)" in proc.stderr, proc.stdout + proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert relay.received < 512 << 10, f"{relay.received} bytes downloaded before the space was found missing"
        assert os.listdir(disk.outside(disk.mountpoint)) == []
    finally:
        disk.close()


def test_restore_into_a_prepared_directory_keeps_it_with_its_owner_and_mode(s3, moto, tmp_path):
    """Regression: the prepared directory was replaced by the staging directory, so `nobody
    750` became `root 700` (undoing the README's User= advice)."""
    _replicate(s3, str(tmp_path / "src"))
    target = tmp_path / "prepared"
    target.mkdir(mode=0o750)
    os.chmod(target, 0o750)
    if os.geteuid() == 0:
        os.chown(target, 65534, 65534)
    before = os.stat(target)
    restore(open_remote(s3), str(target))
    after = os.stat(target)
    assert (after.st_ino, after.st_uid, after.st_gid, after.st_mode) == \
        (before.st_ino, before.st_uid, before.st_gid, before.st_mode)
    _same(str(tmp_path / "src"), str(target))


def kvj_here(capsys, *argv: str):
    """The kvj CLI run in this process (fast): (exit status, stdout, stderr)."""
    from kvj.cli.main import app, run

    capsys.readouterr()
    status = run(app, list(argv), "kvj")
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.ci_required
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: as root, restore refuses a directory another user owns")
def test_as_root_restore_refuses_another_users_directory_unless_trusted(s3, moto, tmp_path, capsys, monkeypatch):
    _replicate(s3, str(tmp_path / "src"))
    target = tmp_path / "nobodys"
    target.mkdir(mode=0o750)
    os.chown(target, 65534, 65534)
    monkeypatch.delenv("KVJ_TRUST_OWNER", raising=False)
    status, _, stderr = kvj_here(capsys, "restore", "--from", s3, "-j", str(target))
    assert status == 77 and "uid 65534" in stderr and os.listdir(target) == [], stderr
    monkeypatch.setenv("KVJ_TRUST_OWNER", "1")
    status, _, stderr = kvj_here(capsys, "restore", "--from", s3, "-j", str(target))
    assert status == 0, stderr
    assert os.stat(target).st_uid == 65534 and stat.S_IMODE(os.stat(target).st_mode) == 0o750


CUT_SHORT = textwrap.dedent("""
    import os, sys
    import kvj.replica.pull as r
    from kvj.replica.remote import open_remote
    if sys.argv[3] == "download":  # the node dies once the log files are staged, before the segments
        def replay_then_die(*a, **k):
            os._exit(9)
        r.replay = replay_then_die
    else:
        real, left = r.rename_durable, int(sys.argv[3])
        def rename_then_die(src, dst, *a, **k):
            global left
            if left == 0:
                os._exit(9)  # the node dies mid-move: no clean-up runs
            left -= 1
            real(src, dst, *a, **k)
        r.rename_durable = rename_then_die
    r.restore(open_remote(sys.argv[1]), sys.argv[2])
""")


def _cut_short(s3: str, moto, target: str, where: str) -> None:
    """Run a restore into ``target`` in a child that dies at ``where`` (no clean-up runs)."""
    proc = subprocess.run([sys.executable, "-c", CUT_SHORT, s3, target, where], capture_output=True,
                          text=True, env=env(**s3_env(moto.url)), cwd=REPO, timeout=300)
    assert proc.returncode == 9, proc.stderr
    assert STAGING in os.listdir(target)


def test_a_restore_cut_short_mid_move_never_leaves_a_shorter_journal(s3, moto, tmp_path, capsys):
    """Killed after each step of the move into the target: kvj refuses what is there (no log
    file yet: not a journal; then an LSN gap: the first log files are missing), never shows a
    shorter history, and the next restore removes what the cut-short one left and restores
    the journal (before, it refused the target, status 64, until a person emptied it)."""
    _replicate(s3, str(tmp_path / "src"))
    full = str(tmp_path / "full")
    restore(open_remote(s3), full)
    steps = len(os.listdir(full))
    assert steps >= 4  # segments/, log files, the snapshot
    for moved in ["download"] + list(range(1, steps)):
        target = str(tmp_path / f"cut-{moved}")
        _cut_short(s3, moto, target, str(moved))
        if any(n.endswith(".log") for n in os.listdir(target)):
            with pytest.raises(CorruptionError, match="missing"):
                replay(target)
        status, stdout, stderr = kvj_here(capsys, "replay", "-j", target)
        assert status in (65, 66) and ("missing" in stderr or "not a kvj journal" in stderr), stdout + stderr
        status, stdout, stderr = kvj_here(capsys, "restore", "--from", s3, "-j", target)
        assert status == 0 and "after removing what a restore cut short had left" in stdout, stdout + stderr
        assert sorted(os.listdir(target)) == sorted(os.listdir(full))
        _same(full, target)
        assert kvj_here(capsys, "fsck", "-j", target)[0] == 0


def test_a_restore_cut_short_is_never_cleaned_up_over_what_it_did_not_write(s3, moto, tmp_path, capsys):
    """Only what a restore writes is removed: a file of anyone else's beside its staging
    directory is refused (64), and a restore running into the target is refused (75), with
    nothing changed either way."""
    import fcntl

    from support.cli_helpers import tree

    _replicate(s3, str(tmp_path / "src"))
    target = str(tmp_path / "cut")
    _cut_short(s3, moto, target, "2")
    with open(os.path.join(target, "notes.txt"), "w") as f:
        f.write("someone's")
    before = tree(target)
    status, _, stderr = kvj_here(capsys, "restore", "--from", s3, "-j", target)
    assert status == 64 and "notes.txt, which no restore writes" in stderr and "nothing was changed" in stderr, stderr
    assert tree(target) == before
    os.unlink(os.path.join(target, "notes.txt"))
    before = tree(target)
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a restore running there holds it
        status, _, stderr = kvj_here(capsys, "restore", "--from", s3, "-j", target)
        assert status == 75 and "locked by a live restore" in stderr, stderr
        assert tree(target) == before
    finally:
        os.close(fd)
    assert kvj_here(capsys, "restore", "--from", s3, "-j", target)[0] == 0
    _same(str(tmp_path / "src"), target)
