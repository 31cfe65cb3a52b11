"""The replay fast paths against the plain ones they stand for: ``parse_group``'s one-pass walk
against the record walk tail evidence uses (``tail._records``), and ``RecordStream.fold``
against decoding every record and applying it, and the fold of each payload's struct (one
decode) against the fold of its map."""

import gc
import os
import tempfile

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvj.errors import FormatError
from kvj.journal import framing as F
from kvj.journal import records as R
from kvj.journal import tail as T
from kvj.journal.journal import Journal
from kvj.journal.records import RecordType
from kvj.journal.replay import RecordStream
from kvj.journal.state import JournalState


def plain_parse(data, off, path, salt):
    """A group as the spec defines it, through ``_records``: header checks, every record chains
    and passes its CRC, and the records fill the body exactly."""
    head = F.group_header_at(data, off, salt)
    if head is None:
        return None
    body_len, count, first_lsn, time_ns = head
    pos = off + F.GROUP_HEADER_SIZE
    end = pos + body_len
    spans = T._records(data, pos, end, first_lsn, count) if end <= len(data) else None
    if spans is None or not all(good for _a, _b, good in spans):
        return None
    return [(first_lsn + i, F.RECORD_HEADER.unpack_from(data, a)[2], data[a + F.RECORD_HEADER_SIZE:b], path, a,
             time_ns / 1e9) for i, (a, b, _g) in enumerate(spans)], end


records = st.lists(st.tuples(st.integers(0, 9), st.binary(max_size=40)), min_size=0, max_size=6)


@given(records, st.integers(1, 10**6), st.integers(0, 2**32 - 1),
       st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(0, 7))),
       st.one_of(st.none(), st.integers(0, 400)), st.integers(-1, 2))
@settings(max_examples=400, deadline=None)
def test_parse_group_accepts_exactly_what_the_record_walk_accepts(recs, first_lsn, salt, flip, cut, miscount):
    body = b"".join(F.encode_record(t, first_lsn + i, p) for i, (t, p) in enumerate(recs))
    data = bytearray(F.encode_group_header(len(body), max(0, len(recs) + miscount), first_lsn, salt, 5 * 10**9)
                     + body + b"\0" * 8)
    if flip is not None:
        data[flip[0] % len(data)] ^= 1 << flip[1]
    if cut is not None:
        data = data[:cut]
    fast = F.parse_group(bytes(data), 0, "f", salt)
    plain = plain_parse(bytes(data), 0, "f", salt)
    if plain is None:
        assert fast is None
    else:
        assert fast is not None and ([tuple(r) for r in fast[0]], fast[1]) == plain


ops = st.lists(st.tuples(st.sampled_from(["start", "segment", "end", "tokens", "alloc", "free"]),
                         st.integers(0, 4), st.integers(0, 3)), max_size=40)


def append(journal, op, rid_n, n, at):
    rid = f"r{rid_n}"
    if op == "start":
        journal.append(RecordType.START, {"id": rid, "prompt_hash": None, "tokens": [1, 2], "meta": {"n": n}})
    elif op == "segment":
        journal.append(RecordType.SEGMENT, {"id": rid, "seg": n, "key": f"{n:064x}", "tokens": [16 * n, 16 * n + 16],
                                            "layout": {"block": n}, "raw_size": 1, "stored_size": 1,
                                            "digest": f"{n:064x}", "codec": "raw"})
    elif op == "end":
        journal.append(RecordType.END, {"id": rid, "status": "ok"})
    elif op == "tokens":
        journal.append(RecordType.TOKENS, {"id": rid, "at": at, "tokens": [n]})
    elif op == "alloc":
        journal.append(RecordType.ALLOC, {"device": "cuda:0", "addr": n, "size": 4, "tag": rid})
    else:
        journal.append(RecordType.FREE, {"device": "cuda:0", "addr": n})


@given(ops, st.one_of(st.none(), st.integers(0, 45)), st.booleans())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fold_equals_applying_every_decoded_record(sequence, at_lsn, collector_on):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "j")
        with Journal.open(path) as journal:
            for i, (op, rid_n, n) in enumerate(sequence):
                append(journal, op, rid_n, n, i % 3)
            journal.sync()
        plain = JournalState()
        for rec in RecordStream(path):
            if at_lsn is not None and rec.lsn > at_lsn:
                break
            plain.apply(rec.rtype, rec.payload, rec.lsn)
        fast = JournalState()
        (gc.enable if collector_on else gc.disable)()
        try:
            RecordStream(path).fold(fast, at_lsn)
            assert gc.isenabled() == collector_on  # the collector is back as it was
        finally:
            gc.enable()
        assert fast.to_dict() == plain.to_dict()
        assert fast.counts == plain.counts


names = st.sampled_from(["r0", "r1", "r2"])
meta = st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3),
                                                               st.lists(st.integers(0, 3), max_size=2)), max_size=2)
key = st.integers(0, 3).map(lambda n: f"{n:064x}")
payloads = st.one_of(
    st.tuples(st.just(RecordType.START), st.fixed_dictionaries(
        {"id": names, "prompt_hash": st.one_of(st.none(), st.just("h")),
         "tokens": st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=3)), "meta": meta})),
    st.tuples(st.just(RecordType.SEGMENT), st.fixed_dictionaries(
        {"id": names, "seg": st.integers(0, 3), "key": key, "tokens": st.tuples(st.integers(0, 4), st.integers(4, 9)),
         "layout": meta, "raw_size": st.integers(0, 9), "stored_size": st.integers(0, 9),
         "digest": st.one_of(key, st.just("d" * 64)), "codec": st.sampled_from(["raw", "zstd"])})),
    st.tuples(st.just(RecordType.END), st.fixed_dictionaries({"id": names, "status": st.sampled_from(["ok", "x"])})),
    st.tuples(st.just(RecordType.HANDOFF), st.fixed_dictionaries({"id": names, "to": st.just("engine-b")})),
    st.tuples(st.just(RecordType.TOKENS), st.fixed_dictionaries(
        {"id": names, "at": st.integers(0, 4), "tokens": st.lists(st.integers(0, 9), min_size=1, max_size=2)})),
    st.tuples(st.just(RecordType.ALLOC), st.fixed_dictionaries(
        {"device": st.just("cuda:0"), "addr": st.integers(0, 3), "size": st.integers(0, 9), "tag": names})),
    st.tuples(st.just(RecordType.FREE), st.fixed_dictionaries({"device": st.just("cuda:0"), "addr": st.integers(0, 3)})),
    st.tuples(st.just(RecordType.CHECKPOINT), st.fixed_dictionaries(
        {"step": st.integers(0, 9), "keys": st.dictionaries(st.sampled_from(["w", "b"]), key, max_size=2),
         "meta": meta})),
    st.tuples(st.just(RecordType.DELTA), st.fixed_dictionaries(
        {"step": st.integers(0, 9), "base_step": st.integers(0, 9),
         "keys": st.dictionaries(st.sampled_from(["w"]), key, max_size=1), "meta": meta})),
    st.tuples(st.just(RecordType.EPOCH), st.fixed_dictionaries(
        {"epoch": st.integers(0, 3), "recovered_lsn": st.integers(0, 9), "time": st.floats(0, 1e9),
         "manifest": st.one_of(st.none(), st.just("m"))},
        optional={"salvage": st.one_of(st.none(), meta)})),
    st.tuples(st.just(RecordType.REPLY), st.fixed_dictionaries(
        {"id": names, "status": st.sampled_from(["completed", "cancelled"]), "count": st.integers(0, 9),
         "at": st.floats(0, 1e9)},
        optional={"finish_reason": st.just("stop"), "stop_reason": st.one_of(st.integers(0, 9), st.just("\n")),
                  "cached_tokens": st.integers(1, 9), "to": st.just("engine-b")})),
)
#: a record as written: a known type's payload, maybe with a field this kvj does not know
#: (a newer kvj's), or a record of a type it does not know at all
written = st.one_of(
    st.tuples(payloads, st.one_of(st.none(), meta)).map(
        lambda t: (int(t[0][0]), msgspec.msgpack.encode({**t[0][1], **({"future": t[1]} if t[1] is not None else {})}))),
    st.tuples(st.integers(12, 60), meta).map(lambda t: (t[0], msgspec.msgpack.encode(t[1]))),
)


@given(st.lists(written, max_size=30))
@settings(max_examples=300, deadline=None)
def test_struct_fold_equals_the_map_fold(recs):
    """Replay's one-decode fold (each payload decoded once into its type's struct) gives the state
    the fold of the decoded maps gives, record types unknown and fields unknown included."""
    by_map, by_struct = JournalState(), JournalState()
    for lsn, (rtype, data) in enumerate(recs, 1):
        by_map.apply(rtype, R.decode_payload(rtype, data), lsn)
        by_struct.apply(rtype, R.decode_fields(rtype, data), lsn)
    assert by_struct.to_dict() == by_map.to_dict()
    assert by_struct.referenced_keys() == by_map.referenced_keys()


@given(written, st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=3),
       st.one_of(st.none(), st.integers(0, 400)))
@settings(max_examples=1500, deadline=None)
def test_one_decode_refuses_what_the_two_decodes_refuse(rec, changes, cut):
    """A damaged payload (bytes changed, or cut short) is refused by replay's one decode exactly
    when the map decode with its schema check refuses it."""
    rtype, data = rec
    damaged = bytearray(data)
    for at, value in changes:
        if damaged:
            damaged[at % len(damaged)] = value
    damaged = bytes(damaged[:cut] if cut is not None else damaged)
    try:
        R.decode_payload(rtype, damaged)
    except FormatError:
        with pytest.raises(FormatError):
            R.decode_fields(rtype, damaged)
    else:
        R.decode_fields(rtype, damaged)


@given(st.one_of(st.text(alphabet="0123456789abcdefABCDEFg \n", min_size=60, max_size=68), st.text(max_size=70)))
@settings(max_examples=400, deadline=None)
def test_the_key_check_without_a_regex_accepts_what_the_regex_accepts(key):
    from kvj.names import KEY_RE

    fast = len(key) == 64 and not key.strip(R._HEX)
    assert fast == (KEY_RE.fullmatch(key) is not None)


def test_ids_remembered_valid_stay_bounded_and_an_invalid_id_is_never_remembered():
    R._GOOD_IDS.clear()
    for i in range(R._GOOD_IDS_MAX + 10):
        R.decode_fields(RecordType.END, msgspec.msgpack.encode({"id": f"r{i}", "status": "ok"}))
    assert 0 < len(R._GOOD_IDS) <= R._GOOD_IDS_MAX
    bad = msgspec.msgpack.encode({"id": "../x", "status": "ok"})
    for _ in range(2):  # refused both times: the first refusal remembered nothing
        with pytest.raises(FormatError, match="invalid request id"):
            R.decode_fields(RecordType.END, bad)
    assert "../x" not in R._GOOD_IDS


#: In a fresh interpreter (no other test's threads allocating meanwhile): the generations the
#: collections started right after a fold examined.
AFTER_A_FOLD = """
import gc
from kvj.journal.replay import collector_paused
starts = []
gc.collect()
gc.callbacks.append(lambda phase, info: starts.append(info["generation"]) if phase == "start" else None)
with collector_paused():
    kept = [[] for _ in range(20_000)]
more = [[] for _ in range(min(100, gc.get_threshold()[0] - 1))]
print(starts, gc.isenabled())
"""


def test_after_a_fold_the_collector_does_not_walk_what_the_fold_kept():
    """``collector_paused`` moves what the fold made to the oldest generation without a pass:
    the allocations right after it start no collection (else the first walked all of it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", AFTER_A_FOLD], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True"]


def test_a_fold_leaves_objects_the_caller_froze_frozen():
    from kvj.journal.replay import collector_paused

    mine = [[]]  # an object the caller froze (the freeze count itself moves as other threads free objects)
    gc.freeze()
    try:
        assert not any(o is mine for o in gc.get_objects())  # frozen objects are in no generation
        with collector_paused():
            [[] for _ in range(1000)]
        assert not any(o is mine for o in gc.get_objects()), "the fold unfroze what the caller froze"
    finally:
        gc.unfreeze()
