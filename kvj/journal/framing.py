"""The log file's framing, shared by writer and reader (spec: man/kvj-journal.5, LOG FILE).

A log file is a file header, then commit groups (what one fdatasync made durable), each a group
header and ``count`` records. Every CRC is CRC32C; the group header's starts from the file's
random salt, so payload bytes pass for a group header only with probability about 2^-32 per
position. Version 1 files (kvj 0.1.0: group headers without a time) are read, never appended to.
"""

from __future__ import annotations

import struct
from typing import List, NamedTuple, Optional, Tuple

from crc32c import crc32c

FILE_MAGIC = b"\x89KVJLOG\n"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
GROUP_MAGIC = b"KVJG"

FILE_HEADER = struct.Struct("<8sHHQQII")  # magic version flags seq base_lsn salt crc
GROUP_HEADER = struct.Struct("<4sIIIQQ")  # magic crc body_len count first_lsn time_ns
GROUP_HEADERS = {1: struct.Struct("<4sIIIQ"), 2: GROUP_HEADER}
RECORD_HEADER = struct.Struct("<IIHHQ")  # crc length type flags lsn
RECORD_TAIL = struct.Struct("<IHHQ")  # the record header after its CRC field
CRC = struct.Struct("<I")

FILE_HEADER_SIZE = FILE_HEADER.size  # 36
GROUP_HEADER_SIZE = GROUP_HEADER.size  # 32
RECORD_HEADER_SIZE = RECORD_HEADER.size  # 20

#: Records are small (tensor data lives in the segment store); anything larger is damage.
MAX_RECORD_PAYLOAD = 16 << 20
#: A group never exceeds this many bytes; a larger declared length is damage.
MAX_GROUP_BODY = 1 << 30


class FileHeader(NamedTuple):
    version: int
    seq: int
    base_lsn: int
    salt: int


class RawRecord(NamedTuple):
    """One framed record as found on disk (a named tuple: replay builds one per record)."""

    lsn: int
    rtype: int
    payload: bytes
    path: str
    offset: int  # of the record header within its file
    time: Optional[float] = None  # when its group was written (Unix seconds); None in version 1 files


def encode_file_header(seq: int, base_lsn: int, salt: int) -> bytes:
    """A log file's header, in the current format."""
    head = FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0, seq, base_lsn, salt, 0)[:-4]
    return head + CRC.pack(crc32c(head))


def decode_file_header(data: bytes) -> Optional[FileHeader]:
    """The header ``data`` starts with, or None when it is not a valid kvj log file header."""
    if len(data) < FILE_HEADER_SIZE:
        return None
    magic, version, _flags, seq, base_lsn, salt, crc = FILE_HEADER.unpack_from(data, 0)
    if magic != FILE_MAGIC or crc32c(data[: FILE_HEADER_SIZE - 4]) != crc:
        return None
    return FileHeader(version, seq, base_lsn, salt)


def header_torn(data: bytes) -> bool:
    """Whether an invalid header on a file starting with ``data`` can be a crash while creating it:
    the header is fsynced before any group, so a longer file with a bad header is corruption."""
    return len(data) <= FILE_HEADER_SIZE


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


def group_header_at(data: bytes, off: int, salt: int = 0,
                    version: int = FORMAT_VERSION) -> Optional[Tuple[int, int, int, Optional[int]]]:
    """(body_len, count, first_lsn, time_ns) if a valid group header starts at ``off``; time_ns
    is None in version 1 files."""
    layout = GROUP_HEADERS[version]
    if off + layout.size > len(data) or data[off:off + 4] != GROUP_MAGIC:
        return None
    _magic, crc, body_len, count, first_lsn, *time_ns = layout.unpack_from(data, off)
    if crc32c(data[off + 8:off + layout.size], salt) != crc or body_len > MAX_GROUP_BODY:
        return None
    return body_len, count, first_lsn, time_ns[0] if time_ns else None


def parse_group(data: bytes, off: int, path: str, salt: int = 0, origin: int = 0,
                version: int = FORMAT_VERSION) -> Optional[Tuple[List[RawRecord], int]]:
    """The commit group at ``off`` as (records, end offset), or None if any check fails: a group
    is all or nothing. ``data`` holds the file from byte ``origin`` on."""
    head = group_header_at(data, off, salt, version)
    if head is None:
        return None
    body_len, count, first_lsn, time_ns = head
    when = time_ns / 1e9 if time_ns is not None else None
    pos = off + GROUP_HEADERS[version].size
    end = pos + body_len
    if end > len(data) or count == 0:
        return None
    view = memoryview(data)
    unpack, size = RECORD_HEADER.unpack_from, RECORD_HEADER_SIZE
    records: List[RawRecord] = []
    append = records.append
    make = tuple.__new__  # RawRecord(...) without its Python-level __new__: one per record
    for lsn in range(first_lsn, first_lsn + count):
        if pos + size > end:
            return None
        crc, length, rtype, _flags, rec_lsn = unpack(data, pos)
        stop = pos + size + length
        if rtype == 0 or rec_lsn != lsn or length > MAX_RECORD_PAYLOAD or stop > end \
                or crc32c(view[pos + 4:stop]) != crc:
            return None
        append(make(RawRecord, (lsn, rtype, data[pos + size:stop], path, origin + pos, when)))
        pos = stop
    return (records, end) if pos == end else None


def later_group_exists(data: bytes, off: int, after_lsn: int, salt: int = 0,
                       version: int = FORMAT_VERSION) -> Optional[int]:
    """Offset of a valid group header past ``off`` whose LSNs follow ``after_lsn``, if any: groups
    are written one at a time, so one after a damaged group proves the damage is no torn tail."""
    pos = data.find(GROUP_MAGIC, off + 1)
    while pos != -1:
        head = group_header_at(data, pos, salt, version)
        if head is not None and head[2] > after_lsn:
            return pos
        pos = data.find(GROUP_MAGIC, pos + 1)
    return None
