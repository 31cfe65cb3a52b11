"""The incident walkthrough (docs/operations.md, linked from the README), run line by line through the real ``kvj``: a server
process SIGKILLed mid-write, a sealed log hit by bit rot, and a disk full of other data,
from ``kvj status`` to a server serving again.

"Disk full" is real, not injected: the journal lives on a 4 MiB tmpfs mounted in a private
mount namespace (``unshare -rm``, no root needed); every command runs in that namespace
through ``nsenter``, and the test reaches the same files through ``/proc/PID/root``.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterator, List

import pytest
from support.cli_helpers import KVJ, env, tree
from support.wait import wait_for

WALKTHROUGH = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")
SERVER = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "support", "incident_server.py"))
JOURNAL = "/var/lib/kvj"  # as docs/operations.md writes it

#: An earlier incident's request: a 512 KiB segment (damaged, then quarantined) and a small one.
HISTORY = """
import sys, torch
from kvj import replay
from kvj.journal.config import default_store_path
from kvj.journal.journal import Journal
from kvj.segments.store import SegmentStore
with Journal.open(sys.argv[1]) as j:
    j.start("old-0")
    j.flush("old-0", 0, torch.randn(128, 1024, generator=torch.Generator().manual_seed(0)), token_range=(0, 16))
    j.flush("old-0", 1, torch.zeros(4), token_range=(16, 32))
    j.sync()
with SegmentStore(default_store_path(sys.argv[1])) as store:
    print(store.backend.path(replay(sys.argv[1]).requests["old-0"].segments[0].key))
"""


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1"', "sh", "/mnt"],
                           capture_output=True)
    return probe.returncode == 0


def walkthrough() -> List[List[str]]:
    """The command lines of the "Incident walkthrough" block, comments removed."""
    with open(WALKTHROUGH) as f:
        text = f.read()
    block = text.split("## Incident walkthrough", 1)[1].split("```", 2)[1]
    return [line.split(" #", 1)[0].split() for line in block.strip().splitlines()]


class Disk:
    """A small tmpfs in a private mount namespace, held by a ``sleep`` process."""

    def __init__(self, mountpoint: str, mib: int) -> None:
        script = 'mount -t tmpfs -o size="$2"m tmpfs "$1" && echo mounted && exec sleep 3600'
        self.holder = subprocess.Popen(["unshare", "-rm", "sh", "-c", script, "sh", mountpoint, str(mib)],
                                       stdout=subprocess.PIPE, text=True)
        assert self.holder.stdout.readline() == "mounted\n"
        self.mountpoint = mountpoint

    def outside(self, path: str) -> str:
        """``path`` (a path in the namespace) as this process reaches it."""
        return f"/proc/{self.holder.pid}/root{path}"

    def argv(self, *argv: str) -> List[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-U", "--preserve-credentials", *argv]

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*argv), capture_output=True, text=True, env=env(COLUMNS="200"),
                              timeout=timeout)

    def start(self, *argv: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env())

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


@pytest.fixture
def disk(tmp_path) -> Iterator[Disk]:
    if not _namespaces_work():
        pytest.skip("this machine allows no private mount namespace with a tmpfs (unshare -rm)")
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    d = Disk(str(mountpoint), 4)
    yield d
    d.close()


@pytest.mark.ci_required
def test_incident_walkthrough(disk):
    journal = os.path.join(disk.mountpoint, "kvj")
    here = disk.outside(journal)
    commands = walkthrough()
    assert [c[:2] for c in commands] == [["kvj", "status"], ["kvj", "fsck"], ["kvj", "recover"], ["kvj", "recover"],
                                         ["kvj", "prune"], ["kvj", "prune"], ["kvj", "recover"], ["kvj", "fsck"],
                                         ["server", "--kvj-manifest"], ["kvj", "status"]]

    # History: an earlier incident left a quarantined segment and a manifest behind.
    assert disk.run(*KVJ, "init", "-j", journal).returncode == 0
    history = disk.run(sys.executable, "-c", HISTORY, journal)
    assert history.returncode == 0, history.stderr
    segment = history.stdout.strip()
    with open(disk.outside(segment), "r+b") as f:
        f.seek(5000)
        f.write(b"X")
    assert disk.run(*KVJ, "fsck", "-j", journal, "--repair").returncode == 1  # quarantined it
    assert disk.run(*KVJ, "recover", "-j", journal).returncode == 0  # epoch 1
    assert disk.run(*KVJ, "record", "end", "old-0", "-j", journal).returncode == 0
    set_aside_before = time.time()

    # The server journals requests until it is SIGKILLed with several sealed log files.
    server = disk.start(sys.executable, SERVER, journal)
    durable = 0
    for line in server.stdout:  # type: ignore[union-attr]
        durable = int(line.split()[1])
        if durable > 200 and len([n for n in os.listdir(here) if n.endswith(".log")]) >= 4:
            break
    else:
        raise AssertionError(f"the server stopped by itself: {server.stderr.read()}")  # type: ignore[union-attr]
    server.send_signal(signal.SIGKILL)
    assert server.wait() == -signal.SIGKILL
    print(f"server killed after LSN {durable} was durable")

    # Bit rot in the second log file, and other data fills the disk.
    with open(os.path.join(here, "0000000000000002.log"), "r+b") as f:
        f.seek(8000)
        byte = f.read(1)
        f.seek(8000)
        f.write(bytes([byte[0] ^ 0xFF]))
    fd = os.open(disk.outside(os.path.join(disk.mountpoint, "other-data")), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as full:
            while True:
                os.write(fd, b"\0" * 4096)
        assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    wait_for(lambda: time.time() - set_aside_before > 2, "the history to be two seconds older than the incident")
    incident = time.time()

    out = {}
    for step, argv in enumerate(commands):
        argv = [a.replace(JOURNAL, journal) for a in argv]
        # 7d in the walkthrough: older than the earlier incident, younger than this one.
        argv = [f"{time.time() - (set_aside_before + incident) / 2:.1f}s" if a == "7d" else a for a in argv]
        if argv[0] == "server":
            server = disk.start(sys.executable, SERVER, journal, "--manifest", argv[2])
            out[step] = server.stdout.readline() + server.stdout.readline()
            print(" ".join(argv), "->", out[step])
            continue
        before = tree(here)
        proc = disk.run(*KVJ, *argv[1:])
        print(f"$ {' '.join(argv)}  -> {proc.returncode}\n{proc.stdout}{proc.stderr}")
        out[step] = (proc.returncode, " ".join((proc.stdout + proc.stderr).split()))
        if step in READ_ONLY_STEPS:
            after = tree(here)
            if argv[1] == "recover":  # it took the locks (its pid in LOCK and COMPACT) before it stopped
                for lock in ("LOCK", "COMPACT"):
                    before.pop(lock), after.pop(lock)
            if "point-in-time" in argv:  # the salvage made torn/ for the copy the full disk refused
                assert os.listdir(os.path.join(here, "torn")) == []
                after.pop("torn")
            assert after == before, argv
    try:
        check(out, journal, durable)
    finally:
        server.kill()
        server.wait()


#: The steps that must change nothing: looking, and the attempt the full disk stops.
READ_ONLY_STEPS = {0, 1, 2, 3, 4}


def check(out, journal: str, durable: int) -> None:
    log2 = os.path.join(journal, "0000000000000002.log")
    code, text = out[0]  # kvj status
    last = int(re.search(r"last write LSN (\d+), \d+ s ago", text).group(1))
    assert code == 0 and "no writer" in text and last >= durable, text  # groups written after the last ack count
    assert "quarantine 425.9 KiB (kvj prune --older-than removes them)" in text and "(nearly full)" in text
    assert f"corruption in {log2} at offset" in text and "kvj fsck -j" in text
    code, text = out[1]  # kvj fsck -n
    assert code == 4 and f"error: damaged commit group followed by a valid one" in text and log2 in text, text
    code, text = out[2]  # kvj recover
    assert code == 65 and "nothing was changed (kvj recover --recovery-mode point-in-time recovers what precedes the damage" in text
    code, text = out[3]  # kvj recover --recovery-mode point-in-time on the full disk
    # the copy of the damaged part that the full disk refused, named as it would have been kept
    assert code == 74 and re.fullmatch(r"kvj: error: I/O error: \S+/torn/\S+\.torn: No space left on device", text), text
    code, text = out[4]  # kvj prune --dry-run
    assert code == 0 and "would remove 0 from torn, 0 from recovery, 1 from quarantine; would reclaim 425.9 KiB" in text
    code, text = out[5]  # kvj prune
    assert code == 0 and "removed 0 from torn, 0 from recovery, 1 from quarantine; reclaimed 425.9 KiB" in text, text
    code, text = out[6]  # kvj recover --recovery-mode point-in-time
    assert code == 0 and "(epoch 2)" in text and "SALVAGE: the log is damaged at 0000000000000002.log" in text, text
    lost = re.search(r"lost: LSNs (\d+)\.\.(\d+)", text)
    assert lost and int(lost.group(2)) == last, text  # everything after the damage, up to the kill
    assert "segments: " in text and ", 0 unusable" in text
    assert f"next: start the server: it resumes from {journal}/recovery/manifest-000002.json" in text
    code, text = out[7]  # kvj fsck
    assert code == 0 and text.endswith("; clean"), text  # the orphans are a note
    resumed, segments, bad = out[8].split()[1:4]  # the server, restarted from the manifest
    assert int(resumed) > 0 and int(segments) == 2 * int(resumed) and bad == "0", out[8]
    code, text = out[9]  # kvj status
    assert code == 0 and "writer running (pid " in text and "last recovery epoch 2 at LSN" in text, text
