"""Property: any sequence of journal operations, replayed, equals a simple in-memory model."""

import shutil
import tempfile
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvj
from kvj.journal.journal import Journal
from kvj.journal.config import CommitPolicy

IDS = st.sampled_from(["a", "b", "req-7", "x:y@z"])
KEY = st.integers(0, 5).map(lambda i: f"{i:064x}")


@dataclass(frozen=True)
class Info:
    key: str
    layout: dict
    raw_size: int = 100
    stored_size: int = 60
    digest: str = "d" * 64
    codec: str = "zstd"


ops = st.lists(st.one_of(
    st.tuples(st.just("start"), IDS, st.lists(st.integers(0, 50000), max_size=5)),
    st.tuples(st.just("flush"), IDS, st.integers(0, 6), KEY),
    st.tuples(st.just("end"), IDS, st.sampled_from(["ok", "aborted"])),
    st.tuples(st.just("handoff"), IDS, st.sampled_from(["engine-b", "b2"])),
    st.tuples(st.just("alloc"), st.sampled_from(["cuda:0", "cuda:1"]), st.integers(0, 8), st.integers(1, 1 << 40)),
    st.tuples(st.just("free"), st.sampled_from(["cuda:0", "cuda:1"]), st.integers(0, 8)),
    st.tuples(st.just("checkpoint"), st.integers(0, 100), KEY),
    st.tuples(st.just("delta"), st.integers(0, 100), KEY),
    st.tuples(st.just("sync")),
    st.tuples(st.just("reopen")),
), max_size=60)


class Model:
    """The obvious semantics, written independently of kvj.state."""

    def __init__(self):
        self.requests, self.allocs, self.checkpoint, self.deltas = {}, {}, None, []

    def apply(self, op):
        kind = op[0]
        if kind == "start":
            self.requests[op[1]] = {"tokens": op[2], "segs": {}, "ended": None, "moved_to": None}
        elif kind == "flush" and op[1] in self.requests and self.requests[op[1]]["ended"] is None:
            self.requests[op[1]]["segs"][op[2]] = (op[3], (op[2] * 16, op[2] * 16 + 16))
        elif kind == "end" and op[1] in self.requests:
            self.requests[op[1]]["ended"] = op[2]
        elif kind == "handoff" and op[1] in self.requests and self.requests[op[1]]["ended"] is None:
            self.requests[op[1]].update(ended="handoff", moved_to=op[2])  # ends it here; else ignored
        elif kind == "alloc":
            self.allocs.setdefault(op[1], {})[op[2]] = op[3]
        elif kind == "free":
            self.allocs.get(op[1], {}).pop(op[2], None)
        elif kind == "checkpoint":
            self.checkpoint, self.deltas = (op[1], op[2]), []
        elif kind == "delta":
            self.deltas.append((op[1], op[2]))

    def resume(self, rid):
        pos = 0
        for start, end in sorted(r for _, r in self.requests[rid]["segs"].values()):
            if start > pos:
                break
            pos = max(pos, end)
        return pos


def run_ops(path, sequence):
    """Apply ``sequence`` through the Journal; a flush of a request not in flight (never started,
    or ended) is refused at the call and appends nothing (the model ignores it). Returns how
    many records were appended."""
    policy = CommitPolicy(file_size_limit=600, max_delay=0.001)
    j = Journal.open(path, policy=policy)
    live, refused = set(), 0
    try:
        for op in sequence:
            kind = op[0]
            if kind == "start":
                j.start(op[1], "h", op[2])
                live.add(op[1])
            elif kind == "flush":
                flush = lambda: j.flush(op[1], op[2], token_range=(op[2] * 16, op[2] * 16 + 16),  # noqa: E731
                                        info=Info(op[3], {"block": op[2]}))
                if op[1] in live:
                    flush().result()
                else:
                    with pytest.raises(kvj.InvalidArgument, match="not in flight"):
                        flush()
                    refused += 1
            elif kind == "end":
                j.end(op[1], op[2])
                live.discard(op[1])
            elif kind == "handoff":
                j.handoff(op[1], op[2])
                live.discard(op[1])
            elif kind == "alloc":
                j.alloc(op[1], op[2], op[3], "t")
            elif kind == "free":
                j.free(op[1], op[2])
            elif kind == "checkpoint":
                j.checkpoint(op[1], {"w": op[2]})
            elif kind == "delta":
                j.delta(op[1], 0, {"w": op[2]})
            elif kind == "sync":
                j.sync()
            elif kind == "reopen":
                j.close()
                j = Journal.open(path, policy=policy)
    finally:
        j.close()
    return sum(1 for op in sequence if op[0] not in ("sync", "reopen")) - refused


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_replay_equals_the_model(sequence):
    path = tempfile.mkdtemp(prefix="kvj-model-")
    try:
        n_records = run_ops(path, sequence)
        model = Model()
        for op in sequence:
            model.apply(op)
        state = kvj.replay(path, strict=True)
        assert set(state.requests) == set(model.requests)
        for rid, m in model.requests.items():
            req = state.requests[rid]
            assert req.tokens == m["tokens"]
            assert (req.status if req.ended else None) == m["ended"]
            assert req.moved_to == m["moved_to"]
            assert {s: (ref.key, ref.tokens) for s, ref in req.segments.items()} == m["segs"]
            assert req.resume_position == model.resume(rid)
        live = {dev: {a: al.size for a, al in allocs.items()} for dev, allocs in state.allocations.items()}
        assert {d: a for d, a in live.items() if a} == {d: a for d, a in model.allocs.items() if a}
        cp = (state.checkpoint["step"], state.checkpoint["keys"]["w"]) if state.checkpoint else None
        assert cp == model.checkpoint
        assert [(d["step"], d["keys"]["w"]) for d in state.deltas] == model.deltas
        assert state.last_lsn == n_records
    finally:
        shutil.rmtree(path)
