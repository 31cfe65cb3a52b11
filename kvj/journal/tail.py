"""Whether an invalid last commit group is a torn write (the end of the log) or damage (it was
durable once, so its records may have been acknowledged): the judgement every reader of the
end of the log shares (spec: man/kvj-journal.5, THE END OF THE LOG).

A torn write loses whole sectors: at a crash, each 512-byte-aligned piece of the write in flight
(clipped to the write) is on disk as written, or reads as zeros, as garbage, or not at all. This
is the persistence model of SQLite's crash VFS, ALICE and tests/support/crashfs.py. Damage is
what it cannot leave: one flipped bit (found through the CRC's linearity), a record failing its
CRC although every sector it lies in also holds bytes that verify, or bytes after a whole group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from crc32c import crc32c

from kvj.journal.framing import (CRC, FORMAT_VERSION, GROUP_HEADERS, GROUP_MAGIC, MAX_RECORD_PAYLOAD,
                                 RECORD_HEADER, RECORD_HEADER_SIZE, group_header_at)

SECTOR = 512
#: Payloads searched for one flipped bit (a bit at a time in Python: bounded, the rest is
#: judged by sectors alone).
MAX_FLIP_SEARCH = 64 << 10
_POLY = 0x82F63B78  # CRC32C, reflected


@dataclass(frozen=True)
class TailEvidence:
    """What an invalid last group's bytes say: ``damaged`` when a torn write cannot leave them;
    ``records`` and ``first_lsn`` as its header (or a one-bit repair of it) declares, if known."""

    damaged: bool
    why: str
    records: Optional[int] = None
    first_lsn: Optional[int] = None


def tail_evidence(data: bytes, pos: int, salt: int = 0, version: int = FORMAT_VERSION,
                  origin: int = 0) -> TailEvidence:
    """Judge the bytes from ``pos`` to the end of ``data`` (the file from byte ``origin`` on),
    where the newest log file's groups stop parsing and no valid group follows. What kvj cannot
    tell from a crash is called torn."""
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


def _flipped_bit(message: bytes, syndrome: int) -> Optional[int]:
    """The bit (byte * 8 + bit, least significant first) whose flip changes the CRC32C of
    ``message`` by ``syndrome``, or None. CRC is linear: for one length and seed, flipping bit p
    changes the CRC by the CRC (from 0, no final XOR) of a 1 followed by the zero bits after p."""
    c = _POLY
    for p in range(len(message) * 8 - 1, -1, -1):
        if c == syndrome:
            return p
        c = (c >> 1) ^ (_POLY if c & 1 else 0)
    return None


def _one_bit(covered: bytes, stored: int, seed: int) -> Optional[int]:
    """Where one flipped bit explains ``stored`` != CRC32C(``covered``, ``seed``): its index in
    ``covered``, -1 - k for bit k of the stored CRC itself, None when no single bit does."""
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
    """The file-relative offset*8+bit of one bit whose flip, in some record header's length,
    type, flags or LSN, makes the group body chain and every record's CRC hold."""
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
    """Whether a torn write of [ws, we) can have made ``record`` fail: a sector piece of it over
    the record lies wholly in bytes nothing verified (``unverified``, merged), as a lost sector's
    must, or reads as zeros throughout. Offsets are in ``data``; sectors align in the file."""
    start, stop, _good = record
    sector = (origin + start) // SECTOR * SECTOR - origin
    while sector < stop:
        a, b = max(sector, ws), min(sector + SECTOR, we)
        if a < b and (any(u <= a and b <= v for u, v in unverified) or data.count(0, a, b) == b - a):
            return True
        sector += SECTOR
    return False


def _zeroed(data: bytes, at: int, ws: int, we: int, origin: int) -> bool:
    """Whether byte ``at`` lies in a sector piece of the write [ws, we) that reads as zeros: a bit
    one flip would set there may be a lost piece, no evidence of damage."""
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
