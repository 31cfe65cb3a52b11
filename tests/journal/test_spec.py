"""The man page is the spec: check that man/kvj-journal.5 and the code agree."""

import re
from pathlib import Path

from kvj.journal import framing, snapshot
from kvj.journal.records import NAMES, SCHEMA, fields

PAGE = (Path(__file__).resolve().parents[2] / "man" / "kvj-journal.5").read_text()


def test_magics_match():
    magics = [bytes.fromhex(m) for m in re.findall(r"magic: ((?:[0-9A-F]{2} ){7}[0-9A-F]{2})", PAGE)]
    assert magics == [framing.FILE_MAGIC, snapshot.SNAP_MAGIC]
    assert '"KVJG"' in PAGE and framing.GROUP_MAGIC == b"KVJG"


def test_header_sizes_match():
    assert "File header (36 bytes)" in PAGE and framing.FILE_HEADER_SIZE == 36
    assert "Commit group (32-byte header" in PAGE and framing.GROUP_HEADER_SIZE == 32
    assert "Record (20-byte header" in PAGE and framing.RECORD_HEADER_SIZE == 20
    assert snapshot.SNAP_HEADER.size == 32
    assert "at most 16 MiB" in PAGE and framing.MAX_RECORD_PAYLOAD == 16 << 20


def test_record_types_and_fields_match():
    documented = dict((int(n), name) for n, name in re.findall(r"^\.B (\d+) (\w+)$", PAGE, re.M))
    assert documented == {int(t): name for t, name in NAMES.items()}
    section = PAGE.split(".SH RECORDS")[1].split(".SH REPLAY")[0]
    for rtype in SCHEMA:
        entry = section.split(f".B {int(rtype)} {NAMES[rtype]}")[1].split("\n.TP")[0]
        for field in fields(rtype):
            assert field in entry, (NAMES[rtype], field)


def test_the_spec_states_one_header_size_and_what_the_salt_guarantees():
    """Issue 9 item 19: the page and framing.py called the file header 32 bytes in one place and
    36 in another, and claimed payload bytes "can never pass" for a group header."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    guarantees = (root / "docs" / "guarantees.md").read_text()  # the README's long form
    for text in (PAGE, framing.__doc__, readme, guarantees):
        sizes = set(re.findall(r"(\d+)-byte file header|File header \((\d+) bytes\)", text))
        assert {int(a or b) for a, b in sizes} <= {framing.FILE_HEADER_SIZE}, sizes
        assert "never pass" not in text
    assert all("2^-32" in text for text in (PAGE, framing.__doc__, readme, guarantees))


def test_the_limits_are_the_ones_enforced():
    """Issue 23: MAX_GROUP_BODY was enforced but not specified."""
    limits = PAGE.split(".SS Limits")[1].split(".SH")[0]
    assert "at most 16 MiB (2^24 bytes)" in limits and framing.MAX_RECORD_PAYLOAD == 1 << 24
    assert "at most\n1 GiB (2^30 bytes)" in limits and framing.MAX_GROUP_BODY == 1 << 30
    assert "(at most 2^30, see Limits)" in PAGE
    assert "2^30 \\- 2^24 \\- 20 bytes already" in limits and framing.RECORD_HEADER_SIZE == 20


def test_versions_and_the_version_1_group_header():
    assert "format version: 2 (1 for files written by kvj 0.1.0" in PAGE and framing.FORMAT_VERSION == 2
    assert framing.READABLE_VERSIONS == (1, 2)
    assert "the group header is 24 bytes" in PAGE and framing.GROUP_HEADERS[1].size == 24
    assert "8\t2\tversion: 1" in PAGE.split(".SH SNAPSHOTS")[1] and snapshot.SNAP_VERSION == 1


def test_the_snapshot_body_names_the_fields_a_snapshot_holds():
    from kvj.journal.state import JournalState, RequestState, SegmentRef

    body = PAGE.split(".SS Snapshot body")[1].split(".SH")[0]
    named = set()
    for line in re.findall(r"^\.BR? (.+)$", body, re.M):
        named |= set(re.findall(r"[a-z_]+", line.replace('", "', " ")))
    cached = JournalState(cache={"c": SegmentRef(0, "k", (0, 32), {}, 0, 0, "k", "", 1)})  # written when not empty
    assert named == set(cached.to_dict(include_ended=False))
    request = body.split(".B requests")[1].split(".TP")[0]
    for name in RequestState("r", None, None, {}, 1).to_dict():
        assert name in request, name
    for name in SegmentRef(0, None, None, {}, 0, 0, None, "", 0).to_dict():
        assert name in request.split("segments is an array")[1], name
