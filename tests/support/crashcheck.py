"""Ground truth and checkers shared by the crash, kill, corruption and I/O-error tests.

A test drives a workload and records, for every LSN it appended, the record type and
payload (``Truth``) and which LSNs were acknowledged durable (``sync()`` returned, or an
``append(..., durable=True)`` returned). After a crash, ``check_journal`` verifies the
journal's contract against that truth:

* replay succeeds (non-strict) and the records it yields are exactly ``truth[1..n]``
  for some ``n`` (nothing never written, nothing reordered, nothing changed);
* ``n`` is at least the highest acknowledged LSN (nothing acknowledged lost);
* the folded state equals the fold of the same records (snapshot included);
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

    def fold(self, upto: int) -> JournalState:
        """The state replay must produce from records 1..upto."""
        state = JournalState()
        for lsn in range(1, upto + 1):
            rtype, payload = self.records[lsn]
            state.apply(rtype, payload, lsn)
        return state


# -- random records -------------------------------------------------------------------------

REQUEST_IDS = [f"req-{i}" for i in range(6)]


def random_record(rng: random.Random, big: float = 0.1, fake_keys: bool = False) -> Tuple[int, Dict[str, Any]]:
    """A valid record of a random type; with probability ``big`` a payload of a few KiB,
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
        return RecordType.ALLOC, {"device": "cuda:0", "addr": rng.randrange(1 << 40), "size": rng.randrange(1 << 20),
                                  "tag": filler}
    if kind == 4:
        return RecordType.FREE, {"device": "cuda:0", "addr": rng.randrange(1 << 40)}
    if kind == 5:
        return RecordType.CHECKPOINT, {"step": rng.randrange(1000), "keys": {"w": key()} if key else {},
                                       "meta": {"pad": filler}}
    return RecordType.DELTA, {"step": rng.randrange(1000), "base_step": rng.randrange(1000),
                              "keys": {"m": key()} if key else {}, "meta": {}}


# -- the checker ----------------------------------------------------------------------------

MARKER = {"device": "check", "addr": 1, "size": 1, "tag": "reopened"}


def comparable(state: JournalState) -> Dict[str, Any]:
    """The parts of a folded state that must not depend on snapshots or torn tails."""
    d = state.to_dict(include_ended=False)
    for k in ("tail", "counts", "warnings", "snapshot_lsn", "ended_compacted", "first_lsn"):
        d.pop(k, None)
    d["requests"] = sorted(d["requests"], key=lambda r: r["id"])  # a snapshot keeps its own order
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
    assert comparable(state) == comparable(truth.fold(last)), f"replayed state differs from the model{where}"
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

    from kvj.segments.restore import load
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
