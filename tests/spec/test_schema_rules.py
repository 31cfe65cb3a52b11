"""The record rules of kvj-journal(5), RECORDS, as the independent reader reads them, against
what kvj accepts: request ids, token positions, the segment record's header fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvj.errors import FormatError, InvalidName
from kvj.journal.records import RecordType, encode
from kvj.names import check_request_id
from spec import reader


def kvj_accepts_id(name: str) -> bool:
    try:
        check_request_id(name)
    except InvalidName:
        return False
    return True


@pytest.mark.parametrize("name", ["a", "_a", "a_b", "9", ":a", "@a", "+a", "=a", ".a", "-a", "a" * 256, "a" * 257])
def test_request_ids_the_page_allows_are_the_ids_kvj_allows(name):
    assert kvj_accepts_id(name) == bool(reader.REQUEST_ID.fullmatch(name))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="aZ09._:@+=-/ é\n", min_size=0, max_size=6))
def test_any_request_id(name):
    assert kvj_accepts_id(name) == bool(reader.REQUEST_ID.fullmatch(name))


@pytest.mark.parametrize("tokens", [[0, 1], [-1, 2], [3, 2], [5, 5]])
def test_segment_token_ranges(tokens):
    payload = {"id": "r", "seg": 0, "key": "0" * 64, "tokens": tokens, "layout": {}, "raw_size": 0,
               "stored_size": 0, "digest": "", "codec": "raw"}
    try:
        encode(RecordType.SEGMENT, payload)
        accepted = True
    except FormatError:
        accepted = False
    assert accepted == reader._fits("range", tokens)


@pytest.mark.parametrize("tokens", [[1, 2], [-3], None, []])
def test_start_token_ids(tokens):
    try:
        encode(RecordType.START, {"id": "r", "prompt_hash": None, "tokens": tokens, "meta": {}})
        accepted = True
    except FormatError:
        accepted = False
    assert accepted == (reader._fits("ints", tokens) or tokens is None)
