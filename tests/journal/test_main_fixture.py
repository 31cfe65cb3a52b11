"""A journal written by kvj's main before the 0.2.0 redesign (tests/journal/data/journal-main,
made by make_journal_main.py: every record type, a snapshot, loose and packed segments, the use
log) reads identically today: the same replayed state, every segment the same tensor, fsck clean,
and a writer continues it."""

import hashlib
import json
import os
import shutil

import torch

from kvj import Journal, replay
from kvj.ops.fsck import fsck
from kvj.segments.store import SegmentStore

DATA = os.path.join(os.path.dirname(__file__), "data")
EXPECTED = json.load(open(os.path.join(DATA, "journal-main.expected.json")))


def copy(tmp_path) -> str:
    path = str(tmp_path / "j")
    shutil.copytree(os.path.join(DATA, "journal-main"), path)
    return path


def test_it_replays_to_the_same_state(tmp_path):
    d = replay(copy(tmp_path)).to_dict()
    for e in d["epochs"]:
        e["time"] = "T"
    assert json.loads(json.dumps(d)) == EXPECTED["state"]


def test_every_segment_reads_back_the_same_tensor_and_fsck_is_clean(tmp_path):
    path = copy(tmp_path)
    with SegmentStore(os.path.join(path, "segments")) as store:
        assert sorted(store.keys()) == sorted(EXPECTED["tensors"])
        for key, digest in EXPECTED["tensors"].items():
            assert store.verify(key).key == key
            assert hashlib.sha256(store.get(key).view(torch.uint8).numpy().tobytes()).hexdigest() == digest
    assert fsck(path).exit_code == 0


def test_a_writer_continues_it(tmp_path):
    path = copy(tmp_path)
    last = replay(path).last_lsn
    with Journal.open(path) as j:
        assert j.start("after", durable=True) == last + 1
        j.flush("chat-1", 2, torch.zeros(4), token_range=(32, 48)).result()
    state = replay(path)
    assert "after" in state.requests and sorted(state.requests["chat-1"].segments) == [0, 1, 2]
