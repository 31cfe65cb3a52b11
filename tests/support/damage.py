"""Bit rot in a segment, wherever the store keeps it: its own file, or a member of a pack."""

from __future__ import annotations

from kvj.segments.store import SegmentStore


def flip_a_bit(store_root: str, key: str) -> str:
    """Flip one bit a third of the way into segment ``key``'s stored bytes (nothing else in its
    file changes); returns where, as ``PATH@OFFSET``."""
    with SegmentStore(store_root) as store:
        where = store.backend.describe(key)
        size = store.backend.stat(key).size
    path, _, start = where.rpartition("@") if "@" in where else (where, "", "0")
    at = int(start) + size // 3
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    return f"{path}@{at}"
