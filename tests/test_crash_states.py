"""Simulated power loss: every crash state a disk allows, checked against the journal contract.

Each test runs a seeded random workload on a ``RecordingFS`` (appends, ``sync()``,
``durable=True`` appends, rotation through a tiny ``file_size_limit``, clean re-opens,
and simulated SIGKILLs followed by a new writer on the same page cache), then for every
crash point (after each logged I/O operation) constructs the crash states of
``crashfs`` (unsynced data dropped, reordered, torn at 512/4096 bytes with zeros or
garbage, unsynced directory entries vanishing) and checks each with
``crashcheck.check_journal``: replay succeeds, holds every acknowledged record in order,
holds nothing never appended, folds to the model state, and a re-opened writer continues.

"Double crash" tests crash again while recovery of a crashed state is running.

The default run checks a few hundred distinct states; ``-m slow`` checks at least 10,000.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import pytest

from crashcheck import Truth, add_figure, check_journal, random_record
from crashfs import (FAST_FS, FIXED_PLANS, CrashPlan, RecordingFS, SimulatedKill, crash_state, iter_crash_states,
                     random_plans)
from kvj import CommitPolicy, Journal
from kvj.errors import JournalFailed, KvjError

#: Groups form only at sync points (no timer, no record-count trigger), so a seed fixes the op log.
DETERMINISTIC = dict(max_delay=3600.0, max_records=1 << 30)


@dataclass
class Recorded:
    """A recorded workload: the FS log, the truth, and the journal's path."""

    fs: RecordingFS
    truth: Truth
    path: str


def open_journal(fs: RecordingFS, path: str, truth: Truth, policy: CommitPolicy) -> Journal:
    """Open a writer and tell the truth where it resumed."""
    j = Journal.open(path, fs=fs, policy=policy)
    truth.resume(j.writer.last_lsn + 1)
    return j


def ack(fs: RecordingFS, truth: Truth, lsn: int) -> None:
    """Log an acknowledgement in order with the I/O, and remember it."""
    fs.note(("acked", lsn))
    truth.ack(lsn)


def run_workload(fs: RecordingFS, path: str, rng: random.Random, truth: Truth, steps: int,
                 policy: CommitPolicy, kills: bool = True) -> None:
    """A random journal workload on ``fs``; simulated kills when ``kills``."""
    j = open_journal(fs, path, truth, policy)
    for _ in range(steps):
        r = rng.random()
        try:
            if r < 0.62:
                rtype, payload = random_record(rng)
                truth.add(j.writer.append(rtype, payload), rtype, payload)
            elif r < 0.82:
                ack(fs, truth, j.sync())
            elif r < 0.90:
                rtype, payload = random_record(rng)
                lsn = j.writer.last_lsn + 1
                truth.add(lsn, rtype, payload)
                assert j.writer.append(rtype, payload, durable=True) == lsn
                ack(fs, truth, lsn)
            elif r < 0.95 or not kills:
                j.close()
                ack(fs, truth, j.writer.last_lsn)
                j = open_journal(fs, path, truth, policy)
            else:
                # SIGKILL a few operations from now (often between a group's write and its fdatasync)
                fs.kill_at = len(fs.ops) + rng.randrange(1, 4)
        except (JournalFailed, SimulatedKill):
            assert fs.killed, "the journal failed without an injected kill"
        if fs.killed:
            j = restart(fs, j, path, truth, policy)
    while True:
        try:
            j.close()
            ack(fs, truth, j.writer.last_lsn)
            return
        except (JournalFailed, SimulatedKill):
            assert fs.killed, "the journal failed without an injected kill"
            j = restart(fs, j, path, truth, policy)


def restart(fs: RecordingFS, j: Journal, path: str, truth: Truth, policy: CommitPolicy) -> Journal:
    """After a simulated kill: drop the dead writer (its lock dies with it) and start a new one."""
    try:
        j.close()
    except (JournalFailed, SimulatedKill):
        pass
    fs.revive()
    return open_journal(fs, path, truth, policy)


def record(tmp: str, seed: int, steps: int, kills: bool = True) -> Recorded:
    """Record one seeded workload under ``tmp``."""
    rng = random.Random(seed)
    root = os.path.join(tmp, f"rec-{seed}")
    fs = RecordingFS(root)
    path = os.path.join(root, "journal")
    policy = CommitPolicy(file_size_limit=rng.choice([600, 1500, 5000, 64 << 20]), **DETERMINISTIC)
    truth = Truth()
    run_workload(fs, path, rng, truth, steps, policy, kills)
    return Recorded(fs, truth, path)


def acked_by_point(fs: RecordingFS) -> List[int]:
    """For each op count k, the highest LSN acknowledged within ops[:k]."""
    out, best = [0], 0
    for op in fs.ops:
        if op.kind == "note" and op.note[0] == "acked":
            best = max(best, op.note[1])
        out.append(best)
    return out


def check_all_states(rec: Recorded, scratch: str, points: Sequence[int], plans_for: Callable[[int], Sequence[CrashPlan]],
                     seed: int, base_acked: int = 0) -> int:
    """Check every distinct crash state of ``rec`` at ``points``; returns how many."""
    acked = acked_by_point(rec.fs)
    rel = os.path.relpath(rec.path, rec.fs.root)
    n = 0
    for k, plan, state_dir in iter_crash_states(rec.fs, points, plans_for, scratch):
        ctx = (f"seed {seed}, crash after {k} ops ({rec.fs.ops[k - 1].describe() if k else 'start'}), "
               f"plan {plan.name}/{plan.seed}")
        jpath = os.path.join(state_dir, rel)
        if not os.path.isdir(jpath):
            # the journal directory itself never became durable: only legal if nothing was acknowledged
            assert max(acked[k], base_acked) == 0, f"journal directory lost after an acknowledgement [{ctx}]"
        else:
            try:
                check_journal(jpath, rec.truth, max(acked[k], base_acked), reopen_fs=FAST_FS, context=ctx)
            except Exception as exc:
                exc.add_note(f"crash state: {ctx}")
                exc.add_note("recent ops:\n  " + "\n  ".join(op.describe() for op in rec.fs.ops[max(0, k - 12):k]))
                raise
        n += 1
    add_figure("crash states checked", n)
    return n


def plans(rng: random.Random, n_random: int) -> Callable[[int], Sequence[CrashPlan]]:
    return lambda k: list(FIXED_PLANS) + random_plans(rng, n_random)


def sample_points(fs: RecordingFS, rng: random.Random, limit: Optional[int]) -> List[int]:
    points = fs.crash_points
    if limit is not None and len(points) > limit:
        points = sorted(rng.sample(points, limit))
    return points


def run_seed(tmp: str, seed: int, steps: int, n_random: int, limit: Optional[int]) -> int:
    """Record one workload and check its crash states; returns the number checked."""
    rec = record(tmp, seed, steps)
    rng = random.Random(seed * 7919)
    return check_all_states(rec, os.path.join(tmp, f"scratch-{seed}"), sample_points(rec.fs, rng, limit),
                            plans(rng, n_random), seed)


def run_double_crash(tmp: str, seed: int, n_first: int, n_random: int) -> int:
    """Crash, then crash again while recovery (``Journal.open``'s tail cut) and new writes run."""
    rec = record(tmp, seed, steps=40)
    rng = random.Random(seed ^ 0x5EED)
    acked = acked_by_point(rec.fs)
    total = 0
    rel = os.path.relpath(rec.path, rec.fs.root)
    for i in range(n_first):
        k = rng.choice(rec.fs.crash_points)
        plan = rng.choice(list(FIXED_PLANS) + random_plans(rng, 4))
        root2 = os.path.join(tmp, f"second-{seed}-{i}")
        crash_state(rec.fs, k, plan, root2)
        if not os.path.isdir(os.path.join(root2, rel)):
            continue
        fs2 = RecordingFS(root2)
        truth2 = Truth(dict(rec.truth.records), acked[k])
        path2 = os.path.join(root2, rel)
        policy = CommitPolicy(file_size_limit=rng.choice([600, 5000]), **DETERMINISTIC)
        run_workload(fs2, path2, rng, truth2, steps=12, policy=policy, kills=False)
        rec2 = Recorded(fs2, truth2, path2)
        total += check_all_states(rec2, os.path.join(tmp, f"scratch2-{seed}-{i}"), fs2.crash_points,
                                  plans(rng, n_random), seed, base_acked=acked[k])
    return total


# -- default (fast) subset ------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_crash_states_fast(tmp_path, seed):
    """A few hundred crash states of short workloads with rotation and kills."""
    t0 = time.monotonic()
    n = run_seed(str(tmp_path), seed, steps=60, n_random=4, limit=None)
    print(f"\ncrash states (seed {seed}): {n} distinct, {time.monotonic() - t0:.1f}s")
    assert n >= 60


def test_double_crash_fast(tmp_path):
    """Crashes during recovery of a crashed journal."""
    n = run_double_crash(str(tmp_path), seed=11, n_first=3, n_random=2)
    print(f"\ndouble-crash states: {n}")
    assert n > 0


def test_kill_then_reopen_then_power_loss(tmp_path):
    """A writer is killed between a group's write and its fdatasync; a new writer opens the
    journal (seeing the unsynced group in the page cache), appends and syncs; then power
    fails. The new writer's acknowledged records must survive, so it must not build on
    data that is not durable (it has to make the old file durable first)."""
    root = str(tmp_path / "root")
    fs = RecordingFS(root)
    path = os.path.join(root, "j")
    truth = Truth()
    policy = CommitPolicy(**DETERMINISTIC)
    j = open_journal(fs, path, truth, policy)
    for i in range(3):
        truth.add(j.writer.append(4, {"device": "d", "addr": i, "size": 1, "tag": ""}), 4,
                  {"device": "d", "addr": i, "size": 1, "tag": ""})
    ack(fs, truth, j.sync())
    truth.add(j.writer.append(4, {"device": "d", "addr": 99, "size": 1, "tag": ""}), 4,
              {"device": "d", "addr": 99, "size": 1, "tag": ""})
    fs.kill_at = len(fs.ops) + 2  # the group's header and body are written, its fdatasync is not
    with pytest.raises(JournalFailed):
        j.sync()
    try:
        j.close()
    except JournalFailed:
        pass
    fs.revive()
    j = open_journal(fs, path, truth, policy)
    truth.add(j.writer.append(4, {"device": "d", "addr": 7, "size": 1, "tag": ""}), 4,
              {"device": "d", "addr": 7, "size": 1, "tag": ""})
    ack(fs, truth, j.sync())
    j.close()
    state = str(tmp_path / "state")
    crash_state(fs, len(fs.ops), CrashPlan("synced-only"), state)
    check_journal(os.path.join(state, "j"), truth, truth.acked, reopen_fs=FAST_FS)


class _NoDirSyncFS(RecordingFS):
    """A broken disk layer: directory fsyncs never happen."""

    def fsync_dir(self, path):  # type: ignore[override]
        pass


class _NoDataSyncFS(RecordingFS):
    """A broken disk layer: fdatasync never happens."""

    def fdatasync(self, fd):  # type: ignore[override]
        pass


@pytest.mark.parametrize("broken", [_NoDirSyncFS, _NoDataSyncFS])
def test_checker_catches_a_journal_that_skips_syncs(tmp_path, monkeypatch, broken):
    """The suite itself can fail: with fsyncs silently skipped, some crash state loses an
    acknowledged record or a log file, and the checker says so."""
    import test_crash_states as me
    monkeypatch.setattr(me, "RecordingFS", broken)
    with pytest.raises((AssertionError, KvjError)):
        run_seed(str(tmp_path), 1, steps=50, n_random=2, limit=None)


# -- full run --------------------------------------------------------------------------------

@pytest.mark.slow
def test_crash_states_full(tmp_path):
    """At least 10,000 distinct crash states over randomized workloads."""
    t0 = time.monotonic()
    total = 0
    seed = 100
    while total < 10_000:
        total += run_seed(str(tmp_path), seed, steps=120, n_random=6, limit=None)
        seed += 1
    total += run_double_crash(str(tmp_path), seed=7, n_first=25, n_random=4)
    print(f"\ncrash states checked: {total} over {seed - 100} workloads + double crashes, "
          f"{time.monotonic() - t0:.0f}s")
    assert total >= 10_000
