"""Hostile input: fuzzed decoders, path traversal, pickle, memory bounds, permissions, CLI.

Every decoder that reads bytes from disk (log framing, record payloads, snapshots,
segments, the legacy JSON-lines importer) gets arbitrary bytes and structured near-valid
input (valid CRCs around hostile content, so the fuzzer gets past the checksums). The only
acceptable failures are ``KvjError`` subclasses; anything replay accepts must also fold,
serialise into a snapshot and read back. Request ids and segment keys can never name a
path outside the journal. No code path unpickles. Declared lengths never drive
allocations past the input's size. Files are owner-only.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List

import msgpack
import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvj.errors import InvalidName, KvjError
from kvj.journal import framing as F
from kvj.journal.journal import Journal
from kvj.journal.legacy import LegacyScan
from kvj.journal.records import RecordType, decode_payload
from kvj.journal.replay import RecordStream, replay
from kvj.journal.snapshot import SNAP_HEADER, SNAP_MAGIC, SNAP_VERSION, decode_snapshot, encode_snapshot, snapshot_name
from kvj.names import check_key, check_request_id

REPO = Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
FUZZ_SLOW = settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                              HealthCheck.function_scoped_fixture])


# -- helpers ----------------------------------------------------------------------------------

def log_file(groups: List[bytes], base_lsn: int = 1) -> bytes:
    return F.encode_file_header(1, base_lsn, 0) + b"".join(groups)


def group(records: List[bytes], first_lsn: int) -> bytes:
    body = b"".join(records)
    return F.encode_group_header(len(body), len(records), first_lsn) + body


def write_journal(directory: Path, data: bytes) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "0000000000000001.log").write_bytes(data)
    return str(directory)


def fresh_dir(tmp_path: Path, name: str = "j") -> Path:
    """A new directory per hypothesis example (tmp_path is shared by all examples)."""
    fresh_dir.n += 1  # type: ignore[attr-defined]
    return tmp_path / f"{name}-{fresh_dir.n}"  # type: ignore[attr-defined]


fresh_dir.n = 0  # type: ignore[attr-defined]


def replay_or_clean_error(path: str) -> None:
    """Replay ``path``: it must succeed or raise a KvjError. What it accepts must also
    serialise into a snapshot and decode back to the same state (compaction must not choke)."""
    try:
        state = replay(path)
        records = list(RecordStream(path, after_lsn=state.snapshot_lsn))
    except KvjError:
        return
    assert len(records) == state.last_lsn - state.snapshot_lsn or not records
    state.to_dict()
    state.referenced_keys()
    [r.resume_position for r in state.requests.values()]
    blob = encode_snapshot(state)
    back = decode_snapshot(blob, "fuzz.snap")
    assert back.to_dict(include_ended=False)["requests"] == state.to_dict(include_ended=False)["requests"]


# msgpack-representable values, including the awkward ones (bytes, ext types, big ints, NaN)
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 64) + 1, (1 << 64) - 1), st.floats(),
                 st.text(max_size=20), st.binary(max_size=20),
                 st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)))
values = st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                      max_leaves=12)


@st.composite
def near_valid_payload(draw) -> Dict[str, Any]:
    """A payload with the right field names for some record type but hostile values."""
    rtype = draw(st.sampled_from(list(RecordType)))
    from kvj.journal.records import fields
    payload = {}
    for name in fields(rtype):
        if draw(st.booleans()):
            payload[name] = draw(values)
        else:
            payload[name] = draw(st.sampled_from(["req-1", 0, 5, [0, 16], {}, None, "a" * 64, "../../etc/passwd"]))
    if draw(st.booleans()):
        payload[draw(st.text(max_size=5))] = draw(values)
    return {"rtype": int(rtype), "payload": payload}


def pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return msgpack.packb(None)


# -- record decoder ---------------------------------------------------------------------------

def _framing_arbitrary(data: bytes, off: int) -> None:
    F.decode_file_header(data)
    F.group_header_at(data, off % (len(data) + 1))
    parsed = F.parse_group(data, off % (len(data) + 1), "fuzz")
    assert parsed is None or parsed[1] <= len(data)
    F.later_group_exists(data, off % (len(data) + 1) - 1, 0)


@FUZZ
@given(data=st.binary(max_size=2048), off=st.integers(0, 4096))
def test_framing_on_arbitrary_bytes(data, off):
    """parse_group and friends return None on garbage; they never raise."""
    _framing_arbitrary(data, off)


@FUZZ
@given(tail=st.binary(max_size=1024), magic_at=st.lists(st.integers(0, 1023), max_size=3))
def test_reader_on_a_log_of_garbage(tmp_path, tail, magic_at):
    """A log file with a valid header followed by garbage (sprinkled with group magics)."""
    tail = bytearray(tail)
    for pos in magic_at:
        tail[pos:pos + 4] = F.GROUP_MAGIC
    path = write_journal(fresh_dir(tmp_path), log_file([bytes(tail)]))
    replay_or_clean_error(path)


@FUZZ
@given(records=st.lists(st.tuples(st.integers(0, 0xFFFF), st.binary(max_size=200)), min_size=1, max_size=5))
def test_valid_frames_around_arbitrary_payloads(tmp_path, records):
    """Records with correct CRCs and arbitrary payload bytes and types: clean errors only."""
    frames = [F.encode_record(rtype, 1 + i, payload) for i, (rtype, payload) in enumerate(records)]
    path = write_journal(fresh_dir(tmp_path), log_file([group(frames, 1)]))
    replay_or_clean_error(path)


def _near_valid_records(tmp_path: Path, items: List[Dict[str, Any]]) -> None:
    frames = [F.encode_record(it["rtype"], 1 + i, pack(it["payload"])) for i, it in enumerate(items)]
    path = write_journal(fresh_dir(tmp_path), log_file([group(frames, 1)]))
    replay_or_clean_error(path)
    for it in items:
        try:
            decode_payload(it["rtype"], pack(it["payload"]))
        except KvjError:
            pass


@FUZZ
@given(items=st.lists(near_valid_payload(), min_size=1, max_size=6))
def test_valid_frames_around_hostile_payloads(tmp_path, items):
    """Well-framed records whose payloads have the right fields with hostile values."""
    _near_valid_records(tmp_path, items)


@pytest.mark.slow
@FUZZ_SLOW
@given(items=st.lists(near_valid_payload(), min_size=1, max_size=6))
def test_valid_frames_around_hostile_payloads_full(tmp_path, items):
    _near_valid_records(tmp_path, items)


def test_huge_declared_lengths_allocate_nothing(tmp_path):
    """A group header declaring a 1 GiB body and 4 billion records, a record declaring
    16 MiB, a snapshot declaring 2 GiB: all rejected from a few bytes of input, in a
    process whose address space is capped (so an allocation from a declared length fails)."""
    j1 = tmp_path / "group"
    j1.mkdir()
    head = F.GROUP_HEADER.pack(F.GROUP_MAGIC, 0, F.MAX_GROUP_BODY, 0xFFFFFFFF, 1, 0)
    head = head[:4] + struct.pack("<I", crc32c(head[8:])) + head[8:]
    (j1 / "0000000000000001.log").write_bytes(log_file([head + b"\0" * 64]))
    j2 = tmp_path / "record"
    j2.mkdir()
    rec = struct.pack("<IIHHQ", 0, F.MAX_RECORD_PAYLOAD, 1, 0, 1)
    (j2 / "0000000000000001.log").write_bytes(log_file([F.encode_group_header(len(rec), 1, 1) + rec]))
    j3 = tmp_path / "snap"
    j3.mkdir()
    snap_head = SNAP_HEADER.pack(SNAP_MAGIC, SNAP_VERSION, 0, 5, 1 << 31, 0)
    (j3 / snapshot_name(5)).write_bytes(snap_head + b"\0" * 16)
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        import kvj
        from kvj.errors import KvjError
        for path in sys.argv[1:]:
            try:
                state = kvj.replay(path)
                print(path, "ok", state.last_lsn, state.tail is not None)
            except KvjError as exc:
                print(path, "error", type(exc).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script, str(j1), str(j2), str(j3)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout
    assert lines[0].endswith("ok 0 True") and lines[1].endswith("ok 0 True"), lines  # torn tails, not trusted
    assert lines[2].endswith("error CorruptionError"), lines


# -- snapshots --------------------------------------------------------------------------------

def snapshot_bytes(body: bytes, lsn: int) -> bytes:
    head = SNAP_HEADER.pack(SNAP_MAGIC, SNAP_VERSION, 0, lsn, len(body), 0)[:-4]
    return head + struct.pack("<I", crc32c(body, crc32c(head))) + body


@FUZZ
@given(data=st.binary(max_size=512))
def test_snapshot_decoder_on_arbitrary_bytes(data):
    try:
        decode_snapshot(data, "fuzz.snap")
    except KvjError:
        pass


@st.composite
def hostile_state(draw) -> Dict[str, Any]:
    """A snapshot body: the real keys, each with a hostile or a plausible value."""
    lsn = draw(st.integers(0, 100))
    body: Dict[str, Any] = {"last_lsn": lsn}
    plausible = {"requests": [{"id": "r", "start_lsn": 1, "segments": [{"seg": 0, "lsn": 1, "tokens": [0, 4]}]}],
                 "allocations": {"cuda:0": [{"addr": 1, "size": 2, "tag": "", "lsn": 1}]},
                 "checkpoint": {"step": 1, "keys": {}, "meta": {}, "lsn": 1}, "deltas": [], "epochs": [],
                 "counts": {}, "warnings": [], "first_lsn": 1, "snapshot_lsn": 0, "ended_compacted": 0}
    for key, value in plausible.items():
        choice = draw(st.integers(0, 2))
        if choice == 1:
            body[key] = value
        elif choice == 2:
            body[key] = draw(values)
    return body


@FUZZ
@given(body=hostile_state(), records=st.lists(near_valid_payload(), max_size=3))
def test_snapshot_with_valid_crc_and_hostile_body(tmp_path, body, records):
    """A snapshot written by a buggy or hostile tool (valid CRC, odd body), then records."""
    _snapshot_case(tmp_path, body, records)


@pytest.mark.slow
@FUZZ_SLOW
@given(body=hostile_state(), records=st.lists(near_valid_payload(), max_size=3))
def test_snapshot_with_valid_crc_and_hostile_body_full(tmp_path, body, records):
    _snapshot_case(tmp_path, body, records)


def _snapshot_case(tmp_path: Path, body: Dict[str, Any], records: List[Dict[str, Any]]) -> None:
    d = fresh_dir(tmp_path)
    d.mkdir()
    lsn = body["last_lsn"]
    (d / snapshot_name(lsn)).write_bytes(snapshot_bytes(pack(body), lsn))
    frames = [F.encode_record(it["rtype"], lsn + 1 + i, pack(it["payload"])) for i, it in enumerate(records)]
    (d / "0000000000000001.log").write_bytes(log_file([group(frames, lsn + 1)] if frames else [], lsn + 1))
    replay_or_clean_error(str(d))


@pytest.mark.parametrize("body", [{"last_lsn": 3, "checkpoint": 1}, {"last_lsn": 3, "ended_compacted": None},
                                  {"last_lsn": 3, "counts": [msgpack.ExtType(0, b"")]},  # -> {0: b""}: int key
                                  {"last_lsn": 3, "requests": [{"id": "r", "start_lsn": 1, "segments": [
                                      {"seg": 0, "lsn": 1, "tokens": 7}]}]}])
def test_snapshot_body_with_wrong_types_is_corruption(tmp_path, body):
    """Regression (fixed in kvj/snapshot.py): a valid-CRC snapshot whose fields have the
    wrong types decoded 'successfully' and crashed later with a TypeError (in
    referenced_keys, to_dict: i.e. in fsck, compaction, the CLI), or produced a state whose
    next snapshot could not be read back (an int map key). Now CorruptionError."""
    from kvj.errors import CorruptionError
    with pytest.raises(CorruptionError):
        decode_snapshot(snapshot_bytes(pack(body), 3), "x.snap")


# -- segments ---------------------------------------------------------------------------------

def make_segment(tensor, codec: str = "zstd", layout=None) -> bytes:
    from kvj.segments import segfile as seg
    from kvj.segments import tensors
    from kvj.segments.codecs import auto
    raw = tensors.tensor_bytes(tensor)
    name = tensors.dtype_name(tensor.dtype)
    digest = seg.compute_digest(raw, name, tensor.shape, seg.canonical_layout(layout))
    pipeline = auto.choose(raw, seg.element(name), tuple(tensor.shape), codec=codec)
    enc = seg.encode(raw, dtype=name, shape=tensor.shape, layout=layout, digest=digest, pipeline=pipeline)
    return b"".join(bytes(p) for p in enc.parts())


def resign_segment(data: bytes, header_map: Dict[str, Any], body: bytes = None) -> bytes:
    """Rebuild a segment file around a (modified) header map with a valid header CRC."""
    from kvj.segments import segfile as seg
    hlen, _crc, _end = seg.TRAILER.unpack(data[-seg.TRAILER.size:])
    pre = data[:seg.PREAMBLE.size]
    if body is None:
        body = data[seg.PREAMBLE.size:len(data) - seg.TRAILER.size - hlen]
    head = pack(header_map)
    return pre + body + head + seg.TRAILER.pack(len(head), crc32c(head, crc32c(pre)), seg.END_MAGIC)


def header_map(data: bytes) -> Dict[str, Any]:
    from kvj.segments import segfile as seg
    hlen = seg.TRAILER.unpack(data[-seg.TRAILER.size:])[0]
    return msgpack.unpackb(data[len(data) - seg.TRAILER.size - hlen:-seg.TRAILER.size], raw=False)


@pytest.fixture(scope="module")
def sample_segments():
    import torch
    g = torch.Generator().manual_seed(3)
    kv = torch.randn((1, 8, 2, 16), generator=g).repeat(4, 1, 1, 1)
    tensors = [torch.randn((8, 64), generator=g).to(torch.bfloat16), kv,
               torch.randint(0, 100, (300,), generator=g, dtype=torch.int32)]
    return [(t, make_segment(t, codec)) for t, codec in zip(tensors, ["byteplane", "zstd", "raw"])]


def decode_clean(data: bytes, want=None) -> None:
    """Decode a segment: a KvjError, or (when ``want`` is given) exactly ``want``; and the check
    that decodes a chunk at a time (segfile.verify) refuses exactly what decoding refuses."""
    import torch

    from kvj.segments import segfile, tensors
    try:
        segfile.check_stored(data, "fuzz")
        header, tensor = tensors.decode_into(data, name="fuzz")
    except KvjError:
        with pytest.raises(KvjError):
            segfile.verify(data, name="fuzz")
        return
    assert segfile.verify(data, name="fuzz") == header
    if want is not None:
        assert tensor.dtype == want.dtype and tensor.shape == want.shape
        assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), "a wrong tensor decoded cleanly"


@FUZZ
@given(data=st.binary(max_size=1024))
def test_segment_decoder_on_arbitrary_bytes(data):
    decode_clean(data)


@FUZZ
@given(which=st.integers(0, 2), edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                                                min_size=1, max_size=4))
def test_segment_decoder_on_damaged_segments(sample_segments, which, edits):
    tensor, data = sample_segments[which]
    data = bytearray(data)
    for pos, value in edits:
        data[pos % len(data)] = value
    decode_clean(bytes(data), tensor)


@FUZZ
@given(which=st.integers(0, 2), field=st.sampled_from(
    ["dtype", "shape", "raw_size", "chunk_size", "payload_size", "chunks", "stored_size", "codec", "params",
     "digest", "digest_alg", "layout", "dedup"]), value=values)
def test_segment_header_with_valid_crc_and_hostile_field(sample_segments, which, field, value):
    """Each header field replaced by an arbitrary value, header CRC recomputed."""
    tensor, data = sample_segments[which]
    m = header_map(data)
    if field == "layout" and not is_json(value):
        value = None  # covered by test_segment_layout_that_is_not_json_is_a_clean_error
    m[field] = value
    decode_clean(resign_segment(data, m), tensor)


def is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("layout", [{"k": b"bytes"}, {"k": float("nan")}, {"k": msgpack.ExtType(1, b"x")}])
def test_segment_layout_that_is_not_json_is_a_clean_error(sample_segments, layout):
    """Found by test_segment_header_with_valid_crc_and_hostile_field."""
    tensor, data = sample_segments[0]
    m = header_map(data)
    m["layout"] = layout
    decode_clean(resign_segment(data, m), tensor)


def test_hostile_segment_declaring_a_huge_size_is_refused_cheaply(tmp_path):
    """A 1 MiB file whose valid-CRC header declares 16 GiB of zeros (256 chunks of a
    64 MiB zstd frame each): reading it must fail with a KvjError without allocating the
    declared size. Run in a process capped at 2 GiB of address space."""
    import zstandard

    from kvj.segments import segfile as seg
    from kvj.segments.store import SegmentStore
    frame = zstandard.ZstdCompressor(level=3).compress(bytes(seg.MAX_CHUNK_SIZE))
    n = 256
    raw_size = n * seg.MAX_CHUNK_SIZE
    body = frame * n
    digest = bytes(range(32))
    m = {"dtype": "uint8", "shape": [raw_size], "layout": None, "codec": "zstd", "params": {"level": 3, "long": False},
         "raw_size": raw_size, "chunk_size": seg.MAX_CHUNK_SIZE, "payload_size": raw_size,
         "chunks": [[len(frame), crc32c(frame)]] * n, "stored_size": len(body), "digest_alg": seg.DIGEST_ALG,
         "digest": digest, "dedup": None}
    pre = seg.PREAMBLE.pack(seg.MAGIC, seg.VERSION, 0, 0)
    head = msgpack.packb(m, use_bin_type=True)
    data = pre + body + head + seg.TRAILER.pack(len(head), crc32c(head, crc32c(pre)), seg.END_MAGIC)
    store_root = tmp_path / "store"
    SegmentStore(str(store_root)).close()
    key = digest.hex()
    target = store_root / "objects" / key[:2] / f"{key}.kvjseg"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    script = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from kvj.segments.store import SegmentStore
        from kvj.errors import KvjError
        store = SegmentStore(sys.argv[1], threads=2)
        try:
            store.get(sys.argv[2])
            print("returned")
        except KvjError as exc:
            print("clean", type(exc).__name__)
        except MemoryError as exc:
            print("memoryerror", type(exc).__name__)
        print("maxrss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script, str(store_root), key], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("clean"), f"{len(data)}-byte segment declaring {raw_size} bytes: {out.stdout}"


# -- legacy importer --------------------------------------------------------------------------

def legacy_scan(path: Path) -> None:
    try:
        for _ in LegacyScan(str(path)):
            pass
    except KvjError:
        pass


@FUZZ
@given(data=st.binary(max_size=2048))
def test_legacy_importer_on_arbitrary_bytes(tmp_path, data):
    p = fresh_dir(tmp_path).with_suffix(".jsonl")
    p.write_bytes(data)
    legacy_scan(p)


legacy_obj = st.fixed_dictionaries({"op": st.sampled_from(["start", "seg_flush", "end", "x"])},
                                   optional={"id": values, "prompt_hash": values, "seg": values, "ptr": values,
                                             "size": values, "status": values})


@FUZZ
@given(lines=st.lists(legacy_obj, max_size=6))
def test_legacy_importer_on_hostile_objects(tmp_path, lines):
    """Well-formed JSON lines with hostile field values: clean errors, and what is accepted
    folds, serialises into a snapshot and reads back."""
    def enc(o):
        try:
            return json.dumps(o, default=lambda v: v.hex() if isinstance(v, bytes) else str(v))
        except (ValueError, TypeError):
            return "{}"
    p = fresh_dir(tmp_path).with_suffix(".jsonl")
    p.write_text("".join(enc(o) + "\n" for o in lines))
    replay_or_clean_error(str(p))


@pytest.mark.parametrize("line", [
    "[" * 100_000 + "]" * 100_000,  # deep nesting: RecursionError in json
    '{"op": "start", "id": "a", "prompt_hash": ' + "[" * 50_000 + "]" * 50_000 + "}",
    '{"op": "seg_flush", "id": "a", "seg": 1, "ptr": ' + "9" * 4000 + ', "size": 1}',
    '{"op": "seg_flush", "id": "a", "seg": 1, "ptr": 18446744073709551616, "size": 1}',  # 2**64
    '{"op": "start", "id": "' + "\\ud800" + '"}',  # lone surrogate
])
def test_legacy_importer_on_pathological_lines(tmp_path, line):
    """Lines built to break a JSON decoder or msgpack; a valid line follows each, so a
    bad one is corruption (not a torn tail): clean errors only, and anything accepted can
    be snapshotted. Regression (fixed in kvj/legacy.py): deep nesting escaped as a raw
    RecursionError."""
    p = tmp_path / "legacy.jsonl"
    p.write_text(line + "\n" + '{"op": "end", "id": "a"}\n')
    replay_or_clean_error(str(p))


# -- path traversal ---------------------------------------------------------------------------

HOSTILE_NAMES = ["..", ".", "../x", "a/../../b", "/etc/passwd", "a/b", "a\\b", "a\0b", "", " ", "-rf", ".hidden",
                 "x" * 300, "ok\n", "é", "..\u2215x", "a" * 63, "A" * 64, "g" * 64, "../" + "a" * 61]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_request_ids_and_keys_are_refused(tmp_path, name):
    """Ids and keys that could name a path are refused at the API, before any I/O."""
    with pytest.raises(InvalidName):
        check_key(name)
    from kvj.segments.store import SegmentStore
    with SegmentStore(str(tmp_path / "s")) as store:
        for op in (store.get, store.info, store.exists, store.delete, store.verify, store.quarantine):
            with pytest.raises(InvalidName):
                op(name)
    if name in ("..", ".", "../x", "a/../../b", "/etc/passwd", "a/b", "a\\b", "a\0b", "", " ", "-rf", ".hidden",
                "x" * 300, "ok\n", "é", "..\u2215x", "../" + "a" * 61):
        with pytest.raises(InvalidName):
            check_request_id(name)
        with Journal.open(tmp_path / "j") as j:
            with pytest.raises(InvalidName):
                j.start(name)
            with pytest.raises(InvalidName):
                j.end(name)
            with pytest.raises(InvalidName):
                j.checkpoint(1, {"w": name})


@FUZZ
@given(name=st.text(max_size=80))
def test_any_accepted_request_id_is_a_safe_path_component(name):
    try:
        check_request_id(name)
    except InvalidName:
        return
    assert name not in (".", "..") and not name.startswith((".", "-"))
    assert not set(name) & {"/", "\\", "\0", "\n", "\r"}
    assert os.path.basename(name) == name and not os.path.isabs(name)


@pytest.mark.parametrize("rtype,payload", [
    (RecordType.SEGMENT, {"id": "r", "seg": 0, "key": "../../../etc/passwd", "tokens": [0, 1], "layout": {},
                          "raw_size": 1, "stored_size": 1, "digest": "x", "codec": "raw"}),
    (RecordType.START, {"id": "../../etc", "prompt_hash": None, "tokens": None, "meta": {}}),
    (RecordType.CHECKPOINT, {"step": 1, "keys": {"w": "../../../../etc/passwd"}, "meta": {}}),
    (RecordType.DELTA, {"step": 2, "base_step": 1, "keys": {"m": "/etc/shadow"}, "meta": {}}),
])
def test_hostile_names_inside_a_journal_never_reach_a_path(tmp_path, rtype, payload):
    """A journal crafted with a traversal in a key or id: replay refuses the record, or the
    store refuses the key when anything (restore, fsck, compaction) looks it up."""
    frames = [F.encode_record(int(rtype), 1, msgpack.packb(payload, use_bin_type=True))]
    path = write_journal(tmp_path / "j", log_file([group(frames, 1)]))
    try:
        state = replay(path)
    except KvjError:
        return
    from kvj.segments.store import SegmentStore
    with SegmentStore(os.path.join(path, "segments")) as store:
        for key in state.referenced_keys():
            with pytest.raises(InvalidName):
                store.get(key)
    from kvj.ops.fsck import fsck
    try:
        result = fsck(path)
    except KvjError:
        return
    assert result.exit_code != 0, "fsck called a journal that references a traversal key clean"


# -- no pickle --------------------------------------------------------------------------------

UNSAFE = [
    (re.compile(r"\bimport\s+(c?pickle|dill|shelve|marshal)\b|\bfrom\s+(c?pickle|dill|shelve|marshal)\s+import"),
     "imports a pickle-family module"),
    (re.compile(r"\bpickle\.(loads?|Unpickler)\b"), "unpickles"),
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle=True"),
    (re.compile(r"\byaml\.load\((?![^)]*SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"(?<![\w.])(eval|exec)\("), "eval/exec"),
]


def test_no_pickle_or_eval_anywhere_in_the_package():
    hits = []
    for path in sorted((REPO / "kvj").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in UNSAFE:
                if pattern.search(code):
                    hits.append(f"{path.relative_to(REPO)}:{lineno}: {what}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_no_unpickling_at_run_time(tmp_path, monkeypatch):
    """A full round trip (records, segment flush and restore, snapshot, replay) with every
    unpickling entry point booby-trapped."""
    import pickle

    import torch

    def trap(*a, **k):
        raise AssertionError("kvj unpickled something")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, trap)
    monkeypatch.setattr(torch, "load", trap)
    from kvj.journal.snapshot import write_snapshot
    from kvj.segments.store import SegmentStore
    path = str(tmp_path / "j")
    t = torch.arange(64, dtype=torch.float32).reshape(4, 16)
    with Journal.open(path) as j:
        j.start("r1", prompt_hash="h")
        with SegmentStore(os.path.join(path, "segments")) as store:
            info = store.put(t, layout={"m": 1})
        j.flush("r1", 0, token_range=(0, 4), info=info).result()
        j.sync()
    write_snapshot(path, replay(path))
    state = replay(path)
    with SegmentStore(os.path.join(path, "segments")) as store:
        assert torch.equal(store.get(state.requests["r1"].segments[0].key), t)


# -- permissions ------------------------------------------------------------------------------

def test_files_are_owner_only_even_with_umask_0(tmp_path):
    """Journal dir, log files, LOCK, torn/, snapshot and segment files: 0600 files and
    0700 directories regardless of the umask."""
    import torch

    from kvj.journal.snapshot import write_snapshot
    from kvj.segments.store import SegmentStore
    old = os.umask(0)
    try:
        path = str(tmp_path / "deep" / "j")
        with Journal.open(path) as j:
            j.start("r1")
            with SegmentStore(os.path.join(path, "segments")) as store:
                info = store.put(torch.ones(8, 8), layout={})
            j.flush("r1", 0, token_range=(0, 8), info=info).result()
            j.sync()
        logs = sorted(n for n in os.listdir(path) if n.endswith(".log"))
        with open(os.path.join(path, logs[-1]), "ab") as f:
            f.write(b"KVJG-torn")
        with Journal.open(path) as j:  # cuts the torn tail into torn/
            j.alloc("cuda:0", 1, 1, durable=True)
        write_snapshot(path, replay(path))
        from kvj.ops.compact import compact
        compact(path, grace=0)
    finally:
        os.umask(old)
    loose = []
    for root in (str(tmp_path / "deep"), path):
        st_mode = os.stat(root).st_mode & 0o777
        if st_mode != 0o700:
            loose.append(f"{root}: {oct(st_mode)}")
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames:
            mode = os.stat(os.path.join(dirpath, name)).st_mode & 0o777
            if mode != 0o700:
                loose.append(f"{os.path.join(dirpath, name)}: {oct(mode)}")
        for name in filenames:
            mode = os.stat(os.path.join(dirpath, name)).st_mode & 0o777
            if mode != 0o600:
                loose.append(f"{os.path.join(dirpath, name)}: {oct(mode)}")
    assert os.path.isdir(os.path.join(path, "torn")) and any(n.endswith(".snap") for n in os.listdir(path))
    assert not loose, "files or directories readable by others:\n" + "\n".join(loose)


# -- CLI arguments ----------------------------------------------------------------------------

def kvj_cli(*args: str, stdin: str = "", timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvj.cli.main", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


class _Evil:
    """Unpickling this creates the file named by MARKER: proof that something unpickled."""

    def __reduce__(self):
        return (open, (os.environ["KVJ_TEST_MARKER"], "w"))


@pytest.fixture
def cli_inputs(tmp_path) -> Dict[str, str]:
    """A small journal, a journal of garbage, and files built to exploit a loader."""
    import numpy as np
    journal = str(tmp_path / "j")
    with Journal.open(journal) as j:
        j.start("r1", durable=True)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "0000000000000001.log").write_bytes(F.encode_file_header(1, 1, 0) + os.urandom(300) +
                                                   F.encode_group_header(0, 1, 1))
    marker = str(tmp_path / "PWNED")
    os.environ["KVJ_TEST_MARKER"] = marker
    import pickle
    evil_pt = tmp_path / "evil.pt"
    evil_pt.write_bytes(pickle.dumps({"w": _Evil()}))
    evil_npy = tmp_path / "evil.npy"
    np.save(evil_npy, np.array([_Evil()], dtype=object), allow_pickle=True)
    return {"journal": journal, "garbage": str(garbage), "evil_pt": str(evil_pt), "evil_npy": str(evil_npy),
            "marker": marker, "file": str(evil_npy)}


CLI_CASES = [
    # (arguments, stdin, must fail)
    (["replay", "-j", "/nonexistent/journal"], "", True),
    (["replay", "-j", "{file}"], "", True),
    (["replay", "-j", "{journal}", "--at", "-5"], "", True),
    (["replay", "-j", "{journal}", "--at", "99999999999999999999999999"], "", False),
    (["replay", "-j", "{garbage}", "--strict"], "", True),
    (["fsck", "-j", "{garbage}"], "", True),
    (["inspect", "-j", "{journal}", "--request", "../../etc/passwd"], "", False),
    (["record", "start", "../../etc/passwd", "-j", "{journal}"], "", True),
    (["record", "ndjson", "-j", "{journal}"], "[" * 100_000 + "]" * 100_000 + "\n", True),
    (["record", "ndjson", "-j", "{journal}"], '{"type": "start", "id": "../x"}\n', True),
    (["flush", "-j", "{journal}", "--request", "r1", "--tokens", "0:4", "{evil_pt}"], "", True),
    (["flush", "-j", "{journal}", "--request", "r1", "--tokens", "0:4", "{evil_npy}"], "", True),
    (["flush", "-j", "{journal}", "--request", "../../x", "--tokens", "0:4", "{evil_npy}"], "", True),
]


@pytest.mark.parametrize("args,stdin,must_fail", CLI_CASES, ids=[" ".join(c[0][:2]) + f"-{i}"
                                                                 for i, c in enumerate(CLI_CASES)])
def test_cli_rejects_hostile_arguments_cleanly(cli_inputs, args, stdin, must_fail):
    """Bad paths, numbers, names, NDJSON and pickle-bearing tensor files: a clean error
    (no traceback), a non-zero exit where the input is bad, and nothing unpickled."""
    args = [a.format(**cli_inputs) for a in args]
    out = kvj_cli(*args, stdin=stdin)
    assert out.stdout or out.stderr or not must_fail, f"{args}: no output at all"
    assert "Traceback" not in out.stderr, f"{args}: a traceback instead of a clean error\n{out.stderr[-3000:]}"
    if must_fail:
        assert out.returncode != 0, f"{args}: exit 0\n{out.stdout[-2000:]}"
    assert not os.path.exists(cli_inputs["marker"]), f"{args}: a pickle was loaded"


def test_a_payload_cannot_turn_a_torn_tail_into_corruption(tmp_path):
    """A tenant puts a 24-character ASCII string in request metadata: a commit-group header
    with a valid CRC (found in a few tries). If a crash tears that request's group, the
    reader sees 'a damaged group followed by a valid one' inside the damaged group's own
    bytes and calls it corruption: non-strict replay and Journal.open fail (and fsck cannot
    repair it) where a torn tail should simply end the log. Fixed by salting group-header
    CRCs with a random per-file salt the tenant cannot know (man/kvj-journal.5)."""
    blob = None
    for n in range(10_000):
        candidate = F.encode_group_header(64, 1, 0x41414141 + n)
        if all(b < 0x80 for b in candidate):
            blob = candidate
            break
    assert blob is not None
    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        j.alloc("d", 1, 1, durable=True)
        j.start("victim", meta={"note": blob.decode("ascii")}, durable=True)
    log = sorted(n for n in os.listdir(path) if n.endswith(".log"))[-1]
    data = bytearray((Path(path) / log).read_bytes())
    off = last = F.FILE_HEADER_SIZE
    salt = F.decode_file_header(bytes(data)).salt
    while off < len(data):
        last = off
        off = F.parse_group(bytes(data), off, log, salt)[1]
    data[last:last + F.GROUP_HEADER_SIZE] = bytes(F.GROUP_HEADER_SIZE)  # the victim's group header sector lost
    (Path(path) / log).write_bytes(bytes(data))
    state = replay(path)
    assert state.last_lsn == 1 and state.tail is not None
    with Journal.open(path) as j:
        assert j.alloc("d", 2, 1, durable=True) == 2
