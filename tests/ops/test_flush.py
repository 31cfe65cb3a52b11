"""kvj.ops.flush at the library level: the plan of which tensor becomes which segment of a
request (its defaults, the one resume position, the refusals), and flushes that store
nothing when refused (issue 23 item 5)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvj
from kvj.errors import InvalidArgument
from kvj.journal.state import RequestState, SegmentRef
from kvj.ops.flush import flush_request, flush_training, ordered, plan_segments


def blk(i: int, tokens: int = 16) -> torch.Tensor:
    return torch.full((2, tokens, 4), float(i))


def request(*ranges) -> RequestState:
    """A request in flight with one segment per (start, end) range, numbered from 0."""
    req = RequestState("r", None, None, {}, 1)
    for seg, rng in enumerate(ranges):
        if rng is not None:
            req.segments[seg] = SegmentRef(seg, "0" * 64, rng, {}, 0, 0, None, "raw", seg + 2)
    return req


def test_blocks_follow_the_last_segment_from_the_resume_position():
    plan = plan_segments(request((0, 16), (16, 32)), [("a", blk(0)), ("b", blk(1)), ("c", blk(2))], block_tokens=16)
    assert [(p.name, p.segment, p.tokens) for p in plan] == [("a", 2, (32, 48)), ("b", 3, (48, 64)),
                                                            ("c", 4, (64, 80))]


def test_replaced_segments_do_not_count_towards_the_resume_position():
    """Segments 1 and 2 are replaced: the blocks start where segment 0 ends, not after segment 2."""
    plan = plan_segments(request((0, 16), (16, 32), (32, 48)), [("a", blk(0)), ("b", blk(1))], block_tokens=16,
                         segment=1)
    assert [(p.segment, p.tokens) for p in plan] == [(1, (16, 32)), (2, (32, 48))]


@pytest.mark.parametrize("case,kwargs,needle", [
    ("overlap", {"token_range": (8, 24), "segment": 5}, "overlap segment 0 (tokens 0..16)"),
    ("gap", {"block_tokens": 16, "start": 32}, "tokens 16..32 of request r would not be covered"),
    ("no token dimension", {"block_tokens": 8}, "no dimension of 8 tokens"),
    ("token dim", {"block_tokens": 16, "token_dim": 0}, "its dimension 0 is not 16 tokens"),
    ("range for two", {"token_range": (16, 32)}, "--tokens covers one tensor, but the files hold 2"),
    ("neither", {}, "give a token range (one tensor) or a block size"),
    ("zero block", {"block_tokens": 0}, "at least one token"),
])
def test_a_plan_that_does_not_fit_is_refused(case, kwargs, needle):
    tensors = [("a", blk(0))] if case == "overlap" else [("a", blk(0)), ("b", blk(1))]
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        plan_segments(request((0, 16)), tensors, **kwargs)


def test_blocks_of_different_dtypes_shapes_or_none_are_refused():
    for tensors in ([("a", blk(0)), ("b", blk(1).to(torch.float16))], [("a", blk(0)), ("b", torch.zeros(2, 16, 8))]):
        with pytest.raises(InvalidArgument, match="share dtype and shape"):
            plan_segments(request(), tensors, block_tokens=16)
    with pytest.raises(InvalidArgument, match="empty tensor"):
        plan_segments(request(), [("a", torch.zeros(2, 0, 4))], token_range=(0, 0))
    with pytest.raises(InvalidArgument, match="no tensor"):
        plan_segments(request(), [], block_tokens=16)


def test_order_names_each_tensor_once():
    tensors = [("a", blk(0)), ("b", blk(1))]
    assert [n for n, _t in ordered(tensors, ["b", " a"])] == ["b", "a"]
    assert ordered(tensors, None) == tensors
    for bad in (["a"], ["a", "b", "b"], ["a", "c"]):
        with pytest.raises(InvalidArgument, match="exactly once"):
            ordered(tensors, bad)


@settings(max_examples=200, deadline=None)
@given(ends=st.lists(st.integers(1, 4), max_size=5), holes=st.sets(st.integers(0, 4)), blocks=st.integers(1, 4),
       first=st.integers(0, 6))
def test_a_plan_starts_at_the_kept_resume_position_and_never_overlaps(ends, holes, blocks, first):
    """Whatever segments a request has (runs with holes), blocks with the default start begin
    where the segments kept cover tokens from 0 without a gap; the plan is refused exactly when
    a block would overlap a kept segment, and an accepted one covers each token once and
    leaves the request resuming after its last block."""
    ranges, pos = [], 0
    for i, n in enumerate(ends):
        ranges.append(None if i in holes else (pos, pos + 4 * n))
        pos += 4 * n
    req = request(*ranges)
    replaced = set(range(first, first + blocks))
    after = RequestState(req.id, None, None, {}, 1, segments={s: r for s, r in req.segments.items()
                                                              if s not in replaced})
    start = after.resume_position
    expected = [(start + 4 * i, start + 4 * i + 4) for i in range(blocks)]
    clash = any(lo < b and a < hi for lo, hi in expected for a, b in (r.tokens for r in after.segments.values()))
    tensors = [(f"blk{i}", blk(i, 4)) for i in range(blocks)]
    if clash:
        with pytest.raises(InvalidArgument, match="overlap segment"):
            plan_segments(req, tensors, block_tokens=4, segment=first)
        return
    plan = plan_segments(req, tensors, block_tokens=4, segment=first)
    assert [(p.segment, p.tokens) for p in plan] == list(zip(range(first, first + blocks), expected))
    for p in plan:
        after.segments[p.segment] = SegmentRef(p.segment, None, p.tokens, {}, 0, 0, None, "raw", 99)
    covered = sorted(r.tokens for r in after.segments.values() if r.tokens)
    assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), covered  # no token twice
    assert after.resume_position >= expected[-1][1]


@pytest.fixture
def journal(tmp_path):
    with kvj.Journal.open(tmp_path / "j") as j:
        j.start("r")
    return tmp_path / "j"


def _stored(journal) -> set:
    return {p.name for p in (journal / "segments").rglob("*.kvjseg")}


def test_flush_request_stores_journals_and_is_durable(journal):
    with kvj.Journal.open(journal) as j:
        flushed = flush_request(j, "r", [("a", blk(0)), ("b", blk(1))], block_tokens=16, layout={"model": "m"})
    assert [(f.name, f.segment, f.tokens) for f in flushed] == [("a", 0, (0, 16)), ("b", 1, (16, 32))]
    req = kvj.replay(str(journal)).requests["r"]
    assert req.resume_position == 32 and [req.segments[s].key for s in (0, 1)] == [f.info.key for f in flushed]
    assert flushed[1].to_dict()["tokens"] == [16, 32] and flushed[1].to_dict()["lsn"] == req.segments[1].lsn


def test_a_refused_flush_stores_nothing(journal):
    with kvj.Journal.open(journal) as j:
        flush_request(j, "r", [("a", blk(0))], block_tokens=16, layout={"model": "m"})
    before, last = _stored(journal), kvj.replay(str(journal)).last_lsn
    with kvj.Journal.open(journal) as j:
        with pytest.raises(InvalidArgument, match="layout cannot change"):
            flush_request(j, "r", [("b", blk(1))], block_tokens=16, layout={"model": "other"})
        with pytest.raises(InvalidArgument, match="share dtype and shape"):
            flush_request(j, "r", [("b", blk(1).to(torch.bfloat16))], block_tokens=16, layout={"model": "m"})
        with pytest.raises(InvalidArgument, match="not in flight"):
            flush_request(j, "nobody", [("b", blk(1))], block_tokens=16)
    assert _stored(journal) == before and kvj.replay(str(journal)).last_lsn == last


def test_flush_training_refuses_no_tensor_and_keeps_the_checkpoint(journal):
    """Regression: a file holding no tensor journaled an empty checkpoint, which replaced the
    training state the journal held (and cleared its deltas)."""
    with kvj.Journal.open(journal) as j:
        flush_training(j, [("w", blk(0))], 3)
        flush_training(j, [("w", blk(1))], 4, base_step=3)
        with pytest.raises(InvalidArgument, match="no tensor"):
            flush_training(j, [], 5)
        with pytest.raises(InvalidArgument, match="repeat a tensor name"):
            flush_training(j, [("w", blk(0)), ("w", blk(1))], 5)
    state = kvj.replay(str(journal))
    assert state.checkpoint["step"] == 3 and [d["step"] for d in state.deltas] == [4]
