"""Real SIGKILLs of a journal writer process (``killchild.py``) and the checks after each.

Shared by the kill and concurrency tests: spawn a writer, wait for it, kill it at a random
moment, then check the journal it left (every acknowledged record, no holes, segments
restore bit-exactly) and that the next writer can open it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from kvj import Journal, RecordType
from support.crashcheck import add_figure, read_records
from support.killchild import alloc_payload, flush_tensor, parse_device

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "killchild.py")
KILLS_PER_JOURNAL = 25


@dataclass
class Child:
    proc: subprocess.Popen
    side: str
    run: int


@dataclass
class Tally:
    """What the kill runs saw, for the figures."""

    kills: int = 0
    killed_in_recovery: int = 0
    acked_max: int = 0
    records_checked: int = 0
    segments_checked: int = 0
    compactor_kills: int = 0
    kill_times: List[float] = field(default_factory=list)


def spawn(journal: str, side_dir: str, run: int, seed: int, flush: bool) -> Child:
    side = os.path.join(side_dir, f"side-{run}.txt")
    args = [sys.executable, CHILD, journal, side, str(run), str(seed), "--threads", "2"]
    if flush:
        args.append("--flush")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return Child(proc, side, run)


def side_lines(child: Child) -> List[str]:
    try:
        with open(child.side) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def wait_ready(child: Child, timeout: float = 300.0, what: str = "ready") -> None:
    """Wait until the child wrote a side-channel line starting with ``what`` ("ready": it
    opened the journal; "S ": a flush is durable); fail with its stderr if it died instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line.startswith(what) for line in side_lines(child)):
            return
        if child.proc.poll() is not None:
            raise AssertionError(f"writer run {child.run} exited with {child.proc.returncode} before "
                                 f"{what!r}:\n{child.proc.stderr.read().decode(errors='replace')}")
        time.sleep(0.005)
    raise AssertionError(f"writer run {child.run}: no {what!r} after {timeout}s")


def kill(child: Child) -> Tuple[int, int]:
    """SIGKILL the child; returns (highest acknowledged LSN, highest LSN acknowledged by a flush)."""
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(30)
    err = child.proc.stderr.read().decode(errors="replace")
    assert child.proc.returncode == -signal.SIGKILL, f"writer died on its own ({child.proc.returncode}):\n{err}"
    acked = flushed = 0
    for line in side_lines(child):
        parts = line.split()
        if len(parts) == 2 and parts[0] == "A":
            acked = max(acked, int(parts[1]))
        elif len(parts) == 2 and parts[0] == "S":
            flushed = max(flushed, int(parts[1]))
    return max(acked, flushed), flushed


def check_journal_after_kill(journal: str, acked: int, tally: Tally) -> int:
    """The checks listed in the module docstring; returns the journal's last LSN."""
    state, records = read_records(journal)
    last = records[-1][0] if records else state.snapshot_lsn
    assert last >= acked, f"acknowledged LSN {acked} lost: the journal ends at {last}"
    run_seen = 0
    for lsn, rtype, payload in records:
        if rtype == RecordType.ALLOC:
            run, tid = parse_device(payload["device"])
            assert payload == alloc_payload(run, tid, payload["addr"]), f"LSN {lsn}: record is not what was appended"
        elif rtype in (RecordType.START, RecordType.SEGMENT, RecordType.END):
            run = int(payload["id"][1:].split("-")[0])
        else:
            raise AssertionError(f"LSN {lsn}: a record type the writer never appends ({rtype})")
        assert run >= run_seen, f"LSN {lsn}: run {run} after run {run_seen}"
        run_seen = run
    check_allocations(state)
    tally.records_checked += len(records)
    tally.segments_checked += check_segments(journal, state)
    return last


def check_allocations(state) -> None:
    """No holes: each appender's records are a prefix of its sequence (also across a
    snapshot), in order, each exactly what was appended."""
    for device, allocs in state.allocations.items():
        if device == "parent":
            continue
        run, tid = parse_device(device)
        addrs = sorted(allocs)
        assert addrs == list(range(len(addrs))), f"{device}: missing records in the middle of its sequence"
        lsns = [allocs[a].lsn for a in addrs]
        assert lsns == sorted(lsns), f"{device}: records out of order"
        for a in addrs:
            want = alloc_payload(run, tid, a)
            assert (allocs[a].size, allocs[a].tag) == (want["size"], want["tag"]), f"{device}/{a} differs"


def check_segments(journal: str, state) -> int:
    """Every flushed segment of an in-flight request restores to exactly the flushed tensor."""
    n = 0
    for req in state.in_flight():
        run, q = (int(x) for x in req.id[1:].split("-q"))
        segs = sorted(req.segments)
        assert segs == list(range(len(segs))), f"{req.id}: segments {segs} have a hole"
        if not segs:
            continue
        from kvj.segments.store import SegmentStore
        store = SegmentStore(os.path.join(journal, "segments"))
        for s in segs:
            got = store.get(req.segments[s].key)
            want = flush_tensor(run, q, s)
            assert got.dtype == want.dtype and got.shape == want.shape, f"{req.id}/{s}: wrong dtype or shape"
            assert bytes(got.contiguous().view(-1).view(__import__("torch").uint8).numpy()) == \
                bytes(want.contiguous().view(-1).view(__import__("torch").uint8).numpy()), \
                f"{req.id}/{s}: restored bytes differ from what was flushed"
            n += 1
    return n


COMPACTOR = """
import sys, time
from kvj.ops.compact import compact
path = sys.argv[1]
print("ready", flush=True)
while True:
    compact(path, grace=0)  # no grace period: only claims and references keep a segment
    time.sleep(0.02)
"""


class Compactor:
    """A compactor process looping over the journal, collecting every unreferenced segment at
    once (grace 0); SIGKILLed now and then too."""

    def __init__(self, journal: str):
        self.journal = journal
        self.proc: Optional[subprocess.Popen] = None
        self.kills = 0

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", COMPACTOR, self.journal], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def check_alive(self) -> None:
        """The compactor must not have died on its own (e.g. on a crashed writer's journal)."""
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the compactor died ({self.proc.returncode}):\n{self.proc.stderr.read()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None:
            self.check_alive()
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            self.proc.stdout.close()
            self.proc.stderr.close()
            self.proc = None
            self.kills += 1


def run_kills(tmp: str, n_kills: int, seed: int, flush_every: int = 0, compaction: bool = True) -> Tally:
    """``n_kills`` kill cycles on journals of ``KILLS_PER_JOURNAL`` kills each, with a
    compactor process running concurrently (itself killed now and then).

    While no segment of the current journal has been checked, a flushing run is killed only
    after its first flush is durable (a condition, not a time: on a loaded machine a random
    delay can end every flushing run before its first flush), so that every journal's
    segments are restored and compared, not only its records."""
    rng = random.Random(seed)
    tally = Tally()
    acked = 0
    journal = ""
    compactor: Optional[Compactor] = None
    segments_before = 0  # tally.segments_checked when the current journal began
    for run in range(n_kills):
        if run % KILLS_PER_JOURNAL == 0:
            if compactor is not None:
                compactor.kill()
            journal = os.path.join(tmp, f"journal-{run // KILLS_PER_JOURNAL}")
            acked = 0
            segments_before = tally.segments_checked
            compactor = Compactor(journal) if compaction else None
        if compactor is not None and compactor.proc is None and run % KILLS_PER_JOURNAL != 0:
            compactor.start()  # once the journal exists
        flush = bool(flush_every) and run % flush_every == flush_every - 1
        child = spawn(journal, tmp, run, seed, flush)
        early = rng.random() < 0.1 and run % KILLS_PER_JOURNAL != 0
        if early:
            time.sleep(rng.uniform(0.0, 0.4))  # maybe still importing, maybe recovering, maybe writing
            tally.killed_in_recovery += 1
        else:
            wait_ready(child)
            if flush and tally.segments_checked == segments_before:
                wait_ready(child, what="S ")
            delay = rng.uniform(0.01, 0.5)
            tally.kill_times.append(delay)
            time.sleep(delay)
        run_acked, _ = kill(child)
        acked = max(acked, run_acked)
        if compactor is not None and compactor.proc is not None:
            if rng.random() < 0.3:
                compactor.kill()  # a compactor dies mid-compaction now and then
            else:
                compactor.check_alive()
        tally.kills += 1
        tally.acked_max = max(tally.acked_max, acked)
        if os.path.isdir(journal):
            try:
                check_journal_after_kill(journal, acked, tally)
            except Exception as exc:
                exc.add_note(f"seed {seed}, kill #{run} ({'early' if early else 'after ready'}), journal {journal}")
                raise
        if run % KILLS_PER_JOURNAL == KILLS_PER_JOURNAL - 1 or run == n_kills - 1:
            # the parent is the last writer: it recovers the journal and continues it
            with Journal.open(journal) as j:
                lsn = j.alloc("parent", 0, 1, durable=True)
            assert lsn > acked
    if compactor is not None:
        compactor.kill()
        tally.compactor_kills += compactor.kills
    add_figure("writer processes SIGKILLed", tally.kills)
    return tally
