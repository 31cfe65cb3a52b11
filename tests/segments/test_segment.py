"""Segment format: bit-exact round trips, damage detection, hostile headers."""

import math

import crc32c
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvj.errors import FormatError, SegmentCorrupt
from kvj.segments import segfile as seg
from kvj.segments import tensors
from kvj.segments.codecs import auto, get_codec
from kvj.segments.codecs.base import Filter, Filtered, Pipeline, Unfilter

DTYPES = list(tensors.DTYPES.values())


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _random_tensor(dtype, shape, seed):
    n = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
    if dtype == torch.bool:
        raw = raw & 1
    if n == 0:
        return torch.zeros(shape, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)


def encode_tensor(t, codec="auto", layout=None, dedup=None):
    raw = tensors.tensor_bytes(t)
    name = tensors.dtype_name(t.dtype)
    digest = seg.compute_digest(raw, name, t.shape, seg.canonical_layout(layout))
    pipeline = auto.choose(raw, seg.element(name), tuple(t.shape), codec=codec, dedup=dedup)
    enc = seg.encode(raw, dtype=name, shape=t.shape, layout=layout, digest=digest, pipeline=pipeline)
    data = b"".join(bytes(p) for p in enc.parts())
    assert len(data) == enc.file_size
    return data, enc.header


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES),
       shape=st.lists(st.integers(0, 7), min_size=0, max_size=4),
       codec=st.sampled_from(["raw", "zstd", "byteplane", "auto"]),
       transpose=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_round_trip_is_bit_exact(dtype, shape, codec, transpose, seed):
    t = _random_tensor(dtype, tuple(shape), seed)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, -1)  # non-contiguous input
    data, header = encode_tensor(t, codec=codec, layout={"model": "m", "n": 3})
    got_header, out = tensors.decode_into(data)
    assert got_header == header
    assert out.dtype == dtype and tuple(out.shape) == tuple(t.shape)
    assert _bytes_of(out) == _bytes_of(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_round_trip(dtype):
    if dtype.is_floating_point:
        vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -2.5, 448.0])
        try:
            t = vals.to(dtype)
        except (RuntimeError, TypeError):
            pytest.skip(f"{dtype} conversion unsupported")
    else:
        t = _random_tensor(dtype, (3, 5), 7)
    t = t.reshape(-1)[::2]  # strided view
    data, _ = encode_tensor(t, codec="byteplane" if dtype.itemsize > 1 else "zstd")
    _, out = tensors.decode_into(data)
    assert _bytes_of(out) == _bytes_of(t)


def test_large_multi_chunk_and_zero_size():
    x = torch.randn(3 * seg.CHUNK_SIZE // 4 + 11, dtype=torch.float32)
    data, header = encode_tensor(x)
    assert len(header.chunks) == 4  # 3 MiB + 44 bytes
    assert torch.equal(tensors.decode_into(data)[1], x)
    for shape in [(0,), (4, 0, 3), ()]:
        t = torch.zeros(shape, dtype=torch.bfloat16) if shape != () else torch.tensor(2.5)
        _, out = tensors.decode_into(encode_tensor(t)[0])
        assert out.shape == t.shape and _bytes_of(out) == _bytes_of(t)


def test_decode_into_given_buffer():
    x = torch.randn(1000, dtype=torch.float64)
    data, header = encode_tensor(x)
    buf = torch.empty(header.raw_size + 100, dtype=torch.uint8)
    _, out = tensors.decode_into(data, buf)
    assert torch.equal(out, x) and out.data_ptr() == buf.data_ptr()


def _kv_with_shared_prefix():
    g = torch.Generator().manual_seed(0)
    prefix = torch.randn(2, 576, 8, 64, generator=g).to(torch.bfloat16)
    reqs = [torch.cat([prefix, torch.randn(2, 192, 8, 64, generator=g).to(torch.bfloat16)], 1) for _ in range(3)]
    # [3 requests, 2, 768 tokens, 8 heads, 64]: 1.5 MiB per request (repeats lie a chunk or
    # more apart, out of reach of per-chunk zstd), 3/4 of each request a shared prefix
    return torch.stack(reqs)


def test_row_dedup_captures_shared_prefixes():
    kv = _kv_with_shared_prefix()
    data, header = encode_tensor(kv)
    assert header.filter == "dedup"
    plain, _ = encode_tensor(kv, dedup=False)
    assert len(plain) / len(data) > 1.8
    _, out = tensors.decode_into(data)
    assert _bytes_of(out) == _bytes_of(kv)


def _flip_everywhere(data, positions):
    for pos in positions:
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[pos] ^= mask
            with pytest.raises((SegmentCorrupt, FormatError)):
                tensors.decode_into(bytes(bad))


@pytest.mark.parametrize("codec", ["raw", "zstd", "byteplane"])
def test_every_flipped_byte_is_detected_small(codec):
    t = torch.linspace(-3, 3, 96).to(torch.float16).reshape(8, 12)
    data, _ = encode_tensor(t, codec=codec, layout={"model": "x"})
    _flip_everywhere(data, range(len(data)))


def test_flipped_bytes_are_detected_sampled_large():
    data, header = encode_tensor(_kv_with_shared_prefix())
    assert header.filter == "dedup" and len(header.chunks) >= 1
    rng = np.random.default_rng(5)
    positions = list(rng.choice(len(data), 150, replace=False)) + list(range(40)) + list(range(len(data) - 300, len(data)))
    _flip_everywhere(data, sorted(set(int(p) for p in positions)))


def test_every_truncation_is_detected():
    data, _ = encode_tensor(torch.arange(200, dtype=torch.int32), codec="zstd")
    for n in range(len(data)):
        with pytest.raises(SegmentCorrupt):
            tensors.decode_into(data[:n])
    with pytest.raises(SegmentCorrupt):
        tensors.decode_into(data + b"\x00")


def _forge(data, mutate):
    """Rewrite the header with ``mutate`` and a valid header CRC (an attacker's file)."""
    size = len(data)
    hlen, _, end = seg.TRAILER.unpack(data[-seg.TRAILER.size:])
    off = size - seg.TRAILER.size - hlen
    m = msgpack.unpackb(data[off:off + hlen], raw=False)
    mutate(m)
    head = msgpack.packb(m, use_bin_type=True)
    pre = data[:seg.PREAMBLE.size]
    crc = crc32c.crc32c(head, crc32c.crc32c(pre))
    return data[:off] + head + seg.TRAILER.pack(len(head), crc, end)


HOSTILE = [
    lambda m: m.update(raw_size=1 << 60, shape=[1 << 59]),
    lambda m: m.update(raw_size=(1 << 35), shape=[1 << 34]),
    lambda m: m.update(shape=[-1]),
    lambda m: m.update(shape=[2] * 100),
    lambda m: m.update(chunk_size=1 << 40),
    lambda m: m.update(chunk_size=3),
    lambda m: m.update(chunks=[[1, 0]] * 100000),
    lambda m: m.update(chunks=[[1 << 50, 0]]),
    lambda m: m.update(chunks=[["x", 0]]),
    lambda m: m.update(stored_size=1 << 62),
    lambda m: m.update(codec="nope"),
    lambda m: m.update(params={"level": 10**9}),
    lambda m: m.update(dtype="object"),
    lambda m: m.update(digest=b"short"),
    lambda m: m.update(digest_alg="md5"),
    lambda m: m.update(layout=[1, 2]),
    lambda m: m.update(dedup={"row_bytes": 8, "rows": 1 << 40, "map_raw": 4 << 40, "map_stored": 1, "map_crc": 0}),
    lambda m: m.update(payload_size=7),
    lambda m: m.clear(),
]


@pytest.mark.parametrize("mutate", HOSTILE)
def test_hostile_headers_are_clean_errors(mutate):
    data, _ = encode_tensor(torch.arange(64, dtype=torch.int16), codec="zstd")
    with pytest.raises((SegmentCorrupt, FormatError)):
        tensors.decode_into(_forge(data, mutate))


def test_hostile_trailer_and_header_bytes():
    data, _ = encode_tensor(torch.arange(64, dtype=torch.int16))
    hlen, crc, end = seg.TRAILER.unpack(data[-16:])
    for bad_len in (0xFFFFFFFF, len(data), hlen + 1):
        with pytest.raises(SegmentCorrupt):
            tensors.decode_into(data[:-16] + seg.TRAILER.pack(bad_len, crc, end))
    # garbage that passes the CRC but is not msgpack, and a deeply nested map
    for head in (b"\xc1\xc1\xc1", b"\x91" * 5000 + b"\xc0", msgpack.packb([1, 2, 3])):
        pre = data[:16]
        forged = pre + head + seg.TRAILER.pack(len(head), crc32c.crc32c(head, crc32c.crc32c(pre)), end)
        with pytest.raises(SegmentCorrupt):
            tensors.decode_into(forged)


def test_forged_digest_is_detected():
    data, _ = encode_tensor(torch.arange(64, dtype=torch.int16))
    forged = _forge(data, lambda m: m.update(digest=bytes(32)))
    with pytest.raises(SegmentCorrupt, match="digest"):
        tensors.decode_into(forged)


def test_forged_layout_changes_the_digest():
    data, _ = encode_tensor(torch.arange(64, dtype=torch.int16), layout={"model": "a"})
    forged = _forge(data, lambda m: m.update(layout={"model": "b"}))
    with pytest.raises(SegmentCorrupt, match="digest"):
        tensors.decode_into(forged)


def test_unsupported_version_is_a_format_error():
    data, _ = encode_tensor(torch.arange(4, dtype=torch.int16))
    pre = seg.PREAMBLE.pack(seg.MAGIC, 99, 0, 0)
    hlen, _, end = seg.TRAILER.unpack(data[-16:])
    head = data[-16 - hlen:-16]
    forged = pre + data[16:-16] + seg.TRAILER.pack(hlen, crc32c.crc32c(head, crc32c.crc32c(pre)), end)
    with pytest.raises(FormatError, match="version"):
        tensors.decode_into(forged)


def test_digest_depends_on_dtype_shape_layout_and_bytes():
    raw = memoryview(bytes(range(64)))
    base = seg.compute_digest(raw, "int16", (32,), None)
    assert base != seg.compute_digest(raw, "uint16", (32,), None)
    assert base != seg.compute_digest(raw, "int16", (4, 8), None)
    assert base != seg.compute_digest(raw, "int16", (32,), {"model": "m"})
    assert base != seg.compute_digest(memoryview(bytes(range(1, 65))), "int16", (32,), None)
    assert seg.compute_digest(raw, "int16", (32,), {"a": 1, "b": 2}) == \
        seg.compute_digest(raw, "int16", (32,), {"b": 2, "a": 1})


def test_check_stored_finds_chunk_damage_without_decoding():
    data, _ = encode_tensor(torch.randn(5000))
    seg.check_stored(data)
    bad = bytearray(data)
    bad[20] ^= 1
    with pytest.raises(SegmentCorrupt, match="chunk 0"):
        seg.check_stored(bytes(bad))


def test_unsupported_dtype_and_bad_layout_rejected():
    with pytest.raises(FormatError):
        tensors.dtype_name(torch.quint8)
    with pytest.raises(FormatError):
        seg.canonical_layout({"x": object()})
    with pytest.raises(FormatError):
        seg.canonical_layout({"x": float("nan")})


class _Halves(Filter):
    """A test filter with side data: stores the second half of the bytes, then the first,
    and the split point as side data (a stand-in for a third-party filter)."""

    name = "halves"
    side_name = "halves split"

    def __init__(self, split=0, side_size=0, side_crc=0):
        self.split, self.side_size, self.side_crc = split, side_size, side_crc

    def encode(self, raw, pool):
        split = len(raw) // 2
        raw_bytes = bytes(raw)

        class Out(Filtered):
            out_size = len(raw_bytes)
            side = split.to_bytes(8, "little")

            def chunk(self, offset, n):
                return memoryview(raw_bytes[split:] + raw_bytes[:split])[offset:offset + n]

            def field(self, side_crc):
                return {"split": split, "side_size": 8, "side_crc": side_crc}
        return Out()

    @classmethod
    def from_field(cls, field, in_size, out_size, stored_size):
        if not isinstance(field, dict) or in_size != out_size or field.get("side_size") != 8:
            raise FormatError("bad halves field")
        return cls(field["split"], 8, field["side_crc"])

    def field(self):
        return {"split": self.split, "side_size": self.side_size, "side_crc": self.side_crc}

    def decoder(self, side, out_size):
        split = int.from_bytes(bytes(side), "little")
        if split != self.split or split > out_size:
            raise FormatError("halves split disagrees")

        class Undo(Unfilter):
            def prepare(self, payload, out, pool):
                data = bytes(payload)
                self.whole, self.out = data[out_size - split:] + data[:out_size - split], out

            def fill(self, offset, n):
                self.out[offset:offset + n] = self.whole[offset:offset + n]
        return Undo()


def test_any_registered_filter_runs_through_the_pipeline(monkeypatch):
    """Filters run generically: a filter kvj does not know, once registered, is written with
    its side data and header field and read back, CRC and digest checked."""
    from kvj.segments.codecs import registry

    monkeypatch.setitem(registry._FILTERS, "halves", _Halves)
    t = torch.arange(3 << 18, dtype=torch.int32)  # 3 MiB: several chunks
    raw = tensors.tensor_bytes(t)
    enc = seg.encode(raw, dtype="int32", shape=t.shape, layout=None, digest=None,
                     pipeline=Pipeline(get_codec("zstd", {"level": 1}), _Halves()))
    data = b"".join(bytes(p) for p in enc.parts())
    m = msgpack.unpackb(data[-16 - seg.TRAILER.unpack(data[-16:])[0]:-16], raw=False)
    assert m["halves"]["split"] == len(raw) // 2 and m["dedup"] is None
    header, out = tensors.decode_into(data)
    assert header.filter == "halves" and torch.equal(out, t)
    assert seg.check_stored(data).filter == "halves"
    bad = bytearray(data)
    bad[16] ^= 1  # the side data
    with pytest.raises(SegmentCorrupt, match="halves split CRC mismatch"):
        tensors.decode_into(bytes(bad))
    both = _forge(data, lambda m: m.update(dedup={"row_bytes": 8, "rows": 1, "map_raw": 4, "map_stored": 1,
                                                  "map_crc": 0}))
    with pytest.raises(SegmentCorrupt, match="more than one filter"):
        tensors.decode_into(both)


def test_xor_delta_filter_matches_the_training_delta():
    """The XOR filter's bytes are the raw bits XORed (what training stores for a delta stream), whole
    or a chunk at a time, and its decoder undoes them."""
    from kvj.segments.codecs.xordelta import XorDelta

    g = torch.Generator().manual_seed(11)
    base = torch.randn(4096, generator=g)
    now = base + 1e-3 * torch.randn(4096, generator=g)
    filt = XorDelta(tensors.tensor_bytes(base))
    bits = tensors.tensor_bytes(torch.bitwise_xor(now.view(torch.int32), base.view(torch.int32)))
    assert filt.apply(tensors.tensor_bytes(now)).tobytes() == bytes(bits)
    filtered = filt.encode(tensors.tensor_bytes(now), None)
    assert b"".join(bytes(filtered.chunk(o, 1000)) for o in range(0, len(bits), 1000)) == bytes(bits)
    out = bytearray(len(bits))
    undo = filt.decoder(b"", len(bits))
    undo.prepare(memoryview(bits), memoryview(out), None)
    for o in range(0, len(bits), 4096):
        undo.fill(o, 4096)
    assert bytes(out) == bytes(tensors.tensor_bytes(now))
    with pytest.raises(FormatError):
        filt.encode(memoryview(bytes(8)), None)
