"""Compaction from another process during live writing, with readers following the journal.

A writer process (``killchild.py``) appends from two threads and syncs in a loop,
reporting acknowledged LSNs on a side channel; a compactor process compacts the journal
over and over (snapshot, delete sealed logs); in this process a ``Follower`` tails the
journal and reader threads re-read it from scratch (``replay`` + ``RecordStream``) again
and again. Checked:

* a follower sees every LSN exactly once, in order, each record exactly what the
  writer appended (records are a pure function of run, thread and sequence number): it
  never sees a torn or partial record, and compaction never makes it skip or repeat;
* every full re-read (``kvj.replay``) succeeds, reaches at least the LSN acknowledged
  before it started, and its state is consistent (no holes in any appender's sequence);
* at the end (writer killed) the journal replays, holds everything acknowledged, and
  a new writer continues it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List

import pytest
from support.crashcheck import add_figure, read_records
from support.kill import Tally, check_allocations, check_journal_after_kill, kill, side_lines, spawn, wait_ready
from support.killchild import alloc_payload, parse_device

from kvj import Journal, RecordType, replay
from kvj.errors import KvjError
from kvj.journal.follow import Follower
from kvj.journal.snapshot import list_snapshots

COMPACTOR = """
import sys, time
from kvj.ops.compact import compact
path, until, min_cycles, deadline = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
cycles = 0
while (time.time() < until or cycles < min_cycles) and time.time() < deadline:
    compact(path)
    cycles += 1
    time.sleep(0.1)
print(cycles)
"""


@dataclass
class Seen:
    """What the readers observed."""

    follower_records: int = 0
    follower_restarts: int = 0  # fell behind a compaction and started again after its snapshot
    follower_skips: int = 0  # LSN ranges the follower jumped over and reported in ``skipped``
    rereads: int = 0
    reread_errors: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)


def acked_so_far(child) -> int:
    best = 0
    for line in side_lines(child):
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("A", "S"):
            best = max(best, int(parts[1]))
    return best


class FollowCheck:
    """One follower's view, checked poll by poll: every record is the next LSN and exactly what
    was appended, and every LSN it jumps over is one its ``skipped`` reports, in a range a
    snapshot covered when the poll returned (compaction deleted the log holding it). A
    follower that silently drops records, or reports a skip no snapshot explains, is caught."""

    def __init__(self, journal: str, seen: Seen, make: Callable[..., Follower] = Follower):
        self.journal, self.seen, self.make = journal, seen, make
        self.follower = make(journal)
        self.expected = 1

    def poll(self) -> bool:
        """One poll and its checks; False once a problem was found (it is in ``seen.problems``)."""
        seen, follower = self.seen, self.follower
        reported = len(follower.skipped)
        try:
            batch = follower.poll()
        except KvjError as exc:
            snaps = list_snapshots(self.journal)
            if snaps and snaps[0][0] >= self.expected:
                seen.follower_restarts += 1  # fell behind: this test starts a new follower after the snapshot
                self.expected = snaps[0][0] + 1
                self.follower = self.make(self.journal, after_lsn=snaps[0][0])
                return True
            seen.problems.append(f"follower: {type(exc).__name__}: {exc}")
            return False
        covered = max((lsn for lsn, _ in list_snapshots(self.journal)), default=0)
        jumps = []
        for rec in batch:
            if rec.lsn > self.expected:
                jumps.append((self.expected, rec.lsn - 1))
                if rec.lsn - 1 > covered:
                    seen.problems.append(f"follower: jumped over LSNs {self.expected}..{rec.lsn - 1}, but the "
                                         f"newest snapshot covers only up to {covered}")
                    return False
                self.expected = rec.lsn
            if rec.lsn != self.expected:
                seen.problems.append(f"follower: LSN {rec.lsn} where {self.expected} was due")
                return False
            if rec.rtype == RecordType.ALLOC:
                run, tid = parse_device(rec.payload["device"])
                if rec.payload != alloc_payload(run, tid, rec.payload["addr"]):
                    seen.problems.append(f"follower: LSN {rec.lsn} is not what was appended")
                    return False
            self.expected += 1
            seen.follower_records += 1
        if follower.skipped[reported:] != jumps:
            seen.problems.append(f"follower: jumped over {jumps} but reported skipping {follower.skipped[reported:]}")
            return False
        seen.follower_skips += len(jumps)
        return True


def follow(journal: str, stop: threading.Event, seen: Seen) -> None:
    """Tail the journal with a ``FollowCheck`` until ``stop`` (or a problem).

    A follower that falls behind a compaction (the log it needed was folded into a
    snapshot and deleted) cannot see those records any more; it continues after the
    snapshot and says so in ``skipped`` (see test_follower_that_falls_behind_compaction_says_so)."""
    check = FollowCheck(journal, seen)
    while not stop.is_set() and check.poll():
        time.sleep(0.002)


def reread(journal: str, child, stop: threading.Event, seen: Seen) -> None:
    """Re-read the whole journal again and again; each read reaches what was acked before it."""
    while not stop.is_set():
        acked = acked_so_far(child)
        try:
            state = replay(journal)
            assert state.last_lsn >= acked, f"acknowledged LSN {acked} missing: replay ends at {state.last_lsn}"
            check_allocations(state)
        except KvjError as exc:
            seen.reread_errors.append(f"{type(exc).__name__}: {exc}")
        except FileNotFoundError as exc:
            seen.reread_errors.append(f"FileNotFoundError: {exc}")
        except AssertionError as exc:
            seen.problems.append(f"re-read: {exc}")
            return
        seen.rereads += 1


def run_concurrent(tmp: str, seconds: float, run: int = 0, min_cycles: int = 3) -> Seen:
    journal = os.path.join(tmp, "j")
    child = spawn(journal, tmp, run, seed=run, flush=False)
    seen = Seen()
    stop = threading.Event()
    try:
        wait_ready(child)
        now = time.time()  # run for ``seconds`` and at least ``min_cycles`` compactions (a loaded box is slow)
        compactor = subprocess.Popen([sys.executable, "-c", COMPACTOR, journal, str(now + seconds), str(min_cycles),
                                      str(now + seconds + 120)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        readers = [threading.Thread(target=follow, args=(journal, stop, seen)),
                   threading.Thread(target=reread, args=(journal, child, stop, seen))]
        for t in readers:
            t.start()
        out, err = compactor.communicate(timeout=seconds + 240)
        assert compactor.returncode == 0, f"the compactor failed:\n{err[-3000:]}"
        cycles = int(out.strip() or 0)
    finally:
        stop.set()
        acked, _ = kill(child)
    for t in readers:
        t.join(30)
    assert not seen.problems, "\n".join(seen.problems[:5])
    tally = Tally()
    last = check_journal_after_kill(journal, acked, tally)
    with Journal.open(journal) as j:
        assert j.alloc("parent", 0, 1, durable=True) == last + 1
    state, _records = read_records(journal)
    assert state.snapshot_lsn > 0, "compaction never produced a snapshot"
    print(f"\nconcurrency: {cycles} compactions, follower saw {seen.follower_records} records "
          f"(restarted after a snapshot {seen.follower_restarts} times, "
          f"reported skipping {seen.follower_skips} compacted ranges), "
          f"{seen.rereads} full re-reads ({len(seen.reread_errors)} failed), acked {acked}, last LSN {last}")
    add_figure("compactions during live writing", cycles)
    seen.cycles = cycles  # type: ignore[attr-defined]
    return seen


def test_compaction_during_live_writing_fast(tmp_path):
    seen = run_concurrent(str(tmp_path), seconds=6)
    assert seen.follower_records > 0 and seen.rereads > 0 and seen.cycles >= 3  # type: ignore[attr-defined]
    assert not seen.reread_errors, f"re-reads failed while compaction ran: {seen.reread_errors[:3]}"


@pytest.mark.slow
def test_compaction_during_live_writing_full(tmp_path):
    seen = run_concurrent(str(tmp_path), seconds=60, run=1, min_cycles=30)
    assert seen.cycles >= 30  # type: ignore[attr-defined]  (each folds a growing snapshot)
    assert not seen.reread_errors, f"re-reads failed while compaction ran: {seen.reread_errors[:3]}"


def _journal_with_sealed_logs(path: str, records: int) -> None:
    """``records`` allocations in log files of 400 bytes (many sealed files), compacted halfway."""
    from kvj.ops.compact import compact
    with Journal.open(path, policy=__import__("kvj").CommitPolicy(file_size_limit=400)) as j:
        for i in range(records):
            j.alloc("parent", i, 1, durable=True)
            if i == records // 2:
                compact(path)


def _replay_compacting_after_its_first_group(path: str, monkeypatch):
    """Replay ``path``, compacting it once the first group is read (S2 replaces S1, and the
    logs after S1 go mid-pass): (the state, the first group LSN of each group read, the
    compaction's result, how many times the pass held its files)."""
    from kvj.ops.compact import compact
    replay_mod = sys.modules["kvj.journal.replay"]  # the package exports a function of the same name
    groups, compactions, pins = [], [], []

    def compact_once(group):
        groups.append(group.records[0].lsn)
        if not compactions:
            compactions.append(compact(path))

    real_pin = replay_mod.pin
    monkeypatch.setattr(replay_mod, "pin", lambda p: pins.append(p) or real_pin(p))
    state = replay(path, on_group=compact_once)
    return state, groups, compactions[0], len(pins)


def test_a_compaction_during_replay_does_not_disturb_its_pass(tmp_path, monkeypatch):
    """Regression (the cause of test_compaction_during_live_writing_full's rare failure): replay
    loaded snapshot S1, a compactor wrote S2 and deleted the logs after S1 before the pass read
    them, and the pass started again; under back-to-back compactions every pass could. A pass
    now holds its files open first, so it reads them all once, the compaction notwithstanding."""
    path = str(tmp_path / "j")
    _journal_with_sealed_logs(path, 60)
    state, groups, compaction, pins = _replay_compacting_after_its_first_group(path, monkeypatch)
    assert len(compaction.logs_removed) > 5  # the files the pass had still to read
    assert pins == 1 and groups == sorted(set(groups)), f"the pass was made again: {groups}"
    assert state.last_lsn == 60 and sorted(state.allocations["parent"]) == list(range(60))


def test_beyond_the_files_it_holds_a_pass_that_loses_one_to_compaction_is_made_again(tmp_path, monkeypatch):
    """A pass holds at most MAX_PINNED_LOGS log files; one after them that a compaction deletes
    before the pass reads it makes a fresh pass (the journal is fine), which sees it whole."""
    monkeypatch.setattr(sys.modules["kvj.journal.replay"], "MAX_PINNED_LOGS", 1)
    path = str(tmp_path / "j")
    _journal_with_sealed_logs(path, 60)
    state, _groups, compaction, pins = _replay_compacting_after_its_first_group(path, monkeypatch)
    assert compaction.logs_removed and pins == 2  # a second pass, from S2
    assert state.last_lsn == 60 and sorted(state.allocations["parent"]) == list(range(60))


def test_kvj_inspect_walks_what_it_held_while_a_compaction_deletes_it(tmp_path):
    """``kvj inspect``'s walk (``Entries``) holds its files as replay does: a compaction after
    its first record deletes the logs it has still to walk, and it shows every record anyway."""
    from kvj.ops.compact import compact
    from kvj.ops.inspection import Entries
    path = str(tmp_path / "j")
    _journal_with_sealed_logs(path, 60)
    snapshot = list_snapshots(path)[0][0]
    entries, lsns, removed = Entries(path), [], []
    for entry in entries:
        lsns.append(entry.record.lsn)
        if not removed:
            removed = compact(path).logs_removed
    assert len(removed) > 5 and entries.after_lsn == snapshot
    assert lsns == list(range(snapshot + 1, 61))


def test_a_snapshot_written_while_a_pass_holds_its_files_makes_it_hold_them_again(tmp_path, monkeypatch):
    """A file that vanished while the pass was holding them is one the held snapshot covers,
    unless a newer snapshot appeared meanwhile: then the pass holds them all again."""
    from kvj.journal.source import Pinned
    from kvj.ops.compact import compact
    path = str(tmp_path / "j")
    _journal_with_sealed_logs(path, 60)
    real_hold, pins = Pinned.hold, []

    def hold_then_compact(self, file):
        if not self._fds:  # the first file of a pin: a compaction lands between listing and holding
            pins.append(file)
            if len(pins) == 1:
                compact(path)
        return real_hold(self, file)

    monkeypatch.setattr(Pinned, "hold", hold_then_compact)
    state = replay(path)
    assert len(pins) == 2 and pins[0] != pins[1], pins  # held S1, then S2
    assert state.last_lsn == 60 and sorted(state.allocations["parent"]) == list(range(60))


def test_replay_under_a_compaction_every_pass_says_the_journal_kept_changing(tmp_path, monkeypatch):
    """Regression: when a compaction deleted the logs after the snapshot of every pass, replay's
    last pass raised its CorruptionError ("LSNs ... are missing (missing log file?)") about a
    healthy journal (seen once in test_compaction_during_live_writing_full on a loaded machine).
    It says the journal kept changing instead, and a replay after the compactions stop reads it whole."""
    from kvj.errors import CorruptionError
    from kvj.journal.source import Pinned
    from kvj.ops.compact import compact
    replay_mod = sys.modules["kvj.journal.replay"]
    path = str(tmp_path / "j")
    with Journal.open(path, policy=__import__("kvj").CommitPolicy(file_size_limit=400)) as j:
        addr = iter(range(10_000))
        for _ in range(30):
            j.alloc("parent", next(addr), 1, durable=True)
        compact(path)
        real_hold, pins = Pinned.hold, []

        def hold_then_compact(self, file):
            if not self._fds:  # every pin: sealed logs after the snapshot listed, then a compaction
                for _ in range(30):
                    j.alloc("parent", next(addr), 1, durable=True)
                compact(path)
                pins.append(file)
            return real_hold(self, file)

        monkeypatch.setattr(Pinned, "hold", hold_then_compact)
        with pytest.raises(KvjError, match="kept changing under replay") as raised:
            replay(path)
        assert not isinstance(raised.value, CorruptionError)
        assert len(pins) == replay_mod.COMPACTION_RETRIES + 1 and len(set(pins)) == len(pins), pins
        monkeypatch.setattr(Pinned, "hold", real_hold)
        state = replay(path)
        assert state.last_lsn == j.writer.last_lsn and len(state.allocations["parent"]) == next(addr)


def test_follower_that_falls_behind_compaction_says_so(tmp_path):
    """Follow, fall behind while the writer rotates through many files, a compaction
    folds and deletes them: the follower must not call the healthy journal corrupt. It
    may continue after the snapshot, or raise a KvjError that says it fell behind."""
    from kvj import CommitPolicy
    from kvj.errors import CorruptionError
    from kvj.ops.compact import compact
    path = str(tmp_path / "j")
    with Journal.open(path, policy=CommitPolicy(file_size_limit=300)) as j:
        for i in range(10):
            j.alloc("parent", i, 1, durable=True)
        follower = Follower(path)
        assert [r.lsn for r in follower.poll()] == list(range(1, 11))
        for i in range(10, 100):
            j.alloc("parent", i, 1, durable=True)
        compact(path)
        for i in range(100, 110):
            j.alloc("parent", i, 1, durable=True)
        try:
            batch = follower.poll()
        except CorruptionError as exc:
            raise AssertionError(f"a healthy journal reported as corrupt: {exc}")
        except KvjError as exc:
            assert "compact" in str(exc) or "snapshot" in str(exc), exc
        else:
            snap = list_snapshots(path)[0][0]
            assert batch and batch[0].lsn == snap + 1 and batch[-1].lsn == 110
            assert [r.lsn for r in batch] == list(range(snap + 1, 111))


@pytest.mark.parametrize("broken", ["drops silently", "reports a skip no snapshot covers"])
def test_follow_check_catches_a_follower_that_drops_records(tmp_path, broken):
    """The check above must fail a follower that loses records. A snapshot covers LSN 20 while
    the log still holds every record (a compaction that has not deleted its files yet): the
    old check let a follower jump over any LSN such a snapshot covers without saying so."""
    from kvj.journal.snapshot import write_snapshot

    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        for i in range(30):
            j.append(RecordType.ALLOC, alloc_payload(0, 0, i), durable=i % 10 == 9)
    write_snapshot(path, replay(path, at_lsn=20))
    drop = 15 if broken == "drops silently" else 25

    class Dropping(Follower):
        def poll(self):
            batch = super().poll()
            if broken != "drops silently":
                self.skipped += [(drop, drop)] if any(r.lsn == drop for r in batch) else []
            return [r for r in batch if r.lsn != drop]

    honest, lossy = Seen(), Seen()
    assert FollowCheck(path, honest).poll() and honest.follower_records == 30 and not honest.problems
    assert not FollowCheck(path, lossy, make=Dropping).poll()
    assert lossy.problems and f"{drop}" in lossy.problems[0], lossy.problems
