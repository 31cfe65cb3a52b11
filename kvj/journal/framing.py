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
from typing import List, NamedTuple, Optional, Tuple

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


class RawRecord(NamedTuple):
    """One framed record as found on disk (a named tuple: replay builds one per record)."""

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
    view = memoryview(data)
    unpack, size = RECORD_HEADER.unpack_from, RECORD_HEADER_SIZE
    records: List[RawRecord] = []
    append = records.append
    make = tuple.__new__  # RawRecord(...) without its Python-level __new__: one per record
    for lsn in range(first_lsn, first_lsn + count):  # the checks of ``_records``, in one pass
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


#: A torn write loses whole sectors: at a crash, each 512-byte-aligned piece of the write in
#: flight (clipped to the write) is on disk as written, or reads as zeros, as garbage, or not
#: at all (the file ends before it). This is the persistence model of SQLite's crash VFS,
#: ALICE and tests/support/crashfs.py; 4096-byte tearing is a special case of it.
SECTOR = 512
#: Payloads searched for one flipped bit (a bit at a time in Python: bounded, the rest is
#: judged by sectors alone).
MAX_FLIP_SEARCH = 64 << 10
_POLY = 0x82F63B78  # CRC32C, reflected


@dataclass(frozen=True)
class TailEvidence:
    """What an invalid last group's bytes say. ``damaged``: they cannot be a torn write, so
    the group was whole on disk once and its records may have been acknowledged. ``records``
    and ``first_lsn``: what its header (or a one-bit repair of it) declares, when known."""

    damaged: bool
    why: str
    records: Optional[int] = None
    first_lsn: Optional[int] = None


def _flipped_bit(message: bytes, syndrome: int) -> Optional[int]:
    """The bit (index in CRC order: byte * 8 + bit, least significant first) whose flip turns
    the CRC32C of ``message`` into one differing by ``syndrome``; None when no single bit does.

    CRC is linear: for messages of one length (and one seed) the CRCs of ``m`` and of ``m``
    with bit p flipped differ by the CRC, from 0 without final XOR, of a 1 followed by the
    zero bits after p: ``_POLY`` shifted through them. Walk p from the last bit back."""
    c = _POLY
    for p in range(len(message) * 8 - 1, -1, -1):
        if c == syndrome:
            return p
        c = (c >> 1) ^ (_POLY if c & 1 else 0)
    return None


def _one_bit(covered: bytes, stored: int, seed: int) -> Optional[int]:
    """Where one flipped bit explains ``stored`` != CRC32C(``covered``, ``seed``): the bit index
    in ``covered``, -1 - k for bit k of the stored CRC itself, None when no single bit does."""
    syndrome = crc32c(covered, seed) ^ stored
    if syndrome & (syndrome - 1) == 0:  # one bit of the stored CRC (0 cannot be: it failed)
        return -1 - syndrome.bit_length() + 1
    if len(covered) > MAX_FLIP_SEARCH:
        return None
    return _flipped_bit(covered, syndrome)


def _bit_at(start: int, bit: Optional[int], crc_at: int) -> str:
    """Where a flipped bit found by ``_one_bit`` is, in file offsets."""
    if bit is not None and bit < 0:
        return f"offset {crc_at + (-1 - bit) // 8} (bit {(-1 - bit) % 8}, in its CRC)"
    return f"offset {start + bit // 8} (bit {bit % 8})"  # type: ignore[operator]


def _records(data: bytes, pos: int, end: int, first_lsn: int, count: int) -> Optional[List[Tuple[int, int, bool]]]:
    """(start, stop, CRC good) of each record of the group body at [pos, end), or None when the
    record headers do not chain (a length, type or LSN that cannot be the next record's)."""
    out = []
    for lsn in range(first_lsn, first_lsn + count):
        if pos + RECORD_HEADER_SIZE > end:
            return None
        crc, length, rtype, _flags, rec_lsn = RECORD_HEADER.unpack_from(data, pos)
        stop = pos + RECORD_HEADER_SIZE + length
        if rtype == 0 or rec_lsn != lsn or length > MAX_RECORD_PAYLOAD or stop > end:
            return None
        out.append((pos, stop, crc32c(data[pos + 4:stop]) == crc))
        pos = stop
    return out if pos == end and out else None


def _repair_chain(data: bytes, pos: int, end: int, first_lsn: int, count: int) -> Optional[int]:
    """The file-relative offset*8+bit of one bit whose flip, in some record header's
    length, type, flags or LSN, makes the group body chain and every record's CRC hold."""
    walked: List[int] = []
    at = pos
    for lsn in range(first_lsn, first_lsn + count):  # how far the chain goes: the break is at or after it
        if at + RECORD_HEADER_SIZE > end:
            break
        _crc, length, rtype, _flags, rec_lsn = RECORD_HEADER.unpack_from(data, at)
        if rtype == 0 or rec_lsn != lsn or at + RECORD_HEADER_SIZE + length > end:
            break
        walked.append(at)
        at += RECORD_HEADER_SIZE + length
    candidates = walked[-1:] + ([at] if at + RECORD_HEADER_SIZE <= end else [])
    body = bytearray(data[pos:end])
    for start in candidates:
        for bit in range(32, RECORD_HEADER_SIZE * 8):  # the header after its CRC field
            body[start - pos + bit // 8] ^= 1 << (bit % 8)
            walk = _records(bytes(body), 0, end - pos, first_lsn, count)
            body[start - pos + bit // 8] ^= 1 << (bit % 8)
            if walk is not None and all(good for _a, _b, good in walk):
                return start * 8 + bit
    return None


def _tearable(data: bytes, record: Tuple[int, int, bool], unverified: List[Tuple[int, int]], ws: int, we: int,
              origin: int) -> bool:
    """Whether a torn write can have made ``record`` fail: some sector piece of the write at
    [ws, we) that overlaps the record lies wholly in bytes nothing verified (``unverified``:
    merged ranges), as a lost sector's must, or reads as zeros throughout (a zeroed sector
    over header fields whose true bytes were zeros too, such as an LSN's high bytes, still
    chains). Offsets are in ``data``; sectors align in the file."""
    start, stop, _good = record
    sector = (origin + start) // SECTOR * SECTOR - origin
    while sector < stop:
        a, b = max(sector, ws), min(sector + SECTOR, we)
        if a < b and (any(u <= a and b <= v for u, v in unverified) or data.count(0, a, b) == b - a):
            return True
        sector += SECTOR
    return False


def _zeroed(data: bytes, at: int, ws: int, we: int, origin: int) -> bool:
    """Whether byte ``at`` lies in a sector piece of the write at [ws, we) that reads as zeros
    throughout: a torn write may have zeroed it, so a bit that one flip would set there (a lost
    piece of one byte whose true value had one bit set) is no evidence of damage."""
    sector = (origin + at) // SECTOR * SECTOR - origin
    a, b = max(sector, ws), min(sector + SECTOR, we)
    return data.count(0, a, b) == b - a


def _merged(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def tail_evidence(data: bytes, pos: int, salt: int = 0, version: int = FORMAT_VERSION,
                  origin: int = 0) -> TailEvidence:
    """Judge the bytes from ``pos`` to the end of ``data`` (the file from byte ``origin`` on),
    where the newest log file's groups stop parsing and no valid group follows.

    A torn write leaves the group short, or whole sectors of it zeroed, garbage or missing.
    Damage is what a torn write cannot leave: one flipped bit (in the group header or in a
    record, found through the CRC's linearity), a record failing its CRC although every
    sector it lies in also holds bytes that verify, or bytes after a complete group (the
    writer writes a group only once the previous one is durable, so that one had been
    acknowledged). Anything else is called torn: kvj cannot tell it from a crash.
    """
    layout = GROUP_HEADERS[version]
    size = len(data) - pos
    if data.count(0, pos) == size:
        return TailEvidence(False, f"{size} zero bytes: space the file system allocated but the crash never filled")
    head = group_header_at(data, pos, salt, version)
    if head is None:
        fixed = _header_flip(data, pos, salt, version, origin)
        if fixed is not None and _zeroed(data, fixed[1], pos, len(data), origin):
            fixed = None  # the header's last sector piece lost, not a flipped bit
        if fixed is None:
            if size < layout.size:
                return TailEvidence(False, f"an incomplete group header ({size} of {layout.size} bytes)")
            return TailEvidence(False, "no valid group header: what a torn write leaves (sectors zeroed, garbage or "
                                "never written)")
        where, _byte, (body_len, count, first_lsn) = fixed
        return TailEvidence(True, f"a group header ({count} records, LSN {first_lsn}..{first_lsn + count - 1}) with "
                            f"one flipped bit at {where}: damage, not a torn write", count, first_lsn)
    body_len, count, first_lsn, _time = head
    what = f"a group of {count} records (LSN {first_lsn}..{first_lsn + count - 1})"
    body, end = pos + layout.size, pos + layout.size + body_len
    if end > len(data):
        return TailEvidence(False, f"{what} shorter than its header declares ({len(data) - body} of {body_len} "
                            "bytes): a write cut short", count, first_lsn)
    after = len(data) - end
    if after and data.count(0, end) != after:
        return TailEvidence(True, f"{what}, whole but invalid, followed by {after} more bytes: a later group was "
                            "written, so this one had been durable: damage, not a torn write", count, first_lsn)
    walk = _records(data, body, end, first_lsn, count)
    if walk is None:
        bit = _repair_chain(data, body, end, first_lsn, count)
        if bit is not None and not _zeroed(data, bit // 8, pos, end, origin):
            return TailEvidence(True, f"{what}, whole, whose records chain once one flipped bit at offset "
                                f"{origin + bit // 8} (bit {bit % 8}) is undone: damage, not a torn write",
                                count, first_lsn)
        return TailEvidence(False, f"{what} whose record headers do not chain: torn sectors", count, first_lsn)
    failing = [r for r in walk if not r[2]]
    if not failing:  # cannot happen for a group that failed to parse; kept total
        return TailEvidence(False, f"{what} that parses", count, first_lsn)
    unverified = _merged([(a, a + 4) for a, _b, _g in failing] + [(a + RECORD_HEADER_SIZE, b) for a, b, _g in failing])
    for lsn_index, record in enumerate(walk):
        start, stop, good = record
        if good:
            continue
        lsn = first_lsn + lsn_index
        stored = CRC.unpack_from(data, start)[0]
        bit = _one_bit(data[start + 4:stop], stored, 0)
        if bit is not None and not _zeroed(data, start + (-1 - bit) // 8 if bit < 0 else start + 4 + bit // 8,
                                           pos, end, origin):
            return TailEvidence(True, f"{what}, whole, whose record LSN {lsn} fails its CRC by one flipped bit at "
                                f"{_bit_at(origin + start + 4, bit, origin + start)}: damage, not a torn write",
                                count, first_lsn)
        if not _tearable(data, record, unverified, pos, end, origin):
            return TailEvidence(True, f"{what}, whole, whose record LSN {lsn} fails its CRC although every sector it "
                                "lies in also holds bytes that verify: damage, not a torn write", count, first_lsn)
    return TailEvidence(False, f"{what}, whole, whose records fail their CRC only where whole sectors may have been "
                        "lost", count, first_lsn)


def _header_flip(data: bytes, pos: int, salt: int, version: int,
                 origin: int) -> Optional[Tuple[str, int, Tuple[int, int, int]]]:
    """(where, the byte's offset in ``data``, (body_len, count, first_lsn)) when one flipped bit,
    in the magic, the CRC or the fields it covers, is all that keeps the group header at ``pos``
    from checking."""
    layout = GROUP_HEADERS[version]
    if pos + layout.size > len(data):
        return None
    head = data[pos:pos + layout.size]
    magic_diff = int.from_bytes(head[:4], "little") ^ int.from_bytes(GROUP_MAGIC, "little")
    stored = CRC.unpack_from(head, 4)[0]
    covered = head[8:]
    if magic_diff:
        if magic_diff & (magic_diff - 1) or crc32c(covered, salt) != stored:
            return None
        fixed = GROUP_MAGIC + head[4:]
        k = magic_diff.bit_length() - 1
        byte = pos + k // 8
        where = f"offset {origin + byte} (bit {k % 8})"
    else:
        bit = _one_bit(covered, stored, salt)
        if bit is None:
            return None
        repaired = bytearray(head)
        byte = pos + (4 + (-1 - bit) // 8 if bit < 0 else 8 + bit // 8)
        repaired[byte - pos] ^= 1 << ((-1 - bit) % 8 if bit < 0 else bit % 8)
        fixed, where = bytes(repaired), _bit_at(origin + pos + 8, bit, origin + pos + 4)
    parsed = group_header_at(fixed, 0, salt, version)
    if parsed is None or parsed[1] == 0:
        return None
    return where, byte, parsed[:3]
