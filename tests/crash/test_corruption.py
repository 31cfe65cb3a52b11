"""Bit flips and overwritten byte ranges anywhere in journal, snapshot and segment files.

A golden journal (several rotated log files, a snapshot that replaced the oldest ones,
segment records) and its segment store (tensors of several dtypes and codecs) are built
once. Each trial copies them, damages one file (a flipped bit, a range overwritten with
random bytes, or a range zeroed) and checks:

* strict replay detects every damage to a log file or snapshot (every byte of both is
  covered by a CRC or an exact-match field), and non-strict replay either raises a
  ``KvjError`` or returns a prefix of the true records with the damage reported as a
  torn tail: never a record that differs from what was appended;
* reading a damaged segment raises ``SegmentCorrupt`` (every byte of a segment file is
  covered by a CRC, the digest or an exact-match field), never a tensor whose bytes differ;
* only ``KvjError``s escape, never a raw ``struct.error``/``KeyError``/...;
* fsck reports every damage.

Every trial's damage must be detected (detected == trials, asserted); the seeds are fixed,
and the slow run does 2,000 trials.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from support.crashcheck import Truth, add_figure, comparable, random_record

from kvj import CommitPolicy, Journal, replay
from kvj.errors import KvjError
from kvj.journal.reader import list_logs
from kvj.journal.replay import RecordStream
from kvj.journal.snapshot import list_snapshots, write_snapshot


@dataclass
class Golden:
    """The undamaged journal and what it must replay to."""

    path: str
    truth: Truth
    last_lsn: int
    snapshot_lsn: int
    tensors: Dict[str, torch.Tensor]  # segment key -> tensor

    def files(self) -> Dict[str, List[str]]:
        """Relative paths of the files a trial may damage, by kind."""
        logs = [os.path.relpath(p, self.path) for p in list_logs(self.path)]
        snaps = [os.path.relpath(p, self.path) for _, p in list_snapshots(self.path)]
        segs = []
        for dirpath, _, names in os.walk(os.path.join(self.path, "segments", "objects")):
            segs += [os.path.relpath(os.path.join(dirpath, n), self.path) for n in names if n.endswith(".kvjseg")]
        return {"log": sorted(logs), "snapshot": snaps, "segment": sorted(segs)}


def golden_tensors() -> List[Tuple[torch.Tensor, str]]:
    """Tensors of several dtypes and shapes, each with the codec to store it with."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((1, 64, 4, 32), generator=g).repeat(3, 1, 1, 1)  # repeated rows: compressible
    return [
        (torch.randn((4, 256), generator=g).to(torch.bfloat16), "byteplane"),
        (kv, "zstd"),
        (torch.randn((128, 33), generator=g, dtype=torch.float64), "raw"),
        (torch.randint(-128, 127, (700,), generator=g, dtype=torch.int8), "auto"),
        (torch.randn((64, 64), generator=g).half(), "auto"),
        (torch.rand((5, 7), generator=g) > 0.5, "auto"),
    ]


def build_golden(root: str) -> Golden:
    """A closed journal: rotated logs, a snapshot replacing the oldest, segment records."""
    from kvj.segments.store import SegmentStore
    rng = random.Random(1234)
    path = os.path.join(root, "golden")
    truth = Truth()
    tensors: Dict[str, torch.Tensor] = {}
    with Journal.open(path, policy=CommitPolicy(file_size_limit=3000)) as j:
        for i in range(150):
            rtype, payload = random_record(rng, big=0.02)
            truth.add(j.writer.append(rtype, payload), rtype, payload)
            if i % 10 == 9:
                j.sync()
        with SegmentStore(os.path.join(path, "segments")) as store:
            for n, (tensor, codec) in enumerate(golden_tensors()):
                info = store.put(tensor, layout={"model": "golden", "n": n}, codec=codec)
                tensors[info.key] = tensor
                rid = f"seg-req-{n}"
                truth.add(j.start(rid, prompt_hash="p"), 1, {"id": rid, "prompt_hash": "p", "tokens": None, "meta": {}})
                fut = j.flush(rid, 0, token_range=(0, 16), info=info)
                lsn = fut.result()
                truth.add(lsn, 2, {"id": rid, "seg": 0, "key": info.key, "tokens": [0, 16],
                                   "layout": dict(info.layout or {}), "raw_size": info.raw_size,
                                   "stored_size": info.stored_size, "digest": info.digest, "codec": info.codec})
        last = j.sync()
    # emulate a compaction: snapshot as of the end of the second log file, drop the files it covers
    logs = list_logs(path)
    assert len(logs) >= 4, "the golden journal should span several log files"
    records = list(RecordStream(path))
    snap_lsn = max(r.lsn for r in records if r.path in logs[:2])
    write_snapshot(path, replay(path, at_lsn=snap_lsn))
    for p in logs[:2]:
        os.unlink(p)
    # a last session, so that the newest log file holds groups (damage there is a torn tail)
    with Journal.open(path) as j:
        for _ in range(6):
            rtype, payload = random_record(rng, big=0.0)
            truth.add(j.writer.append(rtype, payload), rtype, payload)
            j.sync()
        last = j.writer.last_lsn
    golden = Golden(path, truth, last, snap_lsn, tensors)
    state = replay(path, strict=True)
    assert state.last_lsn == last and comparable(state) == truth.fold(last)
    return golden


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Golden:
    return build_golden(str(tmp_path_factory.mktemp("corruption")))


# -- damage -----------------------------------------------------------------------------------

@dataclass
class Damage:
    file: str  # relative to the journal
    kind: str  # flip, random, zero
    offset: int
    length: int

    def __str__(self) -> str:
        return f"{self.kind} [{self.offset}, {self.offset + self.length}) in {self.file}"


def damage_file(path: str, rng: random.Random, rel: str) -> Optional[Damage]:
    """Damage one file in place; None if the chosen damage would not change a byte."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if not data:
        return None
    kind = rng.choice(["flip", "flip", "random", "zero"])
    off = rng.randrange(len(data))
    if kind == "flip":
        length = 1
        data[off] ^= 1 << rng.randrange(8)
    else:
        length = min(len(data) - off, rng.choice([1, 2, 4, 8, 32, 512, 4096]))
        new = rng.randbytes(length) if kind == "random" else bytes(length)
        if new == bytes(data[off:off + length]):
            return None
        data[off:off + length] = new
    with open(path, "wb") as f:
        f.write(data)
    return Damage(rel, kind, off, length)


# -- outcome of one trial ---------------------------------------------------------------------

@dataclass
class Tally:
    trials: int = 0
    detected: int = 0
    tail_reported: int = 0  # newest log's last group damaged: non-strict replay reports a torn tail
    fsck_checked: int = 0
    by_kind: Dict[str, List[int]] = field(default_factory=dict)  # kind -> [trials, detected]

    def count(self, kind: str, detected: bool) -> None:
        self.trials += 1
        entry = self.by_kind.setdefault(kind, [0, 0])
        entry[0] += 1
        if detected:
            self.detected += 1
            entry[1] += 1


def journal_trial(g: Golden, trial_path: str, dmg: Damage, tally: Tally) -> bool:
    """Damage in a log file or snapshot: detected by strict replay, never a wrong record."""
    detected = False
    try:
        state = replay(trial_path, strict=True)
        records = [(r.lsn, r.rtype, r.payload) for r in RecordStream(trial_path, after_lsn=state.snapshot_lsn,
                                                                        strict=True)]
    except KvjError:
        detected = True
    else:
        # not detected: then it must be exactly the truth (the damage missed every live byte)
        assert state.last_lsn == g.last_lsn and comparable(state) == g.truth.fold(g.last_lsn), \
            f"strict replay returned a wrong state after {dmg}"
        for lsn, rtype, payload in records:
            assert g.truth.records[lsn] == (rtype, payload), f"strict replay returned a wrong record after {dmg}"
    # non-strict: an error, or a prefix of the truth with the loss reported as a torn tail
    try:
        state = replay(trial_path)
        stream = RecordStream(trial_path, after_lsn=state.snapshot_lsn)
        records = [(r.lsn, r.rtype, r.payload) for r in stream]
    except KvjError:
        pass
    else:
        last = records[-1][0] if records else state.snapshot_lsn
        for lsn, rtype, payload in records:
            assert g.truth.records[lsn] == (rtype, payload), f"replay returned a wrong record after {dmg}"
        assert comparable(state) == g.truth.fold(last), f"replay returned a wrong state after {dmg}"
        if last < g.last_lsn:
            assert state.tail is not None, f"replay silently lost LSNs {last + 1}..{g.last_lsn} after {dmg}"
            tally.tail_reported += 1
    writer_agrees(trial_path, str(dmg))
    return detected


def writer_agrees(path: str, what: str) -> None:
    """The writer judges a journal by the readers' rule: it opens one only where replay (what
    recovery reads) accepts it too, and a record it then acknowledges as durable is replayed."""
    try:
        replay(path)
        readable = True
    except KvjError:
        readable = False
    try:
        with Journal.open(path) as j:
            lsn = j.start("after-damage", durable=True)
    except KvjError:
        assert not readable, f"the writer refused a journal replay accepts after {what}"
        return
    assert readable, f"the writer opened a journal replay refuses after {what}"
    state = replay(path)
    assert state.last_lsn >= lsn and "after-damage" in state.requests, \
        f"a record the writer acknowledged after {what} is not replayed"


def segment_trial(g: Golden, trial_path: str, dmg: Damage) -> bool:
    """Damage in a segment file: SegmentCorrupt, or exactly the right tensor."""
    from kvj.segments.store import SegmentStore
    key = os.path.basename(dmg.file)[:-len(".kvjseg")]
    want = g.tensors[key]
    detected = False
    with SegmentStore(os.path.join(trial_path, "segments")) as store:
        for read in (store.get, store.verify, store.info):
            try:
                got = read(key)
            except KvjError:
                detected = True
                continue
            if read is store.get:
                assert got.dtype == want.dtype and got.shape == want.shape, f"wrong tensor metadata after {dmg}"
                assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bool else got,
                                   want.view(torch.uint8) if want.dtype != torch.bool else want), \
                    f"a wrong tensor was returned after {dmg}"
    return detected


def fsck_reports(trial_path: str) -> bool:
    """True when fsck (read-only) reports a problem: an error, or a warning for what recovery
    handles by itself (damage in the newest log's last group is the end of the log)."""
    from kvj.ops.fsck import fsck
    result = fsck(trial_path, repair=False)
    return any(f.severity in ("error", "warning") for f in result.findings) or result.exit_code != 0


def run_trials(g: Golden, scratch: str, n: int, seed: int) -> Tally:
    rng = random.Random(seed)
    files = g.files()
    kinds = [k for k in ("log", "snapshot", "segment") if files[k]]
    tally = Tally()
    i = 0
    while tally.trials < n:
        kind = rng.choice(kinds)
        rel = rng.choice(files[kind])
        trial = os.path.join(scratch, f"trial-{i}")
        i += 1
        shutil.copytree(g.path, trial)
        try:
            dmg = damage_file(os.path.join(trial, rel), rng, rel)
            if dmg is None:
                continue
            try:
                detected = segment_trial(g, trial, dmg) if kind == "segment" else journal_trial(g, trial, dmg, tally)
            except KvjError:
                raise
            except AssertionError:
                raise
            except Exception as exc:
                raise AssertionError(f"an unclean {type(exc).__name__} escaped after {dmg}: {exc}") from exc
            assert detected, f"{'a segment read' if kind == 'segment' else 'strict replay'} did not detect {dmg}"
            assert fsck_reports(trial), f"fsck did not report {dmg}"
            tally.fsck_checked += 1
            tally.count(kind, detected)
        finally:
            shutil.rmtree(trial, ignore_errors=True)
    return tally


def report(tally: Tally, seconds: float) -> str:
    rate = tally.detected / tally.trials
    parts = ", ".join(f"{k} {d}/{t}" for k, (t, d) in sorted(tally.by_kind.items()))
    add_figure("corruption trials", tally.trials)
    add_figure("corruption trials detected", tally.detected)
    return (f"corruption trials: {tally.trials}, detected {tally.detected} ({100 * rate:.2f}%; {parts}); "
            f"tail damage reported as torn tail {tally.tail_reported}; "
            f"fsck checked {tally.fsck_checked}; {seconds:.1f}s")


def test_corruption_fast(golden, tmp_path):
    t0 = time.monotonic()
    tally = run_trials(golden, str(tmp_path), n=300, seed=1)
    print("\n" + report(tally, time.monotonic() - t0))
    assert tally.detected == tally.trials == 300 and tally.fsck_checked == 300
    assert all(tally.by_kind[kind][0] > 0 for kind in ("log", "snapshot", "segment"))


@pytest.mark.slow
def test_corruption_full(golden, tmp_path):
    t0 = time.monotonic()
    tally = run_trials(golden, str(tmp_path), n=2000, seed=2)
    print("\n" + report(tally, time.monotonic() - t0))
    assert tally.detected == tally.trials == 2000 and tally.fsck_checked == 2000


def test_damaged_snapshot_is_an_error_not_a_silent_fallback(golden, tmp_path):
    """A damaged newest snapshot is reported; replay does not quietly start from scratch
    (its logs were deleted, so that would silently lose the compacted history), and the
    writer refuses it as replay does."""
    trial = str(tmp_path / "t")
    shutil.copytree(golden.path, trial)
    snap = list_snapshots(trial)[0][1]
    with open(snap, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(KvjError):
        replay(trial)
    with pytest.raises(KvjError):
        replay(trial, strict=True)
    with pytest.raises(KvjError):
        Journal.open(trial)


def _five_log_files(path: str) -> None:
    with Journal.open(path, policy=CommitPolicy(file_size_limit=8000)) as j:
        for i in range(600):
            j.start(f"r{i}", prompt_hash="p", tokens=list(range(8)))
            if i % 50 == 49:
                j.sync()
    assert len(list_logs(path)) >= 5


def _flip_in_first_log(path: str) -> None:
    first = list_logs(path)[0]
    with open(first, "r+b") as f:
        f.seek(min(3000, os.path.getsize(first) - 100))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x04]))


def _last_group_valid_crc(path: str, payload: bytes) -> None:
    """A last commit group whose frames and CRCs are right but whose START payload is not one
    (what a buggy or hostile tool writes): framed by the writer itself, which checks nothing."""
    from kvj.journal.records import RecordType
    with Journal.open(path) as j:
        j.writer.append(RecordType.START, payload, durable=True)


def _bad_id(path: str) -> None:
    from kvj.journal.records import encode_payload
    _last_group_valid_crc(path, encode_payload({"id": "../../etc/passwd", "prompt_hash": None, "tokens": None,
                                                "meta": {}}))


def _deep_nesting(path: str) -> None:
    from kvj.journal.records import encode_payload
    head = encode_payload({"id": "deep", "prompt_hash": None, "tokens": None, "meta": {"a": 0}})
    assert head.endswith(b"\x00")
    _last_group_valid_crc(path, head[:-1] + b"\x91" * 5000 + b"\xc0")


def _newest_snapshot(path: str) -> None:
    from kvj.ops.compact import compact
    compact(path)
    snap = list_snapshots(path)[0][1]
    with open(snap, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("damage", [_flip_in_first_log, _bad_id, _deep_nesting, _newest_snapshot],
                         ids=["bit-in-first-of-five-logs", "valid-crc-id-traversal", "valid-crc-deep-nesting",
                              "newest-snapshot"])
def test_the_writer_refuses_what_recovery_refuses_and_acknowledges_nothing(tmp_path, damage):
    """A journal that recovery refuses is refused by the writer too, before anything is appended:
    a writer that opened it would acknowledge records that ``kvj recover`` then throws away."""
    import subprocess
    from support.cli_helpers import KVJ
    path = str(tmp_path / "j")
    _five_log_files(path)
    damage(path)
    sizes = {p: os.path.getsize(p) for p in list_logs(path)}
    with pytest.raises(KvjError):
        Journal.open(path)
    assert {p: os.path.getsize(p) for p in list_logs(path)} == sizes, "the refused open changed the log"
    recover = subprocess.run([*KVJ, "recover", "--dry-run", "-j", path], capture_output=True, text=True, timeout=300)
    assert recover.returncode == 65, recover.stdout + recover.stderr
    writer_agrees(path, damage.__name__)
