"""Ground truth and checkers shared by the crash, kill, corruption and I/O-error tests.

A test drives a workload and records, for every LSN it appended, the record type and
payload (``Truth``) and which LSNs were acknowledged durable (``sync()`` returned, or an
``append(..., durable=True)`` returned). After a crash, ``check_journal`` verifies the
journal's contract against that truth:

* replay succeeds (non-strict) and the records it yields are exactly ``truth[1..n]``
  for some ``n`` (nothing never written, nothing reordered, nothing changed);
* ``n`` is at least the highest acknowledged LSN (nothing acknowledged lost);
* the folded state equals what the same records mean (snapshot included), by ``Model``:
  the checker's own small reading of kvj-journal(5), not ``JournalState.apply`` (the code
  under test), so that a wrong fold is caught, not only a snapshot that disagrees with it;
* a writer can re-open the journal and continue, and its record lands right after.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import msgpack

from kvj import Journal, RecordType, replay
from kvj.errors import KvjError
from kvj.fileio import FS
from kvj.journal.replay import RecordStream
from kvj.journal.state import JournalState

#: Figures the suite reports at the end of a run (see conftest.py): name -> number.
FIGURES: Dict[str, float] = {}


def add_figure(name: str, value: float) -> None:
    """Add ``value`` to the figure ``name`` (printed in pytest's terminal summary)."""
    FIGURES[name] = FIGURES.get(name, 0) + value


def normalize(payload: Dict[str, Any]) -> Dict[str, Any]:
    """The payload as it comes back from disk (msgpack turns tuples into lists, etc.)."""
    return msgpack.unpackb(msgpack.packb(payload, use_bin_type=True), raw=False)


@dataclass
class Truth:
    """What a workload appended (LSN -> type and payload) and what it saw acknowledged."""

    records: Dict[int, Tuple[int, Dict[str, Any]]] = field(default_factory=dict)
    acked: int = 0
    tensors: Dict[str, Any] = field(default_factory=dict)  # segment key -> the tensor flushed under it

    def add(self, lsn: int, rtype: int, payload: Dict[str, Any]) -> None:
        self.records[lsn] = (int(rtype), normalize(payload))

    def resume(self, next_lsn: int) -> None:
        """A new writer starts at ``next_lsn``: anything appended at or after it by an
        earlier (killed) writer never reached the disk and is forgotten."""
        assert next_lsn > self.acked, f"writer resumed at LSN {next_lsn}, but {self.acked} was acknowledged"
        for lsn in [n for n in self.records if n >= next_lsn]:
            del self.records[lsn]

    def ack(self, lsn: int) -> None:
        self.acked = max(self.acked, lsn)

    def fold(self, upto: int) -> Dict[str, Any]:
        """What records 1..upto mean, by the checker's own ``Model``, in ``comparable``'s form:
        what replay's state must be equal to."""
        model = Model()
        for lsn in range(1, upto + 1):
            rtype, payload = self.records[lsn]
            model.apply(lsn, rtype, payload)
        return model.comparable()


class Model:
    """What each record does, read from kvj-journal(5) (RECORDS, REPLAY) and written here a
    second time, in plain dicts, independently of ``kvj.journal.state``:

    * start: request ``id`` is in flight, with no segments (a start replaces an earlier one);
    * segment: if ``id`` is in flight, segment number ``seg`` now covers ``tokens`` (a later
      record for the same number replaces it); else nothing;
    * end: ``id`` is no longer in flight;
    * alloc / free: the device memory map gains / loses (``device``, ``addr``);
    * checkpoint: the checkpoint, and no deltas after it; delta: one more delta after it;
    * epoch: one more recovery epoch;
    * a request's resume position: the tokens covered from 0 by its segments without a gap.
    """

    def __init__(self) -> None:
        self.last_lsn = 0
        self.in_flight: Dict[str, Dict[str, Any]] = {}
        self.memory: Dict[Tuple[str, int], Dict[str, Any]] = {}
        self.checkpoint: Optional[Dict[str, Any]] = None
        self.deltas: List[Dict[str, Any]] = []
        self.epochs: List[Dict[str, Any]] = []

    def apply(self, lsn: int, rtype: int, p: Dict[str, Any]) -> None:
        self.last_lsn = lsn
        if rtype == RecordType.START:
            self.in_flight[p["id"]] = {"id": p["id"], "prompt_hash": p["prompt_hash"], "tokens": p["tokens"],
                                       "meta": p["meta"], "start_lsn": lsn, "segments": {}}
        elif rtype == RecordType.SEGMENT and p["id"] in self.in_flight:
            self.in_flight[p["id"]]["segments"][p["seg"]] = {
                "seg": p["seg"], "key": p["key"], "tokens": list(p["tokens"]), "layout": p["layout"],
                "raw_size": p["raw_size"], "stored_size": p["stored_size"], "digest": p["digest"],
                "codec": p["codec"], "lsn": lsn, "ptr": None}
        elif rtype == RecordType.END:
            self.in_flight.pop(p["id"], None)
        elif rtype == RecordType.ALLOC:
            self.memory[(p["device"], p["addr"])] = {"addr": p["addr"], "size": p["size"], "tag": p["tag"], "lsn": lsn}
        elif rtype == RecordType.FREE:
            self.memory.pop((p["device"], p["addr"]), None)
        elif rtype == RecordType.CHECKPOINT:
            self.checkpoint = {"step": p["step"], "keys": p["keys"], "meta": p["meta"], "lsn": lsn}
            self.deltas = []
        elif rtype == RecordType.DELTA:
            self.deltas.append({"step": p["step"], "base_step": p["base_step"], "keys": p["keys"], "meta": p["meta"],
                                "lsn": lsn})
        elif rtype == RecordType.EPOCH:
            self.epochs.append({"epoch": p["epoch"], "recovered_lsn": p["recovered_lsn"], "time": p["time"],
                                "manifest": p["manifest"], "lsn": lsn,
                                **({"salvage": p["salvage"]} if p.get("salvage") is not None else {})})

    @staticmethod
    def covered(segments: List[Dict[str, Any]]) -> int:
        """Tokens 0..n covered by the union of the segments' ranges, from 0 without a gap."""
        tokens = set()
        for seg in segments:
            tokens.update(range(seg["tokens"][0], seg["tokens"][1]))
        n = 0
        while n in tokens:
            n += 1
        return n

    def comparable(self) -> Dict[str, Any]:
        requests = []
        for rid in sorted(self.in_flight):
            req = self.in_flight[rid]
            segments = [req["segments"][n] for n in sorted(req["segments"])]
            requests.append({**{k: v for k, v in req.items() if k != "segments"}, "ended": False, "status": None,
                             "end_lsn": None, "resume_position": self.covered(segments), "segments": segments})
        memory: Dict[str, List[Dict[str, Any]]] = {}
        for (device, _addr), alloc in sorted(self.memory.items()):
            memory.setdefault(device, []).append(alloc)
        return {"last_lsn": self.last_lsn, "requests": requests, "allocations": memory,
                "checkpoint": self.checkpoint, "deltas": self.deltas, "epochs": self.epochs}


# -- random records -------------------------------------------------------------------------

REQUEST_IDS = [f"req-{i}" for i in range(6)]


def random_record(rng: random.Random, big: float = 0.1, fake_keys: bool = False) -> Tuple[int, Dict[str, Any]]:
    """A valid record of a random type (allocations and frees among 32 addresses, so that frees
    hit live allocations and allocations replace them); with probability ``big`` a payload of a few KiB,
    so that groups straddle 512- and 4096-byte sector boundaries. Records that point at
    segments (segment, checkpoint, delta) name none unless ``fake_keys``: fsck and
    restore rightly complain about segments that do not exist (real ones come from
    flushes)."""
    kind = rng.randrange(7)
    rid = rng.choice(REQUEST_IDS)
    filler = "x" * (rng.randrange(1000, 6000) if rng.random() < big else rng.randrange(0, 40))
    key = (lambda: f"{rng.getrandbits(256):064x}") if fake_keys else None
    if kind == 1 and not fake_keys:
        kind = 0
    if kind == 0:
        return RecordType.START, {"id": rid, "prompt_hash": f"{rng.getrandbits(64):016x}",
                                  "tokens": [rng.randrange(50000) for _ in range(rng.randrange(0, 20))],
                                  "meta": {"pad": filler}}
    if kind == 1:
        a = rng.randrange(0, 4096)
        return RecordType.SEGMENT, {"id": rid, "seg": rng.randrange(64), "key": key(), "tokens": [a, a + 16],
                                    "layout": {"pad": filler}, "raw_size": 4096, "stored_size": 2048,
                                    "digest": f"{rng.getrandbits(256):064x}", "codec": "zstd"}
    if kind == 2:
        return RecordType.END, {"id": rid, "status": rng.choice(["ok", "aborted"])}
    if kind == 3:
        return RecordType.ALLOC, {"device": "cuda:0", "addr": rng.randrange(32) << 12, "size": rng.randrange(1 << 20),
                                  "tag": filler}
    if kind == 4:
        return RecordType.FREE, {"device": "cuda:0", "addr": rng.randrange(32) << 12}  # often a live one
    if kind == 5:
        return RecordType.CHECKPOINT, {"step": rng.randrange(1000), "keys": {"w": key()} if key else {},
                                       "meta": {"pad": filler}}
    return RecordType.DELTA, {"step": rng.randrange(1000), "base_step": rng.randrange(1000),
                              "keys": {"m": key()} if key else {}, "meta": {}}


# -- the checker ----------------------------------------------------------------------------

MARKER = {"device": "check", "addr": 1, "size": 1, "tag": "reopened"}


def comparable(state: JournalState) -> Dict[str, Any]:
    """The parts of a folded state that must not depend on snapshots or torn tails, in the
    form ``Model.comparable`` gives (a device with no live allocation is no entry)."""
    d = state.to_dict(include_ended=False)
    for k in ("tail", "counts", "warnings", "snapshot_lsn", "ended_compacted", "first_lsn"):
        d.pop(k, None)
    d["requests"] = sorted(d["requests"], key=lambda r: r["id"])  # a snapshot keeps its own order
    d["allocations"] = {dev: allocs for dev, allocs in d["allocations"].items() if allocs}
    return d


def read_records(path: str) -> Tuple[JournalState, List[Tuple[int, int, Dict[str, Any]]]]:
    """Replay ``path`` and list the records after its snapshot as (lsn, type, payload).

    Two passes (replay, then the records); if a concurrent compactor replaced the
    snapshot in between, both are read again, as ``replay`` itself does."""
    from kvj.journal.reader import list_logs
    from kvj.journal.snapshot import list_snapshots
    for attempt in range(6):
        before = (list_snapshots(path), list_logs(path))
        state = replay(path)
        try:
            stream = RecordStream(path, after_lsn=state.snapshot_lsn)
            records = [(r.lsn, r.rtype, r.payload) for r in stream]
        except (KvjError, FileNotFoundError):
            if attempt == 5 or (list_snapshots(path), list_logs(path)) == before:
                raise
            continue
        if list_snapshots(path) == before[0]:  # else a compaction may have hidden records: again
            return state, records
    raise AssertionError(f"{path}: the journal kept changing under six reads")


def check_journal(path: str, truth: Truth, acked: int, *, reopen_fs: Optional[FS] = None,
                  context: str = "", check_fsck: bool = True) -> int:
    """Check one crashed journal against the truth; returns how many LSNs it holds.

    ``acked`` is the highest LSN acknowledged durable before the crash. Every segment
    the recovered state references must restore to exactly the tensor flushed under its
    key. With ``check_fsck``, fsck must find nothing or only what it can repair (a torn
    tail or header), and its repair must keep every recovered record. With
    ``reopen_fs``, also re-open the journal for writing and check that a new record
    lands right after the recovered ones and that nothing recovered changed.
    """
    where = f" [{context}]" if context else ""
    state, records = read_records(path)
    base = state.snapshot_lsn
    for i, (lsn, rtype, payload) in enumerate(records):
        assert lsn == base + 1 + i, f"LSN {lsn} out of sequence after {base + i}{where}"
        assert lsn in truth.records, f"LSN {lsn} replayed but never appended{where}"
        assert truth.records[lsn] == (rtype, payload), f"LSN {lsn} differs from what was appended{where}"
    last = records[-1][0] if records else base
    assert state.last_lsn == last or (not records and state.last_lsn == base), \
        f"replay's last LSN {state.last_lsn} disagrees with the records ({last}){where}"
    assert last >= acked, f"acknowledged LSN {acked} lost: journal ends at {last}{where}"
    assert comparable(state) == truth.fold(last), f"replayed state differs from the model{where}"
    check_segments(path, state, truth, where)
    if check_fsck:
        fsck_clean_or_repairable(path, records, reopen_fs or FS(), where)
    if reopen_fs is not None:
        with Journal.open(path, fs=reopen_fs) as j:
            lsn = j.append(RecordType.ALLOC, MARKER, durable=True)
        assert lsn == last + 1, f"re-opened writer appended LSN {lsn}, expected {last + 1}{where}"
        state2, records2 = read_records(path)
        assert state2.snapshot_lsn == base, f"re-open changed the snapshot{where}"
        assert records2 == records + [(lsn, int(RecordType.ALLOC), MARKER)], \
            f"re-open changed recovered records{where}"
    return last


#: fsck findings a crash may legitimately leave: repair cuts them (bytes kept in torn/).
REPAIRABLE = {"torn-tail", "torn-header"}


def check_segments(path: str, state: JournalState, truth: Truth, where: str = "") -> int:
    """Every segment a live request needs is present and restores bit-exactly."""
    refs = [(req.id, ref) for req in state.in_flight() for ref in req.segments.values() if ref.key]
    if not refs:
        return 0
    import torch

    from kvj.segments.load import load
    from kvj.segments.store import SegmentStore
    with SegmentStore(os.path.join(path, "segments"), threads=1) as store:
        for rid, ref in refs:
            try:
                got = load(store, ref.key)
            except KvjError as exc:
                raise AssertionError(f"{rid} segment {ref.seg} ({ref.key[:12]}) cannot be restored: {exc}{where}")
            want = truth.tensors[ref.key]
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
                f"{rid} segment {ref.seg}: restored dtype/shape differ{where}"
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), \
                f"{rid} segment {ref.seg}: restored bytes differ from what was flushed{where}"
    return len(refs)


def fsck_clean_or_repairable(path: str, records: List[Tuple[int, int, Dict[str, Any]]], fs: FS,
                             where: str = "") -> None:
    """fsck finds nothing but repairable damage; repair fixes it and keeps every record."""
    from kvj.ops.fsck import fsck
    found = fsck(path)
    bad = [f"{f.kind}: {f.message}" for f in found.errors if f.kind not in REPAIRABLE]
    assert not bad, f"fsck reports damage a crash must not leave: {bad}{where}"
    if found.errors:
        repaired = fsck(path, repair=True, fs=fs)
        assert repaired.exit_code in (0, 1), f"fsck --repair left errors: {repaired.to_dict()}{where}"
        assert fsck(path).exit_code == 0, f"fsck after --repair is not clean{where}"
        _state, after = read_records(path)
        assert after == records, f"fsck --repair changed the recovered records{where}"


def tree_modes(path: str) -> List[Tuple[str, int]]:
    """(relative path, permission bits) of everything under ``path``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            out.append((os.path.relpath(full, path), os.stat(full).st_mode & 0o777))
    return out
