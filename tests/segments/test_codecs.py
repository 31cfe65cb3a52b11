"""Codec round trips, hostile inputs, the auto choice and the Gaussian bf16 ratio."""

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvj.errors import FormatError
from kvj.segments.codecs import Backpressure, codec_names, get_codec
from kvj.segments.codecs.auto import auto_codec
from kvj.segments.codecs.byteplane import BytePlaneCodec, merge_planes, split_planes
from kvj.segments.codecs.raw import RawCodec
from kvj.segments.codecs.rowdedup import RowDedup, RowDedupFilter
from kvj.segments.codecs.zstd import ZstdCodec, zstd_decompress


def _codecs_for(itemsize):
    modes = ["r" * itemsize, "e" * itemsize, "z" * itemsize, "r" * (itemsize - 1) + "e"]
    out = [RawCodec(), ZstdCodec(level=1), ZstdCodec(level=3, long=True)]
    for fp in (True, False):
        out += [BytePlaneCodec(m, fp=fp) for m in modes]
    return out


@settings(max_examples=60, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4, 8]), data=st.binary(max_size=4096), repeat=st.integers(1, 30))
def test_every_codec_round_trips(itemsize, data, repeat):
    data = (data * repeat)[: len(data) * repeat // itemsize * itemsize]
    for codec in _codecs_for(itemsize):
        enc = codec.encode(memoryview(data), itemsize)
        again = get_codec(codec.name, codec.params)
        assert bytes(again.decode(bytes(enc), len(data), itemsize)) == data, codec


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("fp", [True, False])
def test_planes_are_a_bijection(itemsize, fp):
    raw = np.random.default_rng(itemsize).integers(0, 256, 3 * (1 << 17) * itemsize + 5 * itemsize,
                                                   dtype=np.uint8).tobytes()
    planes = split_planes(memoryview(raw), itemsize, fp)
    out = bytearray(len(raw))
    merge_planes(planes, memoryview(out), itemsize, fp)
    assert bytes(out) == raw


def test_fp_split_puts_the_bf16_exponent_alone_in_the_top_plane():
    x = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=torch.bfloat16)
    planes = split_planes(memoryview(x.view(torch.uint8).numpy()), 2, True)
    assert planes[1].tolist() == [127, 127, 128, 126]  # biased exponents, no sign
    assert [b >> 7 for b in planes[0].tolist()] == [0, 1, 0, 1]  # sign at bit 7 of plane 0


def test_gaussian_bf16_reaches_the_ratio_target():
    n = 2 << 20
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(n, dtype=np.float32)).to(torch.bfloat16)
    raw = memoryview(x.view(torch.uint8).numpy())
    codec = auto_codec(raw, 2, True)
    assert codec.name == "byteplane" and codec.params["planes"] == "re"
    stored = sum(len(codec.encode(raw[o:o + (1 << 20)], 2)) for o in range(0, len(raw), 1 << 20))
    assert len(raw) / stored >= 1.50


def test_auto_choices():
    rng = np.random.default_rng(1)
    noise = memoryview(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    assert auto_codec(noise, 1, False).name == "raw"
    zeros = memoryview(bytes(1 << 20))
    assert auto_codec(zeros, 4, False).name in ("zstd", "byteplane")
    ints = memoryview(np.arange(1 << 18, dtype=np.int64).tobytes())
    assert auto_codec(ints, 8, False).name != "raw"
    assert auto_codec(zeros, 4, False, pressure=Backpressure.SATURATED).name == "raw"


def test_busy_pressure_demands_a_bigger_gain():
    # random bytes, 15% of them zero: zstd saves ~7%, worth it normally but not when busy.
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    data[rng.random(len(data)) < 0.15] = 0
    raw = memoryview(data.tobytes())
    assert auto_codec(raw, 1, False, pressure=Backpressure.NORMAL).name != "raw"
    assert auto_codec(raw, 1, False, pressure=Backpressure.BUSY).name == "raw"


def test_backpressure_levels_clamp():
    bp = Backpressure()
    bp.set(7)
    assert bp.level == Backpressure.SATURATED
    bp.set(-3)
    assert bp.level == Backpressure.NORMAL


def test_registry_rejects_unknown_and_bad_params():
    assert {"raw", "zstd", "byteplane", "auto"} <= set(codec_names())
    with pytest.raises(FormatError):
        get_codec("lz77")
    with pytest.raises(FormatError):
        get_codec("zstd", {"level": 99})
    with pytest.raises(FormatError):
        get_codec("zstd", {"bogus": 1})
    with pytest.raises(FormatError):
        get_codec("byteplane", {"planes": "rxz"})
    with pytest.raises(FormatError):
        get_codec("raw", ["not", "a", "map"])


def test_zstd_frame_declaring_more_than_raw_len_is_refused_before_allocating():
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    with pytest.raises(FormatError):
        zstd_decompress(bomb, 1024)
    with pytest.raises(FormatError):
        zstd_decompress(b"\x00" * 16, 10)


@pytest.mark.parametrize("codec", [RawCodec(), ZstdCodec(1), BytePlaneCodec("re")])
def test_wrong_sizes_are_format_errors(codec):
    enc = bytes(codec.encode(memoryview(bytes(range(256)) * 8), 2))
    with pytest.raises(FormatError):
        codec.decode(enc, 2048 + 2, 2)
    with pytest.raises(FormatError):
        codec.decode(enc[:-1], 2048, 2)


def test_byteplane_rejects_damaged_plane_headers():
    codec = BytePlaneCodec("re")
    enc = bytearray(codec.encode(memoryview(bytes(4096)), 2))
    enc[0] = 4
    with pytest.raises(FormatError):
        codec.decode(bytes(enc), 4096, 2)
    enc[0] = 2
    enc[1] = 9  # unknown plane mode
    with pytest.raises(FormatError):
        codec.decode(bytes(enc), 4096, 2)


def test_row_dedup_round_trip_and_map_validation():
    rng = np.random.default_rng(3)
    base = rng.integers(0, 2**63, (64, 16), dtype=np.uint64)
    rows = np.concatenate([base, base[:40], rng.integers(0, 2**63, (8, 16), dtype=np.uint64), base[10:20]])
    buf = memoryview(rows.tobytes())
    src = RowDedup.find(buf, 128)
    assert (src != np.arange(len(src))).sum() == 50
    filtered = RowDedupFilter(128).encode(buf, None)  # the first-of-kind rows and the map, as stored
    undo = RowDedupFilter(128, len(src), 4 * len(src)).decoder(filtered.side, filtered.out_size)
    out = bytearray(len(buf))
    undo.prepare(memoryview(bytes(filtered.chunk(0, filtered.out_size))), memoryview(out), None)
    undo.fill(0, len(buf))
    assert bytes(out) == bytes(buf)
    bad = np.zeros(len(src), "<u4")
    bad[3] = 10  # points before row 0
    with pytest.raises(FormatError):
        RowDedup.decode_map(bad.tobytes(), len(src))
    chained = np.zeros(len(src), "<u4")
    chained[5], chained[6] = 1, 1  # row 6 -> row 5, which is itself a duplicate
    with pytest.raises(FormatError):
        RowDedup.decode_map(chained.tobytes(), len(src))


def test_row_dedup_keeps_rows_that_only_share_sampled_words():
    rows = np.zeros((4, 32), np.uint64)
    rows[1, 5] = 1  # same key columns as row 0, different content
    src = RowDedup.find(memoryview(rows.tobytes()), 256)
    assert src[1] == 1 and src[2] == 0 and src[3] == 0


def test_auto_choice_is_reused_for_a_stream_of_small_segments(monkeypatch):
    from kvj.segments.codecs import auto

    calls = []
    real = auto.auto_codec
    monkeypatch.setattr(auto, "auto_codec", lambda *a: calls.append(a) or real(*a))
    choices = auto.AutoChoices()
    block = memoryview(torch.randn(64, 1024).to(torch.bfloat16).view(torch.uint8).numpy()).cast("B")
    kind = ("bfloat16", (64, 1024))
    picked = {choices.choose(block, 2, True, Backpressure.NORMAL, kind) for _ in range(2 * auto.AutoChoices.REUSE)}
    assert len(calls) == 2 and len(picked) == 1  # sampled once per REUSE segments of a kind
    choices.choose(block, 2, True, Backpressure.BUSY, kind)  # another pressure level: its own sample
    choices.choose(block, 2, True, Backpressure.NORMAL, ("bfloat16", (32, 2048)))  # another kind too
    assert len(calls) == 4
    big = memoryview(bytes(auto.AutoChoices.SMALL + 4096))
    choices.choose(big, 4, False, Backpressure.NORMAL, ("float32", (1,)))
    choices.choose(big, 4, False, Backpressure.NORMAL, ("float32", (1,)))
    assert len(calls) == 6  # large segments are sampled every time
