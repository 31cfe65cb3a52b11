"""Unit tests of the journal framing (man/kvj-journal.5): headers, records, groups."""

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from kvj.journal import framing as F


def group(records, first_lsn=1):
    body = b"".join(F.encode_record(t, first_lsn + i, p) for i, (t, p) in enumerate(records))
    return F.encode_group_header(len(body), len(records), first_lsn) + body


def test_sizes_match_the_spec():
    assert (F.FILE_HEADER_SIZE, F.GROUP_HEADER_SIZE, F.RECORD_HEADER_SIZE) == (36, 32, 20)
    assert F.FILE_MAGIC == b"\x89KVJLOG\n"


def test_file_header_round_trip_and_checks():
    head = F.encode_file_header(7, 1234, 0xDEADBEEF)
    assert F.decode_file_header(head) == F.FileHeader(F.FORMAT_VERSION, 7, 1234, 0xDEADBEEF)
    for i in range(len(head)):
        bad = bytearray(head)
        bad[i] ^= 0x40
        assert F.decode_file_header(bytes(bad)) is None, i
    assert F.decode_file_header(head[:-1]) is None
    assert F.decode_file_header(b"\0" * 36) is None


def test_group_headers_only_parse_under_their_files_salt():
    body = F.encode_record(1, 1, b"x")
    data = F.encode_group_header(len(body), 1, 1, salt=12345) + body
    assert F.parse_group(data, 0, "f", 12345) is not None
    assert F.parse_group(data, 0, "f", 12346) is None
    assert F.parse_group(data, 0, "f") is None
    assert F.later_group_exists(b"junk" + data, 0, 0, 999) is None
    assert F.later_group_exists(b"junk" + data, 0, 0, 12345) == 4


def test_a_bad_header_is_a_torn_creation_only_on_a_header_sized_file():
    assert F.header_torn(b"\x89KVJ") and F.header_torn(bytes(F.FILE_HEADER_SIZE))
    assert not F.header_torn(bytes(F.FILE_HEADER_SIZE + 1))


def test_record_layout_is_little_endian_with_crc_over_header_and_payload():
    rec = F.encode_record(3, 0x0102030405060708, b"abc")
    crc, length, rtype, flags, lsn = struct.unpack_from("<IIHHQ", rec)
    assert (length, rtype, flags, lsn) == (3, 3, 0, 0x0102030405060708)
    from crc32c import crc32c
    assert crc == crc32c(rec[4:])
    assert rec[20:] == b"abc"


def test_group_parses_and_every_flipped_bit_is_caught():
    data = group([(1, b"hello"), (2, b""), (4, b"x" * 300)], first_lsn=10)
    records, end = F.parse_group(data, 0, "f")
    assert end == len(data)
    assert [(r.lsn, r.rtype, r.payload) for r in records] == [(10, 1, b"hello"), (11, 2, b""), (12, 4, b"x" * 300)]
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= bit
            assert F.parse_group(bytes(bad), 0, "f") is None, (i, bit)


def test_group_is_all_or_nothing_when_truncated():
    data = group([(1, b"a" * 50), (1, b"b" * 50)])
    for cut in range(len(data)):
        assert F.parse_group(data[:cut], 0, "f") is None


def test_zero_filled_space_is_never_a_group():
    assert F.parse_group(b"\0" * 4096, 0, "f") is None
    assert F.later_group_exists(b"\0" * 4096, 0, 0) is None


def test_lsn_out_of_sequence_inside_a_group_is_rejected():
    body = F.encode_record(1, 5, b"a") + F.encode_record(1, 7, b"b")
    data = F.encode_group_header(len(body), 2, 5) + body
    assert F.parse_group(data, 0, "f") is None


def test_type_zero_is_reserved():
    body = F.encode_record(0, 1, b"a")
    assert F.parse_group(F.encode_group_header(len(body), 1, 1) + body, 0, "f") is None


def test_huge_declared_lengths_are_rejected_without_allocating():
    head = F.encode_group_header(F.MAX_GROUP_BODY + 1, 1, 1)
    assert F.parse_group(head + b"\0" * 64, 0, "f") is None
    tail = struct.pack("<IHHQ", 0xFFFFFFFF, 1, 0, 1)
    body = b"\0\0\0\0" + tail
    assert F.parse_group(F.encode_group_header(len(body), 1, 1) + body, 0, "f") is None


def test_later_group_exists_finds_only_valid_later_groups():
    first = group([(1, b"a")], 1)
    second = group([(1, b"b")], 2)
    damaged = bytearray(first)
    damaged[-1] ^= 1
    data = bytes(damaged) + second
    assert F.later_group_exists(data, 0, 1) == len(first)
    assert F.later_group_exists(data, 0, 2) is None  # LSNs not after the damage: not proof


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 65535), st.binary(max_size=200)), min_size=1, max_size=20),
       st.integers(1, 2**62))
def test_any_group_round_trips(records, first_lsn):
    data = group(records, first_lsn)
    parsed, end = F.parse_group(data + b"trailing", 0, "f")
    assert end == len(data)
    assert [(r.rtype, r.payload) for r in parsed] == records
    assert [r.lsn for r in parsed] == list(range(first_lsn, first_lsn + len(records)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.integers(0, 100))
def test_arbitrary_bytes_never_raise(blob, off):
    result = F.parse_group(blob, min(off, len(blob)), "f")
    assert result is None or result[1] <= len(blob)
    F.decode_file_header(blob)
