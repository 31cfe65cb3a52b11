"""The journal's on-disk framing, shared by writer and reader (spec: man/kvj-journal.5).

A log file is a 36-byte file header followed by commit groups. A commit group is
what one fdatasync made durable: a 32-byte group header, then ``count`` records.
Each record is a 20-byte header and a msgpack payload. All integers little-endian.

    file header   magic[8] version:u16 flags:u16 seq:u64 base_lsn:u64 salt:u32 crc:u32
    group header  magic[4] crc:u32 body_len:u32 count:u32 first_lsn:u64 time_ns:u64
    record header crc:u32 length:u32 type:u16 flags:u16 lsn:u64

``time_ns`` is the wall-clock time (Unix nanoseconds) at which the group was written.
Version 1 files (kvj 0.1.0) have a 24-byte group header without it; they are read, and
never appended to.

Every CRC is CRC32C: the file header's over its first 32 bytes; the group header's over
its last 16 bytes, starting from the file's random ``salt`` instead of 0, so bytes inside
a payload pass for a group header only with probability about 2^-32 per position (they
must match a CRC under a seed they do not know); a record's over its header after the
CRC field and its payload. Type 0 is reserved, so zero-filled space never parses as a record.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

from crc32c import crc32c

FILE_MAGIC = b"\x89KVJLOG\n"
FORMAT_VERSION = 2
#: Versions this kvj reads: 1 (kvj 0.1.0, groups without a time) and 2.
READABLE_VERSIONS = (1, 2)
GROUP_MAGIC = b"KVJG"

FILE_HEADER = struct.Struct("<8sHHQQII")
GROUP_HEADER = struct.Struct("<4sIIIQQ")
GROUP_HEADERS = {1: struct.Struct("<4sIIIQ"), 2: GROUP_HEADER}
RECORD_HEADER = struct.Struct("<IIHHQ")
RECORD_TAIL = struct.Struct("<IHHQ")  # the record header after its CRC field
CRC = struct.Struct("<I")

FILE_HEADER_SIZE = FILE_HEADER.size  # 36
GROUP_HEADER_SIZE = GROUP_HEADER.size  # 32
RECORD_HEADER_SIZE = RECORD_HEADER.size  # 20

#: Records are small (tensor data lives in the segment store); anything larger is damage.
MAX_RECORD_PAYLOAD = 16 << 20
#: A group never exceeds this many bytes; a larger declared length is damage.
MAX_GROUP_BODY = 1 << 30


def new_salt() -> int:
    """A random 32-bit salt for a new log file's group-header CRCs."""
    return int.from_bytes(os.urandom(4), "little")


def encode_file_header(seq: int, base_lsn: int, salt: int) -> bytes:
    head = FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0, seq, base_lsn, salt, 0)[:-4]
    return head + CRC.pack(crc32c(head))


@dataclass(frozen=True)
class FileHeader:
    version: int
    seq: int
    base_lsn: int
    salt: int


def header_torn(data: bytes) -> bool:
    """Whether an invalid file header on a file starting with ``data`` can be a crash during its creation.

    The header is written and fsynced before any group, so a file longer than its
    header with a bad header is corruption, never a torn creation.
    """
    return len(data) <= FILE_HEADER_SIZE


def decode_file_header(data: bytes) -> Optional[FileHeader]:
    """Return the header, or None when the bytes are not a valid kvj log file header."""
    if len(data) < FILE_HEADER_SIZE:
        return None
    magic, version, _flags, seq, base_lsn, salt, crc = FILE_HEADER.unpack_from(data, 0)
    if magic != FILE_MAGIC or crc32c(data[: FILE_HEADER_SIZE - 4]) != crc:
        return None
    return FileHeader(version, seq, base_lsn, salt)


def encode_record(rtype: int, lsn: int, payload: bytes) -> bytes:
    """Frame one record (header with CRC, then payload)."""
    tail = RECORD_TAIL.pack(len(payload), rtype, 0, lsn)
    return CRC.pack(crc32c(payload, crc32c(tail))) + tail + payload


def encode_group_header(body_len: int, count: int, first_lsn: int, salt: int = 0, time_ns: int = 0,
                        version: int = FORMAT_VERSION) -> bytes:
    """A group header for a file of format ``version`` (version 1 has no ``time_ns``)."""
    if version == 1:
        tail = GROUP_HEADERS[1].pack(GROUP_MAGIC, 0, body_len, count, first_lsn)[8:]
    else:
        tail = GROUP_HEADER.pack(GROUP_MAGIC, 0, body_len, count, first_lsn, time_ns)[8:]
    return GROUP_MAGIC + CRC.pack(crc32c(tail, salt)) + tail


@dataclass(frozen=True)
class RawRecord:
    """One framed record as found on disk."""

    lsn: int
    rtype: int
    payload: bytes
    path: str
    offset: int  # of the record header within its file
    time: Optional[float] = None  # when its group was written (Unix seconds); None in version 1 files


def group_header_at(data: bytes, off: int, salt: int = 0,
                    version: int = FORMAT_VERSION) -> Optional[Tuple[int, int, int, Optional[int]]]:
    """(body_len, count, first_lsn, time_ns) if a valid group header (for ``salt`` and the
    file format ``version``) starts at ``off``; time_ns is None in version 1 files."""
    layout = GROUP_HEADERS[version]
    if off + layout.size > len(data) or data[off:off + 4] != GROUP_MAGIC:
        return None
    _magic, crc, body_len, count, first_lsn, *time_ns = layout.unpack_from(data, off)
    if crc32c(data[off + 8:off + layout.size], salt) != crc or body_len > MAX_GROUP_BODY:
        return None
    return body_len, count, first_lsn, time_ns[0] if time_ns else None


def parse_group(data: bytes, off: int, path: str, salt: int = 0, origin: int = 0,
                version: int = FORMAT_VERSION) -> Optional[Tuple[List[RawRecord], int]]:
    """Parse the commit group at ``off``: (records, end offset), or None if any check fails.

    A group is all-or-nothing: one bad record, a short body or an LSN out of sequence
    invalidates the whole group. ``data`` holds the file from byte ``origin`` on; the
    records' offsets are in the file.
    """
    head = group_header_at(data, off, salt, version)
    if head is None:
        return None
    body_len, count, first_lsn, time_ns = head
    when = time_ns / 1e9 if time_ns is not None else None
    pos = off + GROUP_HEADERS[version].size
    end = pos + body_len
    if end > len(data) or count == 0:
        return None
    records: List[RawRecord] = []
    lsn = first_lsn
    for _ in range(count):
        if pos + RECORD_HEADER_SIZE > end:
            return None
        crc, length, rtype, _flags, rec_lsn = RECORD_HEADER.unpack_from(data, pos)
        stop = pos + RECORD_HEADER_SIZE + length
        if rtype == 0 or rec_lsn != lsn or length > MAX_RECORD_PAYLOAD or stop > end:
            return None
        if crc32c(data[pos + RECORD_HEADER_SIZE:stop], crc32c(data[pos + 4:pos + RECORD_HEADER_SIZE])) != crc:
            return None
        records.append(RawRecord(lsn, rtype, bytes(data[pos + RECORD_HEADER_SIZE:stop]), path, origin + pos, when))
        pos = stop
        lsn += 1
    if pos != end:
        return None
    return records, end


def later_group_exists(data: bytes, off: int, after_lsn: int, salt: int = 0,
                       version: int = FORMAT_VERSION) -> Optional[int]:
    """Offset of a valid group header past ``off`` whose LSNs follow ``after_lsn``, if any.

    Groups are written one at a time, each only after the previous one was fdatasynced,
    so a valid group after a damaged one proves the damage is not a torn tail. The salt
    makes payload bytes (which a tenant may choose) pass for such a group only with
    probability about 2^-32 per candidate position.
    """
    pos = data.find(GROUP_MAGIC, off + 1)
    while pos != -1:
        head = group_header_at(data, pos, salt, version)
        if head is not None and head[2] > after_lsn:
            return pos
        pos = data.find(GROUP_MAGIC, pos + 1)
    return None
