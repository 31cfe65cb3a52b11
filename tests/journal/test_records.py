"""One record schema: what the typed methods, ``Journal.append`` and the readers accept is the
same, a bad argument raises at the call and appends nothing, and 0.1.0 journals still read."""

import json
import math
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvj
from kvj.errors import FormatError, InvalidName
from kvj.journal import records
from kvj.journal.journal import Journal
from kvj.journal.records import RecordType

DATA = os.path.join(os.path.dirname(__file__), "data")
KEY = "ab" * 32


def test_a_0_1_0_journal_replays_unchanged(tmp_path):
    path = str(tmp_path / "j")
    shutil.copytree(os.path.join(DATA, "journal-0.1.0"), path)
    expected = json.load(open(os.path.join(DATA, "journal-0.1.0.expected.json")))
    state = kvj.replay(path).to_dict()
    assert [e.pop("time") for e in state["epochs"]] and all(e.pop("time") == "T" for e in expected["epochs"])
    assert json.loads(json.dumps(state, sort_keys=True)) == expected


def holding_itself():
    meta = {}
    meta["me"] = meta
    return meta


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


BAD_CALLS = [
    ("end, status None", lambda j: j.end("r1", status=None, durable=True)),
    ("start, non-string meta key", lambda j: j.start("r1", meta={1: "a"})),
    ("start, nested non-string key", lambda j: j.start("r1", meta={"a": {2: "b"}})),
    ("start, NaN in meta", lambda j: j.start("r1", meta={"x": [math.nan]})),
    ("start, bad id", lambda j: j.start("../r1")),
    ("start, tokens not ints", lambda j: j.start("r1", tokens=[1.5])),
    ("start, bool token", lambda j: j.start("r1", tokens=[True])),
    ("start, negative token", lambda j: j.start("r1", tokens=[-1])),
    ("start, meta not a map", lambda j: j.start("r1", meta=[("a", 1)])),
    ("alloc, string addr", lambda j: j.alloc("cuda:0", "0x10", 1)),
    ("free, bool addr", lambda j: j.free("cuda:0", True)),
    ("checkpoint, bad key", lambda j: j.checkpoint(1, {"w": "not-a-key"})),
    ("delta, float step", lambda j: j.delta(1.5, 1, {"w": KEY})),
    ("epoch, string lsn", lambda j: j.epoch(1, "9")),
    ("append, unknown type", lambda j: j.append(99, {"x": 1})),
    ("append, missing field", lambda j: j.append(RecordType.END, {"id": "r1"})),
    ("append, unknown field", lambda j: j.append(RecordType.END, {"id": "r1", "status": "ok", "stauts": "x"})),
    ("append, unknown field in place of a default", lambda j: j.append(RecordType.EPOCH, {
        "epoch": 1, "recovered_lsn": 0, "time": 1.0, "manifest": None, "salvge": {}})),
    ("append, not a map", lambda j: j.append(RecordType.END, [("id", "r1"), ("status", "ok")])),
    ("start, meta holds itself", lambda j: j.start("r1", meta=holding_itself())),
    ("start, deeply nested meta", lambda j: j.start("r1", meta={"x": nested(10_000)})),
    ("segment, three token positions", lambda j: j.append(RecordType.SEGMENT, {
        "id": "r1", "seg": 0, "key": KEY, "tokens": [0, 8, 16], "layout": {}, "raw_size": 1, "stored_size": 1,
        "digest": "", "codec": "raw"})),
    ("flush, backwards token range", lambda j: j.flush("r1", 0, torch.zeros(4), token_range=(16, 0))),
    ("flush, float segment", lambda j: j.flush("r1", 0.5, torch.zeros(4), token_range=(0, 16))),
    ("flush, bad id", lambda j: j.flush("a/b", 0, torch.zeros(4), token_range=(0, 16))),
    ("flush, infinity in layout", lambda j: j.flush("r1", 0, torch.zeros(4), token_range=(0, 16),
                                                    layout={"x": math.inf})),
]


@pytest.mark.parametrize("what,call", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_a_bad_argument_raises_at_the_call_and_appends_nothing(tmp_path, what, call):
    with Journal.open(tmp_path) as j:
        j.start("ok")
        with pytest.raises(InvalidName if "bad id" in what or "bad key" in what else FormatError):
            call(j)
        assert j.sync() == 1 and list(j.store.keys()) == []  # nothing journaled, nothing stored
        j.end("ok")
    state = kvj.replay(str(tmp_path))
    assert state.last_lsn == 2 and state.requests["ok"].ended


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner,
                                                                max_size=4),
    max_leaves=12)
fields = st.dictionaries(st.sampled_from(["id", "seg", "key", "tokens", "layout", "raw_size", "stored_size",
                                          "digest", "codec", "status", "device", "addr", "size", "tag", "meta",
                                          "prompt_hash", "step", "base_step", "keys", "epoch", "recovered_lsn",
                                          "time", "manifest"]),
                         json_values | st.just("r1") | st.just(KEY) | st.just([0, 16]) | st.just({"w": KEY}),
                         max_size=10)


@settings(max_examples=400, deadline=None)
@given(rtype=st.sampled_from(list(RecordType)), payload=fields)
def test_whatever_encode_accepts_reads_back_identically(rtype, payload):
    """One schema: a payload that ``encode`` accepts is exactly what ``decode_payload`` returns."""
    try:
        data = records.encode(rtype, payload)
    except FormatError:
        return
    assert records.decode_payload(rtype, data) == payload


@settings(max_examples=200, deadline=None)
@given(rtype=st.sampled_from(list(RecordType)), payload=fields)
def test_encode_and_the_typed_struct_agree(rtype, payload):
    """Every field the struct names is required: encode refuses a payload missing any of them."""
    missing = set(records.fields(rtype)) - set(payload)
    if missing:
        with pytest.raises(FormatError):
            records.encode(rtype, payload)


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
maps = st.dictionaries(st.text(max_size=6), plain, max_size=4)
ids = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,20}", fullmatch=True)
keys = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
ints = st.integers(-2**63, 2**64 - 1)
naturals = st.integers(0, 2**63)
VALID = {
    RecordType.START: st.fixed_dictionaries({"id": ids, "prompt_hash": st.none() | st.text(max_size=8),
                                             "tokens": st.none() | st.lists(naturals, max_size=5), "meta": maps}),
    RecordType.SEGMENT: st.fixed_dictionaries({
        "id": ids, "seg": naturals, "key": keys, "tokens": st.tuples(naturals, naturals).map(sorted), "layout": maps,
        "raw_size": ints, "stored_size": ints, "digest": st.text(max_size=8), "codec": st.text(max_size=8)}),
    RecordType.END: st.fixed_dictionaries({"id": ids, "status": st.text(max_size=8)}),
    RecordType.ALLOC: st.fixed_dictionaries({"device": st.text(max_size=8), "addr": ints, "size": ints,
                                             "tag": st.text(max_size=8)}),
    RecordType.FREE: st.fixed_dictionaries({"device": st.text(max_size=8), "addr": ints}),
    RecordType.CHECKPOINT: st.fixed_dictionaries({"step": ints, "keys": st.dictionaries(st.text(max_size=6), keys,
                                                                                         max_size=3), "meta": maps}),
    RecordType.DELTA: st.fixed_dictionaries({"step": ints, "base_step": ints, "keys": st.dictionaries(
        st.text(max_size=6), keys, max_size=3), "meta": maps}),
    RecordType.EPOCH: st.fixed_dictionaries({"epoch": ints, "recovered_lsn": ints,
                                             "time": st.floats(allow_nan=False, allow_infinity=False),
                                             "manifest": st.none() | st.text(max_size=8)}),
    RecordType.TOKENS: st.fixed_dictionaries({"id": ids, "at": naturals, "tokens": st.lists(naturals, min_size=1,
                                                                                             max_size=5)}),
    RecordType.HANDOFF: st.fixed_dictionaries({"id": ids, "to": ids}),
    # the optional fields with values other than their defaults (a default is not written)
    RecordType.REPLY: st.fixed_dictionaries(
        {"id": ids, "status": st.text(max_size=8), "count": naturals,
         "at": st.floats(allow_nan=False, allow_infinity=False)},
        optional={"finish_reason": st.text(max_size=8), "stop_reason": st.text(max_size=8) | naturals,
                  "cached_tokens": st.integers(1, 2**63), "to": ids}),
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), rtype=st.sampled_from(list(RecordType)))
def test_every_valid_payload_is_accepted_and_round_trips(data, rtype):
    payload = data.draw(VALID[rtype])
    assert records.decode_payload(rtype, records.encode(rtype, payload)) == payload


def test_maps_hold_plain_data_only(tmp_path):
    """An extension type or bytes in meta is refused for a new record; read back, an extension
    type is corruption (it could be neither snapshotted nor shown), bytes from 0.1.0 still read."""
    import msgpack

    from kvj.journal.records import decode_payload, encode

    with pytest.raises(FormatError):
        encode(RecordType.CHECKPOINT, {"step": 0, "keys": {}, "meta": {"x": b"raw"}})
    ext = msgpack.packb({"step": 0, "keys": {}, "meta": {"": msgpack.ExtType(0, b"")}})
    with pytest.raises(FormatError, match="not plain data"):
        decode_payload(RecordType.CHECKPOINT, ext)
    old = msgpack.packb({"step": 0, "keys": {}, "meta": {"x": b"raw"}}, use_bin_type=True)
    assert decode_payload(RecordType.CHECKPOINT, old)["meta"] == {"x": b"raw"}


@pytest.mark.parametrize("rtype", [RecordType.START, 99])
def test_a_stored_payload_nested_too_deeply_is_damage_not_a_crash(rtype):
    import msgpack

    head = msgpack.packb({"id": "r1", "prompt_hash": None, "tokens": None})
    data = b"\x84" + head[1:] + msgpack.packb("meta") + b"\x81" + msgpack.packb("x") + b"\x91" * 5000 + b"\x90"
    with pytest.raises(FormatError, match="nested too deeply"):
        records.decode_payload(rtype, data)


def test_fields_with_defaults_may_be_left_out(tmp_path):
    """An epoch without a salvage map (every recovery that salvages nothing) is a valid record."""
    with Journal.open(tmp_path) as j:
        j.epoch(1, 0)
        j.append(RecordType.EPOCH, {"epoch": 2, "recovered_lsn": 1, "time": 1.0, "manifest": None})
    assert [e["epoch"] for e in kvj.replay(str(tmp_path)).epochs] == [1, 2]
