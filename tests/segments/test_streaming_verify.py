"""segfile.verify: a segment checked a chunk at a time (every chunk CRC, then the digest over
the raw bytes rebuilt a leaf at a time) accepts what decoding accepts and refuses what it
refuses, including damage only the digest sees, with the row-dedup filter too; and the chunk
tasks of a check are submitted a window at a time, not all at once."""

from concurrent.futures import Executor, Future

import crc32c
import msgpack
import numpy as np
import pytest
import torch

from kvj.errors import SegmentCorrupt
from kvj.segments import chunks
from kvj.segments import segfile as seg
from kvj.segments import tensors
from kvj.segments.codecs import auto, get_codec


def _encode(t: torch.Tensor, codec: str, dedup=None) -> bytes:
    raw = tensors.tensor_bytes(t)
    name = tensors.dtype_name(t.dtype)
    pipeline = auto.choose(raw, seg.element(name), tuple(t.shape), codec=codec, dedup=dedup)
    enc = seg.encode(raw, dtype=name, shape=t.shape, layout={"t": 1}, digest=None, pipeline=pipeline)
    return b"".join(bytes(p) for p in enc.parts())


def _repeated_rows(seed: int) -> torch.Tensor:
    """24,000 rows of 192 bytes (4.4 MiB; a row straddles each 1 MiB leaf), drawn from 8,000
    distinct ones (a payload of two chunks)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((8000, 96)).astype(np.float16)
    return torch.from_numpy(base[rng.integers(0, 8000, 24000)])


def _cases(seed: int):
    g = torch.Generator().manual_seed(seed)
    multi = torch.randint(-3, 3, (3 << 18,), generator=g, dtype=torch.int32)  # 3 MiB: three chunks
    return [("raw", _encode(multi, "raw")), ("zstd", _encode(multi, "zstd")),
            ("byteplane", _encode(multi.to(torch.float32), "byteplane")),
            ("dedup", _encode(_repeated_rows(seed), "zstd", dedup=True))]


@pytest.mark.parametrize("seed", [5, 6])
def test_verify_accepts_every_codec_and_the_dedup_filter(seed):
    print("seed", seed)
    for name, data in _cases(seed):
        header = seg.read_header(data)
        assert (header.filter == "dedup") == (name == "dedup") and len(header.chunks) > 1, name
        assert seg.verify(data, name=name) == header
        assert tensors.decode_into(data)[0] == header


def _tamper(data: bytes, index: int) -> bytes:
    """Chunk ``index`` re-encoded from its raw bytes with one byte changed, its CRC and the
    sizes in the header rewritten to match: damage only the digest can see."""
    header = seg.read_header(data)
    codec = get_codec(header.codec, header.params)
    word = seg.element(header.dtype).word
    filt = header.stored_filter()
    start = seg.PREAMBLE.size + (filt.side_size if filt is not None else 0)
    bodies, pos = [], start
    for stored, _ in header.chunks:
        bodies.append(data[pos:pos + stored])
        pos += stored
    raw_len = min(header.chunk_size, header.payload_size - index * header.chunk_size)
    raw = codec.decode(bodies[index], raw_len, word)
    raw[raw_len // 2] ^= 0x40
    bodies[index] = bytes(codec.encode(memoryview(raw), word))
    m = header.to_map()
    m["chunks"] = [[len(b), crc32c.crc32c(b)] for b in bodies]
    m["stored_size"] = header.stored_size - sum(s for s, _ in header.chunks) + sum(len(b) for b in bodies)
    pre = data[:seg.PREAMBLE.size]
    head = msgpack.packb(m, use_bin_type=True)
    return (data[:start] + b"".join(bodies) + head
            + seg.TRAILER.pack(len(head), crc32c.crc32c(head, crc32c.crc32c(pre)), seg.END_MAGIC))


def test_damage_only_the_digest_sees_is_refused_by_verify_as_by_decoding():
    for name, data in _cases(7):
        for index in (0, len(seg.read_header(data).chunks) - 1):
            bad = _tamper(data, index)
            seg.check_stored(bad)  # every CRC holds
            for check in (seg.verify, tensors.decode_into):
                with pytest.raises(SegmentCorrupt, match="digest mismatch"):
                    check(bad, name=name)


class _Counted(Future):
    def __init__(self, owner: "_Inline"):
        super().__init__()
        self.owner = owner

    def result(self, timeout=None):
        self.owner.uncollected -= 1
        return super().result(timeout)


class _Inline(Executor):
    """Runs each task as it is submitted; counts the tasks whose result is not yet collected."""

    def __init__(self) -> None:
        self.uncollected = self.most = self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        fut = _Counted(self)
        fut.set_result(fn(*args, **kwargs))
        self.submitted += 1
        self.uncollected += 1
        self.most = max(self.most, self.uncollected)
        return fut


def test_a_check_of_many_chunks_keeps_a_window_of_tasks_not_one_per_chunk():
    """A header may list millions of 4 KiB chunks; a future each (2 KB) was a memory bomb of
    its own. The leaves come back in order all the same."""
    raw = memoryview(np.arange(300 << 10, dtype=np.uint8)).cast("B")  # 300 KiB: 75 leaves of 4 KiB
    pool = _Inline()
    got = seg.compute_digest(raw, "uint8", [len(raw)], None, pool=pool, chunk_size=4096)
    assert got == seg.compute_digest(raw, "uint8", [len(raw)], None, chunk_size=4096)
    assert pool.submitted == 75 and pool.most <= chunks.IN_FLIGHT < 75


def test_a_dedup_segment_is_verified_without_rebuilding_its_raw_bytes(monkeypatch):
    """Only the payload is held: the raw bytes are gathered a leaf at a time from it."""
    from kvj.segments.codecs import rowdedup

    data = _encode(_repeated_rows(8), "zstd", dedup=True)
    header = seg.read_header(data)

    def whole(*args):
        raise AssertionError("the raw bytes were rebuilt whole to verify them")
    monkeypatch.setattr(rowdedup._Scatter, "prepare", whole)
    assert header.filter == "dedup" and seg.verify(data) == header
