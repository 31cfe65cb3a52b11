"""Real SIGKILLs of a writer process under load, each followed by recovery and checks.

The child (``killchild.py``) appends from several threads, syncs in a loop and (once the
segment store's flush path exists) flushes KV segments, reporting each acknowledged LSN
on a side channel. The parent kills it at a random moment, sometimes before it finished
opening the journal (so recovery itself is killed), and checks:

* replay succeeds and reaches every LSN acknowledged before the kill;
* every record is exactly what its writer appended (records are a pure function of
  run, thread and sequence number), runs appear in order, and no appender's sequence has
  a hole (nothing lost in the middle, nothing from nowhere);
* every flushed segment the journal references restores bit-exactly;
* the next writer opens the journal (the next child, or the parent at the end).

Also: a second writer on a live journal fails with an error naming the holder's pid.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from support.cli_helpers import KVJ
from support.kill import Compactor, Tally, check_journal_after_kill, kill, run_kills, side_lines, spawn, wait_ready
from support.wait import wait_progressing

from kvj import Journal
from kvj.errors import JournalLocked


def test_kills_fast(tmp_path):
    """A handful of real kills (about 10 s)."""
    t0 = time.monotonic()
    tally = run_kills(str(tmp_path), n_kills=12, seed=1, flush_every=4)
    print(f"\nkills: {tally.kills} ({tally.killed_in_recovery} early), records checked {tally.records_checked}, "
          f"segments checked {tally.segments_checked}, compactor kills {tally.compactor_kills}, "
          f"{time.monotonic() - t0:.1f}s")
    assert tally.kills == 12 and tally.acked_max > 0 and tally.records_checked > 0
    assert tally.segments_checked > 0, "no flushed segment was restored and compared after any kill"


@pytest.mark.slow
def test_kills_full(tmp_path):
    """At least 200 real kills under load."""
    t0 = time.monotonic()
    tally = run_kills(str(tmp_path), n_kills=200, seed=2, flush_every=3)
    print(f"\nkills: {tally.kills} ({tally.killed_in_recovery} during start-up/recovery), records checked "
          f"{tally.records_checked}, segments checked {tally.segments_checked}, compactor kills "
          f"{tally.compactor_kills}, {time.monotonic() - t0:.0f}s")
    assert tally.kills >= 200 and tally.records_checked > 0
    assert tally.segments_checked > 0, "no flushed segment was restored and compared after any kill"


@pytest.mark.parametrize("flushes", [40, pytest.param(400, marks=pytest.mark.slow)])
def test_collection_at_grace_0_beside_a_live_writer_keeps_every_acknowledged_segment(tmp_path, flushes):
    """A compactor collecting every unreferenced segment at once (grace 0), in a loop, beside a
    writer that flushes requests' blocks, ends every other request and flushes the same blocks
    again for the next (dedup hits on segments nothing references): once the writer acknowledged
    ``flushes`` flush rounds it is killed, and every segment of every request in flight restores
    bit-exactly and fsck is clean. (Without the writer's claims, segments stored or deduplicated
    but not yet journaled were collected: fsck exit 4, "not in store".)"""
    journal = str(tmp_path / "j")
    child = spawn(journal, str(tmp_path), 0, 41, flush=True)
    compactor = Compactor(journal)
    try:
        wait_ready(child)
        compactor.start()
        rounds = lambda: sum(1 for line in side_lines(child) if line.startswith("S "))  # noqa: E731
        wait_progressing(lambda: rounds() >= flushes or child.proc.poll() is not None, rounds,
                         f"{flushes} acknowledged flush rounds")
        compactor.check_alive()
    finally:
        compactor.kill()
        acked, flushed = kill(child)
    tally = Tally()
    check_journal_after_kill(journal, acked, tally)
    assert flushed > 0 and tally.segments_checked > 0
    fsck = subprocess.run([*KVJ, "fsck", "-n", "-j", journal], capture_output=True, text=True, timeout=300)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    print(f"\nflush rounds acknowledged {flushes}, segments checked {tally.segments_checked}")


def test_second_writer_fails_naming_the_holder(tmp_path):
    """A second writer, in this process or another, gets JournalLocked naming the live
    writer's pid; once that writer is killed, the lock is free."""
    journal = str(tmp_path / "j")
    child = spawn(journal, str(tmp_path), 0, 0, flush=False)
    try:
        wait_ready(child)
        with pytest.raises(JournalLocked) as info:
            Journal.open(journal)
        assert info.value.pid == child.proc.pid
        assert str(child.proc.pid) in str(info.value)
        second = subprocess.run([sys.executable, "-c", "import sys, kvj; kvj.Journal.open(sys.argv[1])", journal],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert "JournalLocked" in second.stderr and f"pid {child.proc.pid}" in second.stderr, second.stderr
    finally:
        acked, _ = kill(child)
    with Journal.open(journal) as j:
        assert j.alloc("parent", 0, 1, durable=True) > acked
