"""A request's records reach the log in the order the caller made the calls (issue 9 item 1),
input errors never poison the journal (item 7), and ``close`` closes what it opened (item 18)."""

import os
import re
import threading
from concurrent.futures import Future

import pytest
import torch
from support.wait import wait_for

import kvj
from kvj.fileio import FS
from kvj.journal.journal import Journal
from kvj.journal.reader import Scan
from kvj.journal.records import RecordType
from kvj.ops.fsck import fsck

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


class HeldSegments(FS):
    """Publishing a segment (its rename into the store) waits while ``gate`` is clear."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = 0

    def rename(self, src, dst):
        if f"{os.sep}segments{os.sep}" in os.fspath(dst):
            self.waiting += 1
            assert self.gate.wait(60), "segment held for too long"
        super().rename(src, dst)


def kinds(path):
    return [(rec.rtype, rec.payload.get("id")) for rec in Scan(path).records()]


def test_the_readme_journal_in_one_screen_runs_verbatim_without_a_warning(tmp_path, capsys):
    text = open(README).read()
    code = re.search(r"## The journal in one screen\n\n```python\n(.*?)```", text, re.S).group(1)
    path = str(tmp_path / "journal")
    blocks = [(torch.randn(2, 16, 2, 8), 16 * i, 16 * (i + 1)) for i in range(6)]
    exec(compile(code.replace('"/var/lib/kvj/journal"', repr(path)), "README", "exec"),
         {"prompt_ids": list(range(16)), "kv_blocks": blocks})
    state = kvj.replay(path)
    assert state.warnings == [] and state.requests["req-42"].ended
    order = kinds(path)
    assert order == [(RecordType.START, "req-42")] + [(RecordType.SEGMENT, "req-42")] * 6 + [(RecordType.END, "req-42")]
    result = fsck(path)
    assert result.exit_code == 0 and not [f for f in result.findings if f.severity == "warning"]


def test_a_later_incarnation_never_inherits_an_earlier_ones_segments(tmp_path):
    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        j.start("chat-42", tokens=[1, 2, 3])
        j.flush("chat-42", 0, torch.randn(2, 16, 2, 8), token_range=(0, 16))
        j.end("chat-42")
        j.start("chat-42", tokens=[9, 9, 9])
        j.sync()
    state = kvj.replay(path)
    req = state.requests["chat-42"]
    assert req.tokens == [9, 9, 9] and req.segments == {} and req.resume_position == 0
    assert state.warnings == []
    assert kinds(path) == [(RecordType.START, "chat-42"), (RecordType.SEGMENT, "chat-42"),
                           (RecordType.END, "chat-42"), (RecordType.START, "chat-42")]


def test_end_waits_for_the_requests_flushes_in_the_log_but_not_on_the_callers_thread(tmp_path):
    path = str(tmp_path / "j")
    fs = HeldSegments()
    with Journal.open(path, fs=fs) as j:
        j.start("r1")
        j.start("r2")
        fs.gate.clear()
        flushed = j.flush("r1", 0, torch.ones(64), token_range=(0, 16))
        wait_for(lambda: fs.waiting == 1, "the segment to reach its rename")
        ended = j.end("r1")  # returns at once, with the flush still held
        assert isinstance(ended, Future) and not ended.done() and not flushed.done()
        other = j.end("r2")  # another request is not held back
        assert other == 3
        fs.gate.set()
        j.sync()
        assert flushed.result() < ended.result()
    assert kinds(path) == [(RecordType.START, "r1"), (RecordType.START, "r2"), (RecordType.END, "r2"),
                           (RecordType.SEGMENT, "r1"), (RecordType.END, "r1")]
    assert kvj.replay(path).warnings == []


def test_a_refused_input_does_not_poison_the_journal(tmp_path):
    """A layout the store refuses (a NaN) raises in the caller's thread; later flushes, sync and
    close work. Before, the error came from the flush worker and every later call re-raised it."""
    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        j.start("r1")
        with pytest.raises(kvj.FormatError):
            j.flush("r1", 0, torch.ones(8), token_range=(0, 16), layout={"scale": float("nan")})
        assert j.flush("r1", 0, torch.ones(8), token_range=(0, 16), layout={"scale": 1.0}).result() == 2
        j.end("r1")
        j.sync()
    assert kvj.replay(path).requests["r1"].ended


def test_close_closes_the_store_and_pool_it_opened_and_only_those(tmp_path):
    from kvj.segments.store import SegmentStore

    with Journal.open(str(tmp_path / "a")) as j:
        j.start("r1")
        j.flush("r1", 0, torch.ones(8), token_range=(0, 16))
        store = j.store
    with pytest.raises(RuntimeError):
        store.pool.submit(print)  # shut down
    mine = SegmentStore(str(tmp_path / "store"))
    with Journal.open(str(tmp_path / "b"), store=mine) as j:
        j.start("r1")
        j.flush("r1", 0, torch.ones(8), token_range=(0, 16))
    assert mine.pool.submit(int).result() == 0  # the caller's store stays open
    mine.close()
