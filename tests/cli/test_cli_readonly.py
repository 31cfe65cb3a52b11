"""Read-only commands write nothing: status, replay, inspect, fsck without --repair, recover --dry-run
and journal_replay without --recover leave every byte, mode and mtime of the journal and its
store as it was (no pid in a lock file), and they work on a read-only bind mount."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from support.cli_helpers import JOURNAL_REPLAY, KVJ, append_torn_tail, build, env, kvj, tree

from kvj.ops.compact import compact

READERS = [["status"], ["status", "--json"], ["replay"], ["replay", "--json"], ["inspect"], ["inspect", "--stats"],
           ["inspect", "--stats", "--json"], ["fsck"], ["fsck", "--json"], ["recover", "--dry-run"],
           ["recover", "--dry-run", "--device", "cpu", "--json"]]


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    """A compacted journal (so LOCK and COMPACT exist), segments in flight, and a torn tail."""
    path = tmp_path_factory.mktemp("readonly") / "j"
    build(str(path))
    compact(str(path), collect=False)
    build(str(path), requests=1, blocks=1, ended=0, training=False)
    append_torn_tail(str(path))
    return path


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.parametrize("args", READERS + [["journal_replay"]], ids=" ".join)
def test_read_only_commands_write_nothing(journal, args):
    before = tree(journal)
    if args == ["journal_replay"]:
        proc = kvj("--log", journal, prog=JOURNAL_REPLAY)
    else:
        proc = kvj(*args, "-j", journal)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout
    assert tree(journal) == before


@pytest.mark.ci_required
@pytest.mark.skipif(not _unshare_works(), reason="this machine allows no private mount namespace (unshare -rm)")
@pytest.mark.parametrize("args", READERS, ids=" ".join)
def test_read_only_commands_work_on_a_read_only_mount(tmp_path, journal, args):
    mount = tmp_path / "ro"
    mount.mkdir()
    script = ('mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && '
              'touch "$PWD/probe" 2>/dev/null; [ ! -e "$PWD/probe" ] && exec "$@"')
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(journal), str(mount),
                           *KVJ, *args, "-j", str(mount)], capture_output=True, text=True, env=env(),
                          cwd=str(mount), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout


@pytest.mark.ci_required
@pytest.mark.skipif(not _unshare_works(), reason="this machine allows no private mount namespace (unshare -rm)")
def test_a_writing_command_on_a_read_only_mount_is_refused_cleanly(tmp_path, journal):
    mount = tmp_path / "ro"
    mount.mkdir()
    script = 'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@"'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(journal), str(mount),
                           *KVJ, "recover", "-j", str(mount)], capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 77 and "Read-only file system" in proc.stderr and "Traceback" not in proc.stderr
