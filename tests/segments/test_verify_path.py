"""The verification path of small segments: one open and one read per file, the descriptor
assembled from the parsed layout equal to its JSON definition, and every flipped byte of a
stored file still caught by the store's checks."""

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvj.errors import FormatError, SegmentCorrupt
from kvj.segments import local as backend_mod
from kvj.segments import segfile as seg
from kvj.segments import source, tensors
from kvj.segments.store import SegmentStore

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
LAYOUTS = st.none() | st.dictionaries(st.text(max_size=5), JSON, max_size=4)


def _definition(dtype, shape, layout) -> bytes:
    """The descriptor as kvj-segment(5) defines it."""
    return json.dumps({"dtype": dtype, "shape": list(shape), "layout": layout}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(list(seg.ELEMENTS)), shape=st.lists(st.integers(0, 2**40), max_size=4),
       layout=LAYOUTS)
def test_descriptor_is_its_json_definition(dtype, shape, layout):
    assert seg.descriptor(dtype, shape, layout) == _definition(dtype, shape, None if layout is None else seg.canonical_layout(layout))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(layout=LAYOUTS, n=st.integers(0, 300), codec=st.sampled_from(["raw", "zstd", "byteplane"]),
       seed=st.integers(0, 2**16))
def test_store_reads_of_random_segments_equal_the_plain_parse(tmp_path_factory, layout, n, codec, seed):
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.float16)
    with SegmentStore(tmp_path_factory.mktemp("s")) as store:
        info = store.put(t, layout=layout, codec=codec)
        data = bytes(store.read_stored(info.key))
        plain, raw = tensors.decode_into(data)
        assert plain.descriptor_json == _definition(plain.dtype, plain.shape, plain.layout)
        assert plain.layout == seg.canonical_layout(layout)
        assert store.verify(info.key) == store.info(info.key) == info
        assert raw.numpy().tobytes() == t.numpy().tobytes()
        assert torch.equal(store.get(info.key).view(torch.int16), t.view(torch.int16))


class _Counts:
    def __init__(self, monkeypatch):
        self.opens = self.reads = 0
        real_open, real_preadv = backend_mod.open_regular, os.preadv

        def open_regular(*args, **kwargs):
            self.opens += 1
            return real_open(*args, **kwargs)

        def preadv(*args):
            self.reads += 1
            return real_preadv(*args)
        monkeypatch.setattr(backend_mod, "open_regular", open_regular)
        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "pread", lambda *a: pytest.fail("a segment read by pread, not one read"))


def test_a_small_segment_is_opened_once_and_read_once(tmp_path, monkeypatch):
    with SegmentStore(tmp_path / "store") as store:
        key = store.put(torch.arange(128, dtype=torch.float16), layout={"block": 1}, codec="raw").key
        counts = _Counts(monkeypatch)
        for check in (store.info, store.verify, store.get):
            counts.opens = counts.reads = 0
            check(key)
            assert (counts.opens, counts.reads) == (1, 1), check.__name__


def test_every_flipped_byte_of_a_stored_file_is_caught(tmp_path):
    with SegmentStore(tmp_path / "store") as store:
        key = store.put(torch.arange(128, dtype=torch.float16), layout={"block": 7}, codec="raw").key
        path = store.backend.path(key)
        with open(path, "rb") as f:
            good = f.read()
        assert len(good) <= source.WHOLE_READ_BYTES  # read whole, then parsed from memory
        for pos in range(len(good)):
            bad = bytearray(good)
            bad[pos] ^= 0x10
            with open(path, "r+b") as f:
                f.write(bad)
            with pytest.raises((SegmentCorrupt, FormatError)):
                store.verify(key)
            with pytest.raises((SegmentCorrupt, FormatError)):
                store.get(key)
        with open(path, "r+b") as f:
            f.write(good)
        assert store.verify(key).key == key


@pytest.mark.parametrize("value", [2**64, -2**63 - 1, [1, {"x": 2**70}]])
def test_a_layout_integer_a_header_cannot_hold_is_refused_before_anything_is_written(tmp_path, value):
    with SegmentStore(tmp_path / "s") as store:
        with pytest.raises(FormatError, match="64-bit"):
            store.put(torch.zeros(3, dtype=torch.float16), layout={"a": value}, codec="raw")
        assert list(store.keys()) == []
