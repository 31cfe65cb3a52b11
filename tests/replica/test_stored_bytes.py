"""The per-key access a replica builds on: a segment's stored bytes out of one store and,
verified, into another (SegmentStore.read_stored / ingest_stored)."""

from __future__ import annotations

import pytest
import torch

from kvj.errors import InvalidName, SegmentCorrupt
from kvj.segments.store import SegmentStore


def test_stored_bytes_move_between_stores_bit_exactly(tmp_path):
    with SegmentStore(tmp_path / "a") as a, SegmentStore(tmp_path / "b") as b:
        tensor = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
        info = a.put(tensor, layout={"model": "m"})
        raw = bytes(a.read_stored(info.key))
        assert b.ingest_stored(info.key, raw) == info
        assert bytes(b.read_stored(info.key)) == raw
        assert torch.equal(b.get(info.key), tensor)
        assert b.ingest_stored(info.key, raw) == info  # an intact copy is kept, not an error


def test_ingest_refuses_damaged_bytes_and_bytes_of_another_key(tmp_path):
    with SegmentStore(tmp_path / "a") as a, SegmentStore(tmp_path / "b") as b:
        one = a.put(torch.ones(32, 32))
        two = a.put(torch.zeros(32, 32))
        raw = bytearray(a.read_stored(one.key))
        raw[len(raw) // 2] ^= 0x01
        with pytest.raises(SegmentCorrupt):
            b.ingest_stored(one.key, bytes(raw))
        with pytest.raises(SegmentCorrupt):
            b.ingest_stored(two.key, bytes(a.read_stored(one.key)))
        with pytest.raises(InvalidName):
            b.ingest_stored("../x", b"")
        assert list(b.keys()) == []
