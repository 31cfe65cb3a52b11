"""Journal.flush refuses at the call, storing and appending nothing, a flush the log could never
make sense of: a negative segment number, a token range that overlaps another segment of the
request, a request that is not in flight (never started, or ended), in this writer's session
and for requests a later writer resumes."""

from __future__ import annotations

import os

import pytest
import torch

import kvj
from kvj.journal.journal import Journal
from kvj.journal.records import RecordType

BLOCK = torch.ones(2, 16, 2, 8)


def _store_files(path) -> int:
    return sum(len(files) for _d, _s, files in os.walk(os.path.join(path, "segments", "objects")))


def test_flush_refuses_a_negative_segment_an_overlap_and_a_request_never_started(tmp_path):
    with Journal.open(tmp_path) as j:
        j.start("r1")
        assert j.flush("r1", 0, BLOCK, token_range=(0, 16)).result() == 2
        with pytest.raises(kvj.InvalidArgument, match="overlaps its segment 0"):
            j.flush("r1", 1, BLOCK * 2, token_range=(0, 16))  # the same tokens again, another segment
        with pytest.raises(kvj.InvalidArgument, match="overlaps its segment 0"):
            j.flush("r1", 1, BLOCK * 2, token_range=(8, 24))
        with pytest.raises(kvj.FormatError, match="negative segment number -1"):
            j.flush("r1", -1, BLOCK * 3, token_range=(16, 32))
        with pytest.raises(kvj.InvalidArgument, match="ghost is not in flight"):
            j.flush("ghost", 0, BLOCK * 4, token_range=(0, 16))
        j.sync()
        assert _store_files(tmp_path) == 1  # nothing refused was stored
        assert j.flush("r1", 0, BLOCK, token_range=(0, 16)).result() == 3  # the same segment again replaces it
        assert j.flush("r1", 1, BLOCK * 2, token_range=(16, 32)).result() == 4
        j.end("r1")
        with pytest.raises(kvj.InvalidArgument, match="r1 is not in flight"):
            j.flush("r1", 2, BLOCK, token_range=(32, 48))
    req = kvj.replay(str(tmp_path)).requests["r1"]
    assert sorted((seg, ref.tokens) for seg, ref in req.segments.items()) == [(0, (0, 16)), (1, (16, 32))]
    assert req.resume_position == 32 and kvj.replay(str(tmp_path)).last_lsn == 5


def test_a_writer_knows_the_requests_in_flight_before_it_opened_the_journal(tmp_path):
    with Journal.open(tmp_path) as j:
        j.start("resumed")
        j.flush("resumed", 0, BLOCK, token_range=(0, 16)).result()
        j.start("done")
        j.end("done")
        j.append(RecordType.START, {"id": "plain", "prompt_hash": None, "tokens": None, "meta": {}})
    with Journal.open(tmp_path) as j:  # a server resuming after recovery: no start of its own
        with pytest.raises(kvj.InvalidArgument, match="overlaps its segment 0"):
            j.flush("resumed", 1, BLOCK, token_range=(0, 16))
        assert j.flush("resumed", 1, BLOCK, token_range=(16, 32)).result() == 6
        with pytest.raises(kvj.InvalidArgument, match="done is not in flight"):
            j.flush("done", 0, BLOCK, token_range=(0, 16))
        assert j.flush("plain", 0, BLOCK, token_range=(0, 16)).result() == 7  # started through append
        j.start("done")  # a new incarnation of an ended id is in flight again
        assert j.flush("done", 0, BLOCK, token_range=(0, 16)).result() == 9
    state = kvj.replay(str(tmp_path))
    assert state.requests["resumed"].resume_position == 32 and state.last_lsn == 9


def test_a_request_in_flight_before_open_is_known_from_the_replay_at_open(tmp_path):
    with Journal.open(tmp_path) as j:
        for i in range(3):  # the writer's own append, as a test of durability does it: the Journal never saw them
            j.writer.append(RecordType.START, {"id": f"raw-{i}", "prompt_hash": None, "tokens": None, "meta": {}})
        j.end("raw-2")
    with Journal.open(tmp_path) as j:
        for i in range(2):
            assert j.flush(f"raw-{i}", 0, BLOCK * i, token_range=(0, 16)).result() > 0
        for rid in ("raw-2", "raw-9"):  # ended, never started
            with pytest.raises(kvj.InvalidArgument, match=f"{rid} is not in flight"):
                j.flush(rid, 0, BLOCK, token_range=(0, 16))
