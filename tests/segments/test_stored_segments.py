"""Segments written by an earlier kvj (tests/segments/data/segments-0.2, made by
make_segments.py before the byte layer and the codec pipeline were split out) read unchanged,
and the same tensors are written again byte for byte."""

import hashlib
import importlib.util
import json
import os
import shutil

import pytest
import torch

from kvj.segments.store import SegmentStore

DATA = os.path.join(os.path.dirname(__file__), "data")
EXPECTED = json.load(open(os.path.join(DATA, "segments-0.2.json")))
_spec = importlib.util.spec_from_file_location("make_segments", os.path.join(DATA, "make_segments.py"))
make_segments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_segments)


def _stored(key):
    with open(os.path.join(DATA, "segments-0.2", key + ".kvjseg"), "rb") as f:
        return f.read()


def test_fixture_covers_every_codec_and_the_dedup_filter():
    assert {e["codec"] for e in EXPECTED.values()} == {"raw", "zstd", "byteplane"}
    assert set(EXPECTED) == set(make_segments.TENSORS)
    dedup = EXPECTED["shared-prefix-dedup"]
    assert dedup["stored_size"] * 8 < dedup["raw_size"]  # the row-dedup filter is in it


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_old_segment_decodes_to_the_same_bytes(tmp_path, name):
    entry = EXPECTED[name]
    key = entry["key"]
    with SegmentStore(tmp_path / "store") as store:
        path = store.backend.path(key)
        os.makedirs(os.path.dirname(path))
        shutil.copyfile(os.path.join(DATA, "segments-0.2", key + ".kvjseg"), path)
        assert store.info(key).to_dict() == {k: v for k, v in entry.items() if k != "raw_sha256"}
        t = store.get(key)
        assert store.verify(key).key == key
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    assert hashlib.sha256(raw).hexdigest() == entry["raw_sha256"]
    assert list(t.shape) == entry["shape"] and str(t.dtype) == f"torch.{entry['dtype']}"


def test_same_tensors_are_written_byte_for_byte(tmp_path):
    with SegmentStore(tmp_path / "store", threads=2) as store:
        for name, (make, codec, layout) in make_segments.TENSORS.items():
            info = store.put(make(), layout=layout, codec=codec)
            if layout is None:  # stored without a layout: the empty one now (one key for one tensor)
                assert info.key == store.put(make(), layout={}, codec=codec).key != EXPECTED[name]["key"], name
                continue
            assert info.key == EXPECTED[name]["key"], name
            with open(store.backend.path(info.key), "rb") as f:
                assert f.read() == _stored(info.key), name
