"""Ctrl-C, closed pipes and a bare ``kvj`` through the real entry point: Ctrl-C is always honoured
at once with one "interrupted" line (fsck: status 32), never a traceback; ``kvj ... | head``
exits cleanly; ``kvj`` alone is a usage error."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import textwrap
from typing import Iterator

import pytest
import torch
from support.cli_helpers import KVJ, append_torn_tail, env, interruptible, kvj
from support.wait import wait_for

from kvj.journal.journal import Journal

INTERRUPTED_LINE = "kvj: error: interrupted\n"


@pytest.fixture(scope="module")
def big_journal(tmp_path_factory):
    """Enough segments that verifying them takes a while on any machine."""
    path = tmp_path_factory.mktemp("interrupt") / "j"
    g = torch.Generator().manual_seed(0)
    with Journal.open(path) as j:
        for r in range(24):
            j.start(f"r{r}")
            for b in range(8):
                j.flush(f"r{r}", b, torch.randn(2, 16, 8, 128, generator=g), token_range=(16 * b, 16 * b + 16))
    return path


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def _start(*args: object) -> subprocess.Popen:
    return interruptible([*KVJ, *map(str, args)])


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen) -> Iterator[None]:
    """Kill the child if it is still running at the end (it ignored Ctrl-C): the test fails,
    and leaves no stuck child behind."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _interrupt(proc: subprocess.Popen, when, what: str):  # type: ignore[no-untyped-def]
    with _reaped(proc):
        wait_for(lambda: proc.poll() is not None or when(proc.pid), what)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=30)  # honoured at once: never runs on to the end of a long job


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to see what the child is doing")
@pytest.mark.parametrize("args, status", [(["recover", "--dry-run"], 130), (["fsck"], 32)],
                         ids=["recover --dry-run", "fsck"])
def test_ctrl_c_while_kvj_is_still_importing(big_journal, args, status):
    # msgspec's C extension loads while kvj.cli.main is imported, after the handler is in place;
    # fsck's own status holds from then on too (it used to be 130 until fsck itself began)
    proc = _start(*args, "-j", big_journal)
    out, err = _interrupt(proc, lambda pid: "msgspec/_core" in _maps(pid), "the child to import msgspec")
    assert proc.returncode == status and err == INTERRUPTED_LINE and out == "", (proc.returncode, err)


#: The console script as pip writes it, run once the interpreter has started, with the first
#: import kvj's code asks for (beyond its own files and modules built into the interpreter)
#: held until Ctrl-C arrives: whatever kvj imports before its handler is in place is a moment
#: in which Ctrl-C printed a KeyboardInterrupt traceback.
FIRST_IMPORT = textwrap.dedent("""
    import os, signal, sys
    marker, sys.argv = sys.argv[1], ["kvj", *sys.argv[2:]]

    class HoldFirstImport:
        held = False

        def find_spec(self, name, path=None, target=None):
            if not self.held and name not in sys.builtin_module_names and not name.startswith("kvj"):
                self.held = True
                open(marker, "w").close()
                signal.pause()  # Ctrl-C arrives here
            return None

    sys.meta_path.insert(0, HoldFirstImport())
    from kvj.cli.launch import kvj
    sys.exit(kvj())
""")


def test_ctrl_c_at_the_first_import_kvj_makes_is_one_line_not_a_traceback(tmp_path, big_journal):
    marker = tmp_path / "importing"
    proc = interruptible([sys.executable, "-c", FIRST_IMPORT, str(marker), "fsck", "-j", str(big_journal)])
    out, err = _interrupt(proc, lambda _pid: marker.exists(), "the child's first import")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 32 and err == INTERRUPTED_LINE and out == "", (proc.returncode, err)


#: The real launcher, with every segment verification stuck for good once it starts (it writes
#: the marker first): the main thread then waits on a thread pool (recover) or inside the
#: verification (fsck), the waits that used to swallow Ctrl-C.
STUCK = textwrap.dedent("""
    import sys, threading
    marker, sys.argv = sys.argv[1], ["kvj", *sys.argv[2:]]
    from kvj.segments.store import SegmentStore

    def stuck(self, key):
        open(marker, "w").close()
        threading.Event().wait()

    SegmentStore.verify = stuck
    from kvj.cli.launch import kvj
    kvj()
""")


@pytest.mark.parametrize("args, status", [(["recover", "--dry-run"], 130), (["recover"], 130), (["fsck"], 32),
                                          (["fsck", "--repair"], 32)],
                         ids=lambda a: " ".join(a) if isinstance(a, list) else str(a))
def test_ctrl_c_while_verifying_segments(tmp_path, big_journal, args, status):
    import shutil

    journal = tmp_path / "j"
    shutil.copytree(big_journal, journal)
    append_torn_tail(str(journal))
    marker = tmp_path / "verifying"
    proc = interruptible([sys.executable, "-c", STUCK, str(marker), *args, "-j", str(journal)])
    out, err = _interrupt(proc, lambda _pid: marker.exists(), "the child to verify a segment")
    assert proc.returncode == status and err == INTERRUPTED_LINE, (proc.returncode, err)
    # stopping at any point leaves a journal that recovers as if nothing had happened
    again = kvj("recover", "-j", journal)
    assert again.returncode == 0, again.stderr
    assert "requests to resume: 24" in again.stdout and "192 verified, 0 unusable" in again.stdout


#: As STUCK, but the Ctrl-C lands in a worker thread verifying a segment, as the kernel may
#: deliver a process's SIGINT to any of its threads, once the main thread sleeps in the thread
#: pool's result: in a futex wait without a timeout (x86-64's syscall 202, argument 4 NULL).
#: Python runs a handler in the main thread only, and that sleep never ended.
STUCK_IN_WORKER = textwrap.dedent("""
    import signal, sys, threading, time
    sys.argv = ["kvj", *sys.argv[1:]]
    from kvj.segments.store import SegmentStore
    first = threading.Lock()

    def main_sleeps_for_good():
        with open(f"/proc/self/task/{threading.main_thread().native_id}/syscall") as f:
            call = f.read().split()
        return call[0] == "202" and call[4] == "0x0"

    def stuck(self, key):
        assert threading.current_thread() is not threading.main_thread()
        if first.acquire(blocking=False):
            while not main_sleeps_for_good():
                time.sleep(0.001)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        threading.Event().wait()

    SegmentStore.verify = stuck
    from kvj.cli.launch import kvj
    kvj()
""")


@pytest.mark.skipif(platform.machine() != "x86_64" or not os.path.exists("/proc/self/syscall"),
                    reason="reads x86-64 Linux's /proc/<tid>/syscall to see the main thread asleep")
@pytest.mark.parametrize("args", [["recover", "--dry-run"], ["recover"]], ids=" ".join)
def test_ctrl_c_that_lands_in_a_worker_thread_still_ends_the_command(tmp_path, big_journal, args):
    import shutil

    journal = tmp_path / "j"
    shutil.copytree(big_journal, journal)
    proc = interruptible([sys.executable, "-c", STUCK_IN_WORKER, *args, "-j", str(journal)])
    with _reaped(proc):
        out, err = proc.communicate(timeout=60)  # ended by the one Ctrl-C its worker took
    assert proc.returncode == 130 and err == INTERRUPTED_LINE and out == "", (proc.returncode, err)


def test_ctrl_c_stops_follow_quietly(big_journal):
    proc = _start("inspect", "-j", big_journal, "-f")
    _out, err = _interrupt(proc, lambda _pid: proc.stdout.readline(), "the backlog (then it follows)")
    assert proc.returncode == 0 and err == ""


@pytest.mark.parametrize("args, status", [(["inspect"], 0), (["inspect", "--json"], 0), (["fsck"], 0),
                                          (["fsck", "--json"], 0), (["replay", "--json"], 0)],
                         ids=lambda a: " ".join(a) if isinstance(a, list) else str(a))
def test_a_closed_pipe_ends_the_command_cleanly(tmp_path, args, status):
    journal = tmp_path / "j"
    with Journal.open(journal) as j:
        for i in range(30000):
            j.alloc("cuda:0", i, 64, "kv")  # a listing far larger than a pipe's buffer
    shell = f"{' '.join(KVJ)} {' '.join(args)} -j {journal} | head -c 10 >/dev/null; echo ${{PIPESTATUS[0]}}"
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env(), timeout=300)
    assert proc.stdout.strip() == str(status) and proc.stderr == "", proc.stderr


def test_kvj_alone_is_a_usage_error():
    proc = kvj()
    assert proc.returncode == 64 and proc.stdout == ""
    assert "Usage: kvj" in proc.stderr and "recover" in proc.stderr
    proc = kvj("record")
    assert proc.returncode == 64 and "Usage: kvj record" in proc.stderr
