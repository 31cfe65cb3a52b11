"""A damaged last commit group against a torn one, and the recovery modes that decide.

A torn write (a crash while the last group was written: it was never acknowledged) leaves
the group short, or whole sectors of it zeroed, garbage or missing; one flipped bit in a
group that was whole on disk is damage, and the records in it may have been acknowledged.
Checked:

* ``tail.tail_evidence`` never calls a torn write damage, for every way the crash model
  of ``support/crashfs.py`` tears a write (sectors of 512 or 4096 bytes kept, dropped,
  zeroed or garbage; the file cut short), and always calls one flipped bit anywhere in a
  whole last group damage, saying how many records it held (hypothesis);
* through the library and the CLI, after ``kvj record ndjson`` appended 300 records as one
  group: a flipped bit makes ``kvj fsck`` exit 4 (errors left) naming the 300 records, and
  ``kvj recover`` refuse (65, nothing changed), until ``--recovery-mode point-in-time``
  sets the group aside and records the loss; a torn write of the same group is a warning
  (``kvj fsck`` 0) that ``kvj recover`` cuts; absolute-consistency refuses a torn tail.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli_helpers import kvj, tree

from kvj import Journal, RecordType, replay
from kvj.errors import CorruptionError, InvalidArgument
from kvj.journal.framing import (
    FILE_HEADER_SIZE,
    encode_file_header,
    encode_group_header,
    encode_record,
    parse_group,
)
from kvj.journal.reader import list_logs
from kvj.journal.tail import SECTOR, tail_evidence
from kvj.ops.fsck import fsck
from kvj.ops.recover import recover

SALT = 0x5EED5A17
USAGE, DATAERR = 64, 65
FSCK_CLEAN, FSCK_UNCORRECTED, FSCK_USAGE = 0, 4, 16


def log_bytes(rng: random.Random, last_records: int, sizes=(0, 9, 60, 300, 700, 5000)) -> "tuple[bytes, int]":
    """A log file: a header, one earlier group, then a last group of ``last_records`` records
    of random ``sizes`` (some larger than a sector); returns the bytes and where the last group starts."""
    def group(first: int, n: int) -> bytes:
        body = b"".join(encode_record(RecordType.ALLOC, first + i, rng.randbytes(rng.choice(sizes)))
                        for i in range(n))
        return encode_group_header(len(body), n, first, SALT, 1_700_000_000_000_000_000) + body
    head = encode_file_header(1, 1, SALT) + group(1, 3)
    return head + group(4, last_records), len(head)


def torn(data: bytes, start: int, rng: random.Random, sector: int) -> bytes:
    """The file after a crash while the write of ``data[start:]`` was in flight: each piece
    of it between ``sector`` boundaries kept, zeroed, garbage or dropped (a dropped piece
    reads as zeros when a later one was kept, and the file ends after the last piece kept)."""
    out = bytearray(data[:start])
    pieces = []
    at = start
    while at < len(data):
        end = min((at // sector + 1) * sector, len(data))
        pieces.append((at, end))
        at = end
    fates = [rng.choice(["keep", "keep", "zero", "garbage", "drop"]) for _ in pieces]
    if rng.random() < 0.5:  # torn at a boundary: the pieces before it kept, the rest one fate
        cut = rng.randrange(len(pieces))
        fill = rng.choice(["zero", "garbage", "drop"])
        fates = ["keep"] * cut + [fill] * (len(pieces) - cut)
    last = max((i for i, f in enumerate(fates) if f != "drop"), default=-1)
    for i, ((a, b), fate) in enumerate(zip(pieces, fates)):
        if i > last:
            break
        if fate == "keep":
            out += data[a:b]
        elif fate == "garbage":
            out += rng.randbytes(b - a)
        else:
            out += bytes(b - a)
    return bytes(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), records=st.integers(1, 40), sector=st.sampled_from([512, 4096]))
def test_a_torn_write_is_never_called_damage(seed, records, sector):
    rng = random.Random(seed)
    data, start = log_bytes(rng, records)
    crashed = torn(data, start, rng, sector)
    if len(crashed) == start or parse_group(crashed, start, "log", SALT) is not None:
        return  # nothing of the group on disk, or all of it: no tail to judge
    evidence = tail_evidence(crashed, start, SALT)
    assert not evidence.damaged, evidence.why


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), records=st.integers(1, 40), where=st.floats(0, 1, exclude_max=True))
def test_one_flipped_bit_in_a_whole_last_group_is_damage(seed, records, where):
    rng = random.Random(seed)
    data, start = log_bytes(rng, records)
    bit = start * 8 + int(where * (len(data) - start) * 8)
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    piece = max(bit // 8 // SECTOR * SECTOR, start), min((bit // 8 // SECTOR + 1) * SECTOR, len(data))
    if not any(flipped[piece[0]:piece[1]]):
        return  # the flip cleared the one set bit of a sector piece: a torn write that zeroed it leaves the same
    assert parse_group(bytes(flipped), start, "log", SALT) is None  # every bit of a group is checked
    evidence = tail_evidence(bytes(flipped), start, SALT)
    assert evidence.damaged and evidence.records == records and evidence.first_lsn == 4, evidence
    assert f"{records} records" in evidence.why and f"offset {bit // 8} (bit {bit % 8}" in evidence.why


def test_bytes_overwritten_inside_one_sector_are_damage_a_lost_sector_is_not():
    rng = random.Random(7)
    data, start = log_bytes(rng, 30, sizes=(9, 60, 300))  # every record smaller than a sector
    sector = (start + 3000) // SECTOR * SECTOR
    scribbled = bytearray(data)
    scribbled[sector + 200:sector + 204] = b"\xde\xad\xbe\xef"  # a few bytes, not a whole sector
    assert tail_evidence(bytes(scribbled), start, SALT).damaged
    lost = bytearray(data)
    lost[sector:sector + SECTOR] = bytes(SECTOR)
    assert not tail_evidence(bytes(lost), start, SALT).damaged
    after = data + b"\x01" * 10  # bytes after a whole group: it was durable when they were written
    bad = bytearray(after)
    bad[sector:sector + SECTOR] = bytes(SECTOR)
    assert tail_evidence(bytes(bad), start, SALT).damaged
    assert not tail_evidence(data[:start] + bytes(3000), start, SALT).damaged  # preallocated, never written


def test_a_zeroed_sector_over_header_bytes_that_were_zeros_is_torn():
    """The crash suite's seed 107: a sector boundary falls inside the last record's LSN, whose
    high bytes are zeros; the crash zeroes the rest of the write. The header still chains (its
    zeroed bytes read as they were), so the lost piece is not wholly in unverified bytes: a torn
    write all the same, never damage."""
    def build(filler: int) -> "tuple[bytes, int, int]":
        head = encode_file_header(1, 1, SALT)
        body = encode_record(RecordType.ALLOC, 4, bytes(range(256)) + bytes(filler))
        last_at = len(head) + 32 + len(body)  # the group header is 32 bytes
        body += encode_record(RecordType.ALLOC, 5, b"\x07" * 41)
        return head + encode_group_header(len(body), 2, 4, SALT, 1_700_000_000_000_000_000) + body, len(head), last_at
    for filler in range(SECTOR):
        data, start, last_at = build(filler)
        if (last_at + 14) % SECTOR == 0:  # the boundary between the LSN's second and third bytes
            break
    else:
        raise AssertionError("no filler puts a sector boundary inside the last record's LSN")
    boundary = last_at + 14
    assert data[boundary:last_at + 20] == bytes(6)
    crashed = data[:boundary] + bytes(len(data) - boundary)
    evidence = tail_evidence(crashed, start, SALT)
    assert not evidence.damaged, evidence.why


def test_a_lost_sector_piece_of_one_byte_with_one_bit_set_is_torn():
    """The crash suite's seed 1003: the group's last sector piece is one byte, whose true value
    had one bit set; the crash zeroed it. One flipped bit explains the CRC, and so does the lost
    piece: a torn write, never damage."""
    head = encode_file_header(1, 1, SALT)
    for filler in range(SECTOR):
        body = encode_record(RecordType.ALLOC, 4, bytes(range(1, 200)) + b"\x01" * filler + b"\x80")
        data = head + encode_group_header(len(body), 1, 4, SALT, 1_700_000_000_000_000_000) + body
        if len(data) % SECTOR == 1:
            break
    else:
        raise AssertionError("no filler ends the group one byte into a sector")
    crashed = data[:-1] + b"\0"
    evidence = tail_evidence(crashed, len(head), SALT)
    assert not evidence.damaged, evidence.why
    flipped = bytearray(data)
    flipped[-2] ^= 0x10  # a bit flipped where the sector piece still holds bytes: damage
    assert tail_evidence(bytes(flipped), len(head), SALT).damaged


# -- through the library and the CLI ------------------------------------------------------

BATCH = 300


@pytest.fixture
def journal(tmp_path):
    """A journal whose last commit group holds the 300 records of one ``kvj record ndjson``."""
    path = tmp_path / "j"
    with Journal.open(path) as j:
        j.start("before", tokens=[1, 2, 3])
        j.sync()
    lines = "".join(json.dumps({"type": "alloc", "device": "cuda:0", "addr": i, "size": 4096, "tag": f"b{i}"}) + "\n"
                    for i in range(BATCH))
    proc = kvj("record", "ndjson", "-j", path, input=lines)
    assert proc.returncode == 0, proc.stderr
    log = list_logs(str(path))[-1]
    with open(log, "rb") as f:
        data = f.read()
    start = data.rfind(b"KVJG")
    assert start > FILE_HEADER_SIZE and parse_group(data, start, log, _salt(data)) is not None
    assert len(parse_group(data, start, log, _salt(data))[0]) == BATCH, "the batch is not one commit group"
    return path, log, start, len(data)


def _salt(data: bytes) -> int:
    return int.from_bytes(data[28:32], "little")


def flip(path: str, offset: int, bit: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def test_a_flipped_bit_in_the_last_group_is_an_error_until_point_in_time_recovery_accepts_the_loss(journal):
    path, log, start, size = journal
    flip(log, start + (size - start) // 2)
    with pytest.raises(CorruptionError, match="300 records"):
        replay(str(path))
    with pytest.raises(CorruptionError, match="damaged last commit group"):
        Journal.open(path)  # a restarted writer refuses it too, cutting nothing
    result = fsck(str(path))
    (finding,) = result.errors
    assert result.exit_code == FSCK_UNCORRECTED and finding.kind == "damaged-tail" and finding.offset == start
    assert "300 records" in finding.message and "one flipped bit" in finding.message
    assert fsck(str(path), repair=True).exit_code == FSCK_UNCORRECTED  # repair leaves it: records may be acked
    assert os.path.getsize(log) == size
    warned = fsck(str(path), mode="point-in-time")
    assert warned.exit_code == FSCK_CLEAN and [f.kind for f in warned.findings if f.severity == "warning"] == \
        ["damaged-tail"]
    before = tree(path)
    with pytest.raises(CorruptionError, match="300 records"):
        recover(str(path))
    assert tree(path) == before
    result = recover(str(path), mode="point-in-time")
    salvage = result.manifest["salvage"]
    assert salvage["kept_lsn"] == 1 and salvage["cut_offset"] == start
    assert [(d["kind"], d["records"]) for d in salvage["damage"]] == [("damaged-tail", BATCH)]
    (kept,) = salvage["set_aside_to"]
    assert os.path.getsize(kept) == size - start  # the damaged group, kept in torn/
    state = replay(str(path))
    assert state.epochs[-1]["salvage"]["id"] == salvage["id"] and not state.allocations
    assert state.epochs[-1]["lsn"] == 2  # the log goes on right after the last record kept
    assert fsck(str(path)).exit_code == FSCK_CLEAN


def test_a_torn_write_of_the_last_group_is_the_end_of_the_log(journal):
    path, log, start, size = journal
    with open(log, "r+b") as f:
        f.truncate(size - 100)  # the group's last bytes never reached the disk
    state = replay(str(path))
    assert state.last_lsn == 1 and state.tail["records"] == BATCH and not state.tail["damaged"]
    result = fsck(str(path))
    assert result.exit_code == FSCK_CLEAN and [f.kind for f in result.findings if f.severity == "warning"] == \
        ["torn-tail"]
    assert "shorter than its header declares" in result.findings[0].message
    strict = fsck(str(path), mode="absolute-consistency")
    assert strict.exit_code == FSCK_UNCORRECTED and [f.kind for f in strict.errors] == ["torn-tail"]
    before = tree(path)
    with pytest.raises(CorruptionError, match="strict mode"):
        recover(str(path), mode="absolute-consistency")
    assert tree(path) == before
    done = recover(str(path))
    assert done.manifest["torn_tail"]["records"] == BATCH and os.path.getsize(log) == start


def test_an_unknown_recovery_mode_is_refused():
    with pytest.raises(InvalidArgument, match="tolerate-torn-tail"):
        fsck(".", mode="skip-any-corrupted")
    with pytest.raises(InvalidArgument, match="point-in-time"):
        recover(".", mode="skip-any-corrupted")


def test_through_the_cli_flipped_bit_against_torn_write(journal, tmp_path):
    path, log, start, size = journal
    torn_copy = tmp_path / "torn"
    shutil.copytree(path, torn_copy)
    flip(log, size - 7)  # in the last record
    proc = kvj("fsck", "-j", path)
    assert proc.returncode == FSCK_UNCORRECTED, proc.stdout + proc.stderr
    assert "error: damaged last commit group" in proc.stdout and "300 records" in proc.stdout
    before = tree(path)
    proc = kvj("recover", "-j", path)
    assert proc.returncode == DATAERR and "300 records" in proc.stderr and "nothing was changed" in proc.stderr
    assert tree(path) == before
    assert kvj("fsck", "-j", path, "--recovery-mode", "point-in-time").returncode == FSCK_CLEAN
    assert kvj("fsck", "-j", path, "--recovery-mode", "bogus").returncode == FSCK_USAGE
    assert kvj("recover", "-j", path, "--recovery-mode", "bogus").returncode == USAGE
    proc = kvj("recover", "-j", path, "--recovery-mode", "point-in-time", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["manifest"]["salvage"]["damage"][0]["records"] == BATCH
    assert kvj("fsck", "-j", path).returncode == FSCK_CLEAN

    torn_log = os.path.join(torn_copy, os.path.basename(log))
    with open(torn_log, "r+b") as f:  # a crash while writing: the group's last sector reads as zeros
        f.seek((size - 1) // SECTOR * SECTOR)
        f.write(bytes(size - (size - 1) // SECTOR * SECTOR))
    proc = kvj("fsck", "-j", torn_copy)
    assert proc.returncode == FSCK_CLEAN and "warning: torn tail" in proc.stdout, proc.stdout
    proc = kvj("fsck", "-j", torn_copy, "--recovery-mode", "absolute-consistency")
    assert proc.returncode == FSCK_UNCORRECTED and "error: torn tail" in proc.stdout, proc.stdout
    before = tree(torn_copy)
    assert kvj("recover", "-j", torn_copy, "--recovery-mode", "absolute-consistency").returncode == DATAERR
    assert tree(torn_copy) == before
    proc = kvj("recover", "-j", torn_copy)
    assert proc.returncode == 0 and "torn tail:" in proc.stdout, proc.stdout + proc.stderr
    assert os.path.getsize(torn_log) == start
