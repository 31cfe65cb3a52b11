"""The pack file format: whole segment files back to back, an index of their keys, offsets and
lengths, and a CRC'd trailer, so a pack is listed from its tail alone; and its dead list, appended
to as members are removed. Pure bytes (``packs`` has the files); ``man/kvj-segment.5``, PACKS.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Iterable, List, Sequence, Set

import crc32c

from kvj.errors import SegmentCorrupt

#: The preamble: magic, u16 version, u16 flags, u32 reserved (a segment file's layout).
MAGIC = b"\x89KVJPAK\n"
VERSION = 1
PREAMBLE = struct.Struct("<8sHHI")
#: The members: no segment file is shorter than its preamble and trailer (16 + 16 bytes).
MIN_MEMBER = 32
MAX_MEMBERS = 1 << 20
#: The index, an entry a member: its key, offset and length.
ENTRY = struct.Struct("<32sQQ")
#: The trailer: index offset, member count, CRC32C, end magic.
TRAILER = struct.Struct("<QII8s")
END_MAGIC = b"KVJPAKOK"
#: One dead-list entry: a member's key and the CRC32C of those 32 bytes.
DEAD = struct.Struct("<32sI")
SUFFIX = ".kvjpack"
DEAD_SUFFIX = ".dead"
#: A pack's name (without suffix): 16 lowercase hex digits, random.
NAME_RE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Member:
    """One segment in a pack: its key and where its bytes lie."""

    key: str
    offset: int
    length: int


def preamble() -> bytes:
    return PREAMBLE.pack(MAGIC, VERSION, 0, 0)


def tail(members: Sequence[Member], index_offset: int) -> bytes:
    """The index and trailer of a pack whose members end at ``index_offset``."""
    index = b"".join(ENTRY.pack(bytes.fromhex(m.key), m.offset, m.length) for m in members)
    head = struct.pack("<QI", index_offset, len(members))
    return index + TRAILER.pack(index_offset, len(members), crc32c.crc32c(head, crc32c.crc32c(index)), END_MAGIC)


def index_location(trailer: bytes, file_size: int, name: str) -> tuple:
    """From a pack's last 24 bytes: (index offset, member count, expected CRC)."""
    if file_size < PREAMBLE.size + TRAILER.size or len(trailer) != TRAILER.size:
        raise SegmentCorrupt(name, None, f"file too short for a pack ({file_size} bytes)")
    index_offset, count, crc, end = TRAILER.unpack(trailer)
    if end != END_MAGIC:
        raise SegmentCorrupt(name, file_size - TRAILER.size, "pack end magic missing (torn or not a pack)")
    if count > MAX_MEMBERS or index_offset + count * ENTRY.size + TRAILER.size != file_size \
            or index_offset < PREAMBLE.size + count * MIN_MEMBER:
        raise SegmentCorrupt(name, file_size - TRAILER.size, f"pack trailer implausible ({count} members "
                             f"indexed at {index_offset})")
    return index_offset, count, crc


def parse_index(pre: bytes, index: bytes, index_offset: int, count: int, crc: int, name: str) -> List[Member]:
    """Validate a pack's preamble and index (located with :func:`index_location`); its members.

    Members must lie back to back from the preamble to the index, each at least a segment's
    minimum size, with distinct keys.
    """
    head = struct.pack("<QI", index_offset, count)
    if crc32c.crc32c(head, crc32c.crc32c(index)) != crc:
        raise SegmentCorrupt(name, index_offset, "pack index CRC mismatch")
    magic, version, flags, _reserved = PREAMBLE.unpack(pre)
    if magic != MAGIC or version != VERSION or flags:
        raise SegmentCorrupt(name, 0, f"not a version {VERSION} kvj pack")
    members, pos, seen = [], PREAMBLE.size, set()
    for i in range(count):
        key, offset, length = ENTRY.unpack_from(index, i * ENTRY.size)
        hexkey = key.hex()
        if offset != pos or length < MIN_MEMBER or hexkey in seen:
            raise SegmentCorrupt(name, index_offset + i * ENTRY.size, f"pack index entry {i} is inconsistent")
        seen.add(hexkey)
        members.append(Member(hexkey, offset, length))
        pos += length
    if pos != index_offset:
        raise SegmentCorrupt(name, index_offset, "pack members do not end where the index begins")
    return members


def dead_entries(keys: Iterable[str]) -> bytes:
    """Dead-list entries for ``keys``, to append to a pack's dead list."""
    out = []
    for key in keys:
        raw = bytes.fromhex(key)
        out.append(DEAD.pack(raw, crc32c.crc32c(raw)))
    return b"".join(out)


def parse_dead(data: bytes) -> Set[str]:
    """The keys a dead list names. It ends at the first entry that is short or fails its CRC
    (a torn append, never acknowledged): a member it might have named is still live, which
    only delays its collection."""
    dead = set()
    for pos in range(0, len(data) - DEAD.size + 1, DEAD.size):
        key, crc = DEAD.unpack_from(data, pos)
        if crc32c.crc32c(key) != crc:
            break
        dead.add(key.hex())
    return dead
