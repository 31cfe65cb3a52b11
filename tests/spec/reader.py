"""A second reader of kvj's files, written from man/kvj-journal.5 and man/kvj-segment.5 alone.

It imports nothing from kvj: its primitives are CRC32C (``crc32c``), BLAKE3 (``blake3``),
MessagePack (``msgpack``), zstd frames (``zstandard``) and arrays (``numpy``). Everything
else (framing, salts, limits, record schemas, the segment layout, the codecs, row dedup, the
digest, the layouts kvj writes) is this module's own reading of the pages, so where it and kvj
disagree one of the two departs from the spec. It is strict: what a writer must write (zero
flags, no unknown record fields) is checked too, since it only ever reads files kvj wrote.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import blake3
import crc32c as _crc32c
import msgpack
import numpy as np
import zstandard


class SpecError(Exception):
    """A file departs from the spec: which file, where, and why."""

    def __init__(self, path: str, offset: Optional[int], reason: str):
        super().__init__(f"{path}{'' if offset is None else f' @{offset}'}: {reason}")
        self.path, self.offset, self.reason = path, offset, reason


def crc32c(data: bytes, value: int = 0) -> int:
    """CRC32C (Castagnoli, reflected, init and final XOR 0xFFFFFFFF), continuing from ``value``."""
    return _crc32c.crc32c(data, value)


def unpack(data: bytes, path: str, offset: int) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types on malformed input
        raise SpecError(path, offset, f"not MessagePack: {exc}") from None


def _need(ok: bool, path: str, offset: Optional[int], reason: str) -> None:
    if not ok:
        raise SpecError(path, offset, reason)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_mode(path: str) -> None:
    """Files are created with mode 0600 and directories with mode 0700 (both pages)."""
    mode = os.stat(path).st_mode & 0o777
    want = 0o700 if os.path.isdir(path) else 0o600
    _need(mode == want, path, None, f"mode {mode:o}, the spec says {want:o}")


# ============================================================================ kvj-journal(5)

LOG_MAGIC = b"\x89KVJLOG\n"
GROUP_MAGIC = b"KVJG"
SNAP_MAGIC = b"\x89KVJSNP\n"
FILE_HEADER = 36
GROUP_HEADER = {1: 24, 2: 32}
RECORD_HEADER = 20
MAX_PAYLOAD = 16 << 20  # LOG FILE, Limits
MAX_GROUP_BODY = 1 << 30
#: Names and ids, matched whole (``fullmatch``).
LOG_NAME = re.compile(r"(\d{16})\.log")
SNAP_NAME = re.compile(r"snapshot-(\d{16})\.snap")
REQUEST_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,255}")
KEY = re.compile(r"[0-9a-f]{64}")
TYPES = {1: "start", 2: "segment", 3: "end", 4: "alloc", 5: "free", 6: "checkpoint", 7: "delta", 8: "epoch",
         9: "tokens", 10: "handoff", 11: "reply"}


@dataclass
class Record:
    lsn: int
    rtype: int
    payload: Dict[str, Any]
    path: str
    offset: int
    time_ns: Optional[int]  # the group's time; None in version 1 files


@dataclass
class LogFile:
    path: str
    seq: int
    version: int
    base_lsn: int
    salt: int
    groups: int = 0
    records: List[Record] = field(default_factory=list)
    torn_at: Optional[int] = None  # where a torn tail starts (the newest file only)


def _group(data: bytes, off: int, salt: int, version: int) -> Optional[Tuple[int, int, int, Optional[int]]]:
    """(body_len, count, first_lsn, time_ns) of a valid group header at ``off``, else None."""
    size = GROUP_HEADER[version]
    if off + size > len(data) or data[off:off + 4] != GROUP_MAGIC:
        return None
    crc, body_len, count, first_lsn = struct.unpack_from("<IIIQ", data, off + 4)
    time_ns = struct.unpack_from("<Q", data, off + 24)[0] if version == 2 else None
    if crc32c(data[off + 8:off + size], salt) != crc or body_len > MAX_GROUP_BODY:
        return None
    return body_len, count, first_lsn, time_ns


def _records(data: bytes, off: int, salt: int, version: int, path: str) -> Optional[Tuple[List[Record], int]]:
    """The records of the group at ``off`` and its end, or None unless the whole group is valid."""
    head = _group(data, off, salt, version)
    if head is None:
        return None
    body_len, count, lsn, time_ns = head
    pos = off + GROUP_HEADER[version]
    end = pos + body_len
    if end > len(data) or count < 1:
        return None
    out = []
    for _ in range(count):
        if pos + RECORD_HEADER > end:
            return None
        crc, length, rtype, flags, rec_lsn = struct.unpack_from("<IIHHQ", data, pos)
        stop = pos + RECORD_HEADER + length
        if rtype == 0 or rec_lsn != lsn or length > MAX_PAYLOAD or stop > end:
            return None
        if crc32c(data[pos + RECORD_HEADER:stop], crc32c(data[pos + 4:pos + RECORD_HEADER])) != crc:
            return None
        out.append((lsn, rtype, flags, pos, stop))
        pos, lsn = stop, lsn + 1
    if pos != end:
        return None
    records = []
    for lsn, rtype, flags, pos, stop in out:  # the group is valid: what kvj wrote must follow the spec
        _need(flags == 0, path, pos, f"record flags {flags}, the spec says 0")
        records.append(Record(lsn, rtype, unpack(data[pos + RECORD_HEADER:stop], path, pos), path, pos, time_ns))
    return records, end


def _later_group(data: bytes, off: int, after_lsn: int, salt: int, version: int) -> Optional[int]:
    """A valid group header past ``off`` with a first_lsn after ``after_lsn`` (REPLAY)."""
    pos = data.find(GROUP_MAGIC, off + 1)
    while pos != -1:
        head = _group(data, pos, salt, version)
        if head is not None and head[2] > after_lsn:
            return pos
        pos = data.find(GROUP_MAGIC, pos + 1)
    return None


def read_log(path: str, newest: bool, expect_lsn: Optional[int] = None, modes: bool = True) -> LogFile:
    """One log file: header, then commit groups; a torn tail only at the end of the newest file."""
    if modes:
        check_mode(path)
    with open(path, "rb") as f:
        data = f.read()
    name = LOG_NAME.fullmatch(os.path.basename(path))
    _need(name is not None, path, None, "not a log file name")
    header_ok = len(data) >= FILE_HEADER and data[:8] == LOG_MAGIC and \
        crc32c(data[:32]) == struct.unpack_from("<I", data, 32)[0]
    if not header_ok and newest and len(data) <= FILE_HEADER:  # its creation was cut short: nothing in it
        log = LogFile(path, int(name.group(1)), 0, expect_lsn or 0, 0)
        log.torn_at = 0
        return log
    _need(header_ok, path, 0, "bad file header")
    magic, version, flags, seq, base_lsn, salt, crc = struct.unpack_from("<8sHHQQII", data, 0)
    _need(version in GROUP_HEADER and flags == 0, path, 8, f"version {version} flags {flags}")
    _need(seq == int(name.group(1)), path, 12, f"seq {seq} is not the file's number")
    log = LogFile(path, seq, version, base_lsn, salt)
    off, lsn = FILE_HEADER, base_lsn
    while off < len(data):
        got = _records(data, off, salt, version, path)
        if got is None:
            later = _later_group(data, off, lsn - 1, salt, version)
            _need(newest and later is None, path, off,
                  "invalid group " + ("followed by a valid one" if later is not None else "in a sealed file"))
            log.torn_at = off
            break
        records, end = got
        _need(records[0].lsn == lsn, path, off, f"group starts at LSN {records[0].lsn}, expected {lsn}")
        log.records += records
        log.groups += 1
        off, lsn = end, lsn + len(records)
    if expect_lsn is not None:
        _need(base_lsn == expect_lsn, path, 20, f"base_lsn {base_lsn}, the file before ends at {expect_lsn - 1}")
    return log


# -- records (RECORDS)

def _plain(value: Any, path: str, where: str) -> None:
    """Maps have string keys at every level; only plain data inside."""
    if isinstance(value, dict):
        for k, v in value.items():
            _need(isinstance(k, str), path, None, f"{where} has a non-string key {k!r}")
            _plain(v, path, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain(v, path, f"{where}[{i}]")
    else:
        _need(value is None or isinstance(value, (bool, int, float, str, bytes)), path, None,
              f"{where} is not plain data")
        _need(not (isinstance(value, float) and not math.isfinite(value)), path, None, f"{where} is not finite")


_STR, _INT, _FLOAT, _MAP, _ID, _KEY = "str", "int", "float", "map", "id", "key"
#: Each record type's fields (RECORDS): name -> kinds the value may be.
SCHEMA: Dict[int, Dict[str, Tuple[str, ...]]] = {
    1: {"id": (_ID,), "prompt_hash": (_STR, "nil"), "tokens": ("ints", "nil"), "meta": (_MAP,)},
    2: {"id": (_ID,), "seg": (_INT,), "key": (_KEY,), "tokens": ("range",), "layout": (_MAP,),
        "raw_size": (_INT,), "stored_size": (_INT,), "digest": (_STR,), "codec": (_STR,)},
    3: {"id": (_ID,), "status": (_STR,)},
    4: {"device": (_STR,), "addr": (_INT,), "size": (_INT,), "tag": (_STR,)},
    5: {"device": (_STR,), "addr": (_INT,)},
    6: {"step": (_INT,), "keys": ("keys",), "meta": (_MAP,)},
    7: {"step": (_INT,), "base_step": (_INT,), "keys": ("keys",), "meta": (_MAP,)},
    8: {"epoch": (_INT,), "recovered_lsn": (_INT,), "time": (_FLOAT,), "manifest": (_STR, "nil")},
    9: {"id": (_ID,), "at": ("natural",), "tokens": ("ints",)},
    10: {"id": (_ID,), "to": (_ID,)},
    11: {"id": (_ID,), "status": (_STR,), "count": ("natural",), "at": (_FLOAT,)},
}
OPTIONAL = {8: {"salvage": (_MAP,)},
            11: {"finish_reason": (_STR,), "stop_reason": (_STR, "natural"), "cached_tokens": ("natural",),
                 "to": (_ID,)}}
#: The layout format of KV blocks that stay in the prefix cache once their request ended (REPLAY).
CACHED_FORMAT = "kvj-kv-block/2"


def _fits(kind: str, v: Any) -> bool:
    if kind == "nil":
        return v is None
    if kind == _STR:
        return isinstance(v, str)
    if kind == _INT:
        return _is_int(v)
    if kind == _FLOAT:
        return isinstance(v, float)
    if kind == _MAP:
        return isinstance(v, dict)
    if kind == _ID:
        return isinstance(v, str) and REQUEST_ID.fullmatch(v) is not None
    if kind == _KEY:
        return isinstance(v, str) and KEY.fullmatch(v) is not None
    if kind == "natural":
        return _is_int(v) and v >= 0
    if kind == "ints":
        return isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)
    if kind == "range":
        return isinstance(v, list) and len(v) == 2 and all(_is_int(t) and t >= 0 for t in v) and v[0] <= v[1]
    if kind == "keys":
        return isinstance(v, dict) and all(isinstance(k, str) and _fits(_KEY, x) for k, x in v.items())
    raise AssertionError(kind)


def check_record(rec: Record) -> None:
    """A record kvj wrote has exactly its type's fields, of the right kinds (RECORDS)."""
    fields = SCHEMA.get(rec.rtype)
    _need(fields is not None, rec.path, rec.offset, f"record type {rec.rtype} is not in the spec")
    p = rec.payload
    _need(isinstance(p, dict), rec.path, rec.offset, "payload is not a map")
    allowed = {**fields, **OPTIONAL.get(rec.rtype, {})}
    _need(set(fields) <= set(p) <= set(allowed), rec.path, rec.offset,
          f"{TYPES[rec.rtype]} record has fields {sorted(p)}, the spec {sorted(fields)}")
    for name, value in p.items():
        _need(any(_fits(k, value) for k in allowed[name]), rec.path, rec.offset,
              f"{TYPES[rec.rtype]}.{name} = {value!r:.80} is not {'/'.join(allowed[name])}")
    for name in ("meta", "layout", "salvage"):
        if name in p:
            _plain(p[name], rec.path, f"{TYPES[rec.rtype]}.{name}")


# -- snapshots (SNAPSHOTS)

def read_snapshot(path: str, modes: bool = True) -> Tuple[int, Dict[str, Any]]:
    """(lsn, body) of a snapshot file."""
    if modes:
        check_mode(path)
    with open(path, "rb") as f:
        data = f.read()
    _need(len(data) >= 32, path, 0, "shorter than the snapshot header")
    magic, version, flags, lsn, body_len, crc = struct.unpack_from("<8sHHQQI", data, 0)
    _need(magic == SNAP_MAGIC and version == 1 and flags == 0, path, 0, "bad snapshot header")
    _need(body_len == len(data) - 32, path, 20, f"body_len {body_len}, {len(data) - 32} bytes follow")
    _need(crc32c(data[32:], crc32c(data[:28])) == crc, path, 28, "snapshot CRC mismatch")
    body = unpack(data[32:], path, 32)
    _need(isinstance(body, dict) and body.get("last_lsn") == lsn, path, 32, "body's last_lsn is not the header's lsn")
    return lsn, body


# -- the journal directory (DIRECTORY LAYOUT, REPLAY, MIRROR)

@dataclass
class Journal:
    path: str
    logs: List[LogFile]
    snapshot: Optional[Tuple[int, Dict[str, Any]]]
    records: List[Record]  # every record after the snapshot, in LSN order

    @property
    def torn(self) -> Optional[Tuple[str, int]]:
        last = self.logs[-1] if self.logs else None
        return (last.path, last.torn_at) if last is not None and last.torn_at is not None else None


def read_journal(path: str, modes: bool = True) -> Journal:
    """Every log file in order (checking base_lsn continuity), the newest snapshot, and the
    records after it, each checked against its schema. ``modes``: check file modes too (not
    for a copy, such as a fixture from git)."""
    if modes:
        check_mode(path)
    names = sorted(os.listdir(path))
    logs_named = [n for n in names if LOG_NAME.fullmatch(n)]
    snaps = sorted((int(SNAP_NAME.fullmatch(n).group(1)), n) for n in names if SNAP_NAME.fullmatch(n))
    snapshot = read_snapshot(os.path.join(path, snaps[-1][1]), modes) if snaps else None
    logs: List[LogFile] = []
    expect: Optional[int] = None
    for i, name in enumerate(logs_named):
        log = read_log(os.path.join(path, name), i == len(logs_named) - 1, expect, modes)
        expect = log.base_lsn + len(log.records)
        logs.append(log)
    after = snapshot[0] if snapshot else 0
    if logs:
        _need(logs[0].base_lsn <= after + 1, logs[0].path, 20,
              f"the oldest log file starts at LSN {logs[0].base_lsn}; records {after + 1}.. are missing")
    records = [r for log in logs for r in log.records if r.lsn > after]
    for rec in records:
        if rec.rtype in SCHEMA:
            check_record(rec)
    return Journal(path, logs, snapshot, records)


def read_mirrored(path: str) -> Tuple[Journal, Journal]:
    """A mirrored journal and its mirror: each names the other, and their log files and
    snapshots are byte for byte the same (MIRROR)."""
    with open(os.path.join(path, "MIRROR")) as f:
        mirror = f.read().strip()
    with open(os.path.join(mirror, "MIRROR")) as f:
        _need(f.read().strip() == os.path.abspath(path), mirror, None, "the mirror does not name the journal")
    for name in sorted(os.listdir(path)):
        if LOG_NAME.fullmatch(name) or SNAP_NAME.fullmatch(name):
            with open(os.path.join(path, name), "rb") as a, open(os.path.join(mirror, name), "rb") as b:
                _need(a.read() == b.read(), os.path.join(mirror, name), None, "differs from the journal's copy")
    logs = [{n for n in os.listdir(d) if LOG_NAME.fullmatch(n)} for d in (path, mirror)]
    _need(logs[0] == logs[1], mirror, None, "holds other log files than the journal")
    return read_journal(path), read_journal(mirror)


def _resume_position(segments: Dict[int, Dict[str, Any]]) -> int:
    """Tokens covered from position 0 by the segments, without a gap."""
    pos = 0
    for start, end in sorted(tuple(s["tokens"]) for s in segments.values() if s["tokens"]):
        if start > pos:
            break
        pos = max(pos, end)
    return pos


def fold(records: List[Record], snapshot: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The state records fold into (Snapshot body), from a snapshot's body or from nothing:
    requests in flight (by id, segments by seg), allocations, checkpoint, deltas, epochs, counts."""
    snap = snapshot or {}
    requests: Dict[str, Dict[str, Any]] = {}
    for r in snap.get("requests", []):
        requests[r["id"]] = {**{k: r[k] for k in ("id", "prompt_hash", "tokens", "meta", "start_lsn")},
                             "segments": {s["seg"]: dict(s) for s in r["segments"]}, "output": list(r.get("output", [])),
                             "reply": r.get("reply")}
    cache = {chain: dict(s) for chain, s in (snap.get("cache") or {}).items()}
    allocs = {dev: {a["addr"]: dict(a) for a in lst} for dev, lst in snap.get("allocations", {}).items()}
    checkpoint, deltas = snap.get("checkpoint"), list(snap.get("deltas", []))
    epochs, counts = list(snap.get("epochs", [])), dict(snap.get("counts", {}))
    for rec in records:
        p, name = rec.payload, TYPES.get(rec.rtype, f"type{rec.rtype}")
        counts[name] = counts.get(name, 0) + 1
        if rec.rtype == 1:
            requests[p["id"]] = {"id": p["id"], "prompt_hash": p["prompt_hash"], "tokens": p["tokens"],
                                 "meta": p["meta"], "start_lsn": rec.lsn, "segments": {}, "output": [], "reply": None}
        elif rec.rtype == 2 and p["id"] in requests:
            requests[p["id"]]["segments"][p["seg"]] = {
                **{k: p[k] for k in ("seg", "key", "tokens", "layout", "raw_size", "stored_size", "digest", "codec")},
                "lsn": rec.lsn, "ptr": None}
        elif rec.rtype in (3, 10):  # an end, or a handoff: it ended here (RECORDS); its KV blocks are cached
            for seg in (requests.pop(p["id"], None) or {"segments": {}})["segments"].values():
                if seg["layout"].get("format") == CACHED_FORMAT and isinstance(seg["layout"].get("chain"), str):
                    cache[seg["layout"]["chain"]] = seg
        elif rec.rtype == 11 and p["id"] in requests:
            requests[p["id"]]["reply"] = {k: p.get(k) for k in ("status", "count", "at", "finish_reason",
                                                                 "stop_reason", "to")}
            requests[p["id"]]["reply"]["cached_tokens"] = p.get("cached_tokens", 0)
        elif rec.rtype == 4:
            allocs.setdefault(p["device"], {})[p["addr"]] = {"addr": p["addr"], "size": p["size"], "tag": p["tag"],
                                                            "lsn": rec.lsn}
        elif rec.rtype == 5:
            allocs.get(p["device"], {}).pop(p["addr"], None)
        elif rec.rtype == 6:
            checkpoint, deltas = {"step": p["step"], "keys": p["keys"], "meta": p["meta"], "lsn": rec.lsn}, []
        elif rec.rtype == 7:
            deltas.append({"step": p["step"], "base_step": p["base_step"], "keys": p["keys"], "meta": p["meta"],
                           "lsn": rec.lsn})
        elif rec.rtype == 9 and p["id"] in requests:
            req = requests[p["id"]]
            if p["at"] == len(req["tokens"] or []) + len(req["output"]):  # else ignored (RECORDS, tokens)
                req["output"] += p["tokens"]
        elif rec.rtype == 8:
            epochs.append({**{k: p[k] for k in ("epoch", "recovered_lsn", "time", "manifest")}, "lsn": rec.lsn,
                           **({"salvage": p["salvage"]} if p.get("salvage") is not None else {})})
    for r in requests.values():
        r["resume_position"] = _resume_position(r["segments"])
    return {"requests": requests, "allocations": allocs, "cache": cache,
            "checkpoint": checkpoint, "deltas": deltas, "epochs": epochs, "counts": counts}


def check_snapshot_body(body: Dict[str, Any], path: str) -> None:
    """The fields Snapshot body names, with their kinds; no ended request."""
    for key in ("first_lsn", "last_lsn", "snapshot_lsn", "requests", "ended_compacted", "allocations",
                "checkpoint", "deltas", "epochs", "counts", "warnings", "tail"):
        _need(key in body, path, None, f"snapshot body lacks {key}")
    for r in body["requests"]:
        _need(r["ended"] is False and r["status"] is None and r["end_lsn"] is None, path, None,
              f"snapshot holds ended request {r['id']}")
        _need([s["seg"] for s in r["segments"]] == sorted(s["seg"] for s in r["segments"]), path, None,
              "segments not by seg")
        _need(r["resume_position"] == _resume_position({s["seg"]: s for s in r["segments"]}), path, None,
              f"request {r['id']}: resume_position {r['resume_position']} is not what its segments cover")
    for lst in body["allocations"].values():
        _need([a["addr"] for a in lst] == sorted(a["addr"] for a in lst), path, None, "allocations not by addr")


# ============================================================================ kvj-segment(5)

SEG_MAGIC = b"\x89KVJSEG\n"
END_MAGIC = b"KVJSEGOK"
MAX_HEADER = 16 << 20
MAX_RAW = 1 << 36
MAX_EXPANSION = 32768
DIGEST_DOMAIN = b"kvj-segment-digest-v1\n"
#: Element sizes of the dtypes the header may name (HEADER), by what the names say.
ELEMENT = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4,
           "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4,
           "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
           "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1}
FLOATS = {n for n in ELEMENT if n.startswith(("float", "bfloat", "complex"))}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ZSTD = zstandard.ZstdDecompressor(max_window_size=1 << 27)


def word_size(dtype: str) -> int:
    """Codecs see words of the element size, half of it for complex types."""
    return ELEMENT[dtype] // 2 if dtype.startswith("complex") else ELEMENT[dtype]


def zstd_frame(data: bytes, raw_len: int, path: str, off: int) -> bytes:
    """One zstd frame that must declare and decode to exactly ``raw_len`` bytes."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise SpecError(path, off, f"not a zstd frame: {exc}") from None
    _need(declared == raw_len, path, off, f"zstd frame declares {declared} bytes, not {raw_len}")
    try:
        out = _ZSTD.decompress(data, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise SpecError(path, off, f"zstd frame does not decode: {exc}") from None
    _need(len(out) == raw_len, path, off, f"zstd frame decodes to {len(out)} bytes, not {raw_len}")
    return out


def _unmove(words: np.ndarray, w: int) -> np.ndarray:
    """Undo byteplane's fp bit move: bit 7 back to the sign, bits 8..w-1 down to 7..w-2."""
    if w == 1:
        return words
    t = words.dtype.type
    low, sign, rest = words & t(0x7F), (words >> t(7)) & t(1), words >> t(8)
    return low | (rest << t(7)) | (sign << t(8 * w - 1))


def byteplane(body: bytes, raw_len: int, params: Dict[str, Any], wsize: int, path: str, off: int) -> bytes:
    """A byteplane chunk: u8 planes, per plane u8 mode and u32 length, then the plane bodies."""
    _need(raw_len % wsize == 0 and len(params["planes"]) == wsize, path, off, "chunk is not whole words")
    n = raw_len // wsize
    head = 1 + 5 * wsize
    _need(len(body) >= head and body[0] == wsize, path, off, f"byteplane chunk says {body[0]} planes, not {wsize}")
    pos, planes = head, []
    for p in range(wsize):
        mode, length = struct.unpack_from("<BI", body, 1 + 5 * p)
        part = body[pos:pos + length]
        _need(len(part) == length, path, off, f"plane {p} runs past the chunk")
        pos += length
        if mode == 0:
            _need(length == n, path, off, f"raw plane {p} holds {length} bytes, not {n}")
            planes.append(np.frombuffer(part, np.uint8))
        else:  # a plane that does not shrink is stored raw, and an r plane always is
            _need(mode == 1 and length < n and params["planes"][p] != "r", path, off, f"plane {p} mode {mode}")
            planes.append(np.frombuffer(zstd_frame(part, n, path, off), np.uint8))
    _need(pos == len(body), path, off, "bytes after the last plane")
    utype = _UINT[wsize]
    words = np.zeros(n, utype)
    for p, plane in enumerate(planes):
        words |= plane.astype(utype) << utype(8 * p)
    if params["fp"]:
        words = _unmove(words, wsize)
    return words.astype(f"<u{wsize}").tobytes()


def decode_chunk(codec: str, params: Dict[str, Any], body: bytes, raw_len: int, wsize: int,
                 path: str, off: int) -> bytes:
    if codec == "raw":
        _need(params == {} and len(body) == raw_len, path, off, "raw chunk is not its raw bytes")
        return body
    if codec == "zstd":
        _need(set(params) == {"level", "long"} and -7 <= params["level"] <= 22 and isinstance(params["long"], bool),
              path, off, f"zstd params {params}")
        return zstd_frame(body, raw_len, path, off)
    if codec == "byteplane":
        _need(set(params) == {"planes", "fp", "level"} and set(params["planes"]) <= set("rez")
              and isinstance(params["fp"], bool) and -7 <= params["level"] <= 22, path, off,
              f"byteplane params {params}")
        return byteplane(body, raw_len, params, wsize, path, off)
    raise SpecError(path, off, f"codec {codec!r} is not in the spec")


def canonical_json(value: Any) -> bytes:
    """The digest's canonical JSON: sorted keys, no spaces, ASCII escapes, no NaN (DIGEST)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def digest(raw: bytes, dtype: str, shape: List[int], layout: Any, chunk_size: int) -> bytes:
    """BLAKE3(domain || D || u64 chunk_size || u64 raw_size || leaf_0 || ...)."""
    h = blake3.blake3(DIGEST_DOMAIN + canonical_json({"dtype": dtype, "layout": layout, "shape": shape}))
    h.update(struct.pack("<QQ", chunk_size, len(raw)))
    for off in range(0, len(raw), chunk_size):
        h.update(blake3.blake3(raw[off:off + chunk_size]).digest())
    return h.digest()


@dataclass
class Segment:
    path: str
    header: Dict[str, Any]
    raw: bytes  # the tensor's bytes, C order, decoded and checked against the digest

    @property
    def dtype(self) -> str:
        return self.header["dtype"]

    @property
    def shape(self) -> List[int]:
        return self.header["shape"]

    @property
    def layout(self) -> Any:
        return self.header["layout"]

    @property
    def key(self) -> str:
        return self.header["digest"].hex()


def _header(m: Any, size: int, hlen: int, path: str, at: int) -> int:
    """Check the header map (HEADER); returns map_stored."""
    _need(isinstance(m, dict), path, at, "header is not a map")
    dtype, shape = m.get("dtype"), m.get("shape")
    _need(dtype in ELEMENT, path, at, f"dtype {dtype!r}")
    _need(isinstance(shape, list) and len(shape) <= 64 and all(_is_int(d) and d >= 0 for d in shape), path, at,
          f"shape {shape!r}")
    raw_size = m.get("raw_size")
    _need(_is_int(raw_size) and raw_size == math.prod(shape) * ELEMENT[dtype] <= MAX_RAW, path, at,
          f"raw_size {raw_size!r} for {dtype} {shape}")
    cs = m.get("chunk_size")
    _need(_is_int(cs) and 4096 <= cs <= 64 << 20 and cs & (cs - 1) == 0, path, at, f"chunk_size {cs!r}")
    _need(m.get("layout") is None or isinstance(m["layout"], dict), path, at, "layout is not a map or nil")
    _need(isinstance(m.get("codec"), str) and isinstance(m.get("params"), dict), path, at, "codec, params")
    _need(m.get("digest_alg") == "blake3-tree-v1" and isinstance(m.get("digest"), bytes) and len(m["digest"]) == 32,
          path, at, "digest_alg, digest")
    payload, stored = m.get("payload_size"), m.get("stored_size")
    _need(_is_int(payload) and 0 <= payload <= raw_size and payload % word_size(dtype) == 0, path, at,
          f"payload_size {payload!r}")
    _need(_is_int(stored) and size == 16 + stored + hlen + 16, path, at,
          "16 + stored_size + H + 16 is not the file size")
    dd, map_stored = m.get("dedup"), 0
    if dd is None:
        _need(payload == raw_size, path, at, "payload_size is not raw_size without dedup")
    else:
        _need(isinstance(dd, dict) and {"row_bytes", "rows", "map_raw", "map_stored", "map_crc"} <= set(dd), path, at,
              f"dedup {dd!r}")
        rb, rows, map_stored = dd["row_bytes"], dd["rows"], dd["map_stored"]
        _need(rb >= 8 and rb % 8 == 0 and rows * rb == raw_size and dd["map_raw"] == 4 * rows
              and payload % rb == 0 and 1 <= map_stored and 4 * rows <= map_stored * MAX_EXPANSION, path, at,
              f"dedup fields {dd}")
    _need(cs == 1 << 20, path, at, f"chunk_size {cs}: the writer uses 1 MiB")
    _need(dd is None or raw_size >= 2 << 20, path, at, "row dedup on a segment under 2 MiB")
    table = m.get("chunks")
    n = -(-payload // cs)
    _need(isinstance(table, list) and len(table) == n, path, at, f"{len(table)} chunks, payload needs {n}")
    for i, entry in enumerate(table):
        raw_len = min(cs, payload - i * cs)
        _need(isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0]) and _is_int(entry[1])
              and entry[0] >= 1 and entry[0] * MAX_EXPANSION >= raw_len and 0 <= entry[1] < 1 << 32, path, at,
              f"chunk {i} entry {entry!r}")
    _need(map_stored + sum(e[0] for e in table) == stored, path, at, "chunk table does not add up to stored_size")
    return map_stored


def read_segment(path: str, data: Optional[bytes] = None) -> Segment:
    """Parse a segment file from its trailer, check every CRC, decode every chunk, rebuild
    deduplicated rows and recompute the digest."""
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    size = len(data)
    _need(size >= 32, path, None, f"{size} bytes: shorter than preamble and trailer")
    hlen, hcrc, end = struct.unpack_from("<II8s", data, size - 16)
    _need(end == END_MAGIC, path, size - 16, "no end magic")
    _need(hlen <= MAX_HEADER and hlen <= size - 32, path, size - 16, f"header length {hlen}")
    at = size - 16 - hlen
    magic, version, flags, reserved = struct.unpack_from("<8sHHI", data, 0)
    _need(magic == SEG_MAGIC, path, 0, "bad magic")
    _need(crc32c(data[at:at + hlen], crc32c(data[:16])) == hcrc, path, at, "header CRC mismatch")
    _need(version == 1 and flags == 0 and reserved == 0, path, 8, f"version {version} flags {flags} {reserved}")
    m = unpack(data[at:at + hlen], path, at)
    map_stored = _header(m, size, hlen, path, at)
    dtype, cs, payload = m["dtype"], m["chunk_size"], m["payload_size"]
    wsize = word_size(dtype)
    pos = 16
    src: Optional[np.ndarray] = None
    if m["dedup"] is not None:
        dd = m["dedup"]
        frame = data[pos:pos + map_stored]
        _need(crc32c(frame) == dd["map_crc"], path, pos, "dedup map CRC mismatch")
        back = np.frombuffer(zstd_frame(frame, dd["map_raw"], path, pos), "<u4").astype(np.int64)
        src = np.arange(len(back), dtype=np.int64) - back
        _need(len(src) == 0 or (src.min() >= 0 and not back[src].any()), path, pos,
              "dedup map points at a row that is not first of its kind")
        _need(int((back == 0).sum()) * dd["row_bytes"] == payload, path, pos, "dedup map disagrees with payload_size")
        pos += map_stored
    out = bytearray()
    for i, (stored, crc) in enumerate(m["chunks"]):
        body = data[pos:pos + stored]
        _need(crc32c(body) == crc, path, pos, f"chunk {i} CRC mismatch")
        piece = decode_chunk(m["codec"], m["params"], body, min(cs, payload - i * cs), wsize, path, pos)
        out += piece
        pos += stored
    _need(pos == at, path, pos, "chunks do not end where the header starts")
    if src is not None:
        rb = m["dedup"]["row_bytes"]
        firsts = np.frombuffer(bytes(out), np.uint8).reshape(-1, rb)
        rows = np.empty((len(src), rb), np.uint8)
        is_first = src == np.arange(len(src))
        rows[is_first] = firsts
        rows[~is_first] = rows[src[~is_first]]
        raw = rows.tobytes()
    else:
        raw = bytes(out)
    _need(len(raw) == m["raw_size"], path, None, "decoded size is not raw_size")
    _need(digest(raw, dtype, m["shape"], m["layout"], cs) == m["digest"], path, None, "digest mismatch")
    return Segment(path, m, raw)


PACK_MAGIC, PACK_END = b"\x89KVJPAK\n", b"KVJPAKOK"


def read_pack(path: str) -> Dict[str, Segment]:
    """The live members of one pack (PACKS): listed from its tail, every member read and checked
    as a segment file, less those its dead list (``NAME.dead``) names."""
    with open(path, "rb") as f:
        data = f.read()
    _need(len(data) >= 40 and data[-8:] == PACK_END, path, None, "no pack trailer")
    index_at, count, crc = struct.unpack_from("<QII", data, len(data) - 24)
    _need(index_at + 48 * count == len(data) - 24, path, index_at, "the index does not end 24 bytes before the end")
    _need(crc32c(data[index_at:len(data) - 12]) == crc, path, index_at, "pack index CRC mismatch")
    magic, version, flags, reserved = struct.unpack_from("<8sHHI", data, 0)
    _need(magic == PACK_MAGIC and version == 1 and flags == 0 and reserved == 0, path, 0, "pack preamble")
    dead = set()
    dead_path = path[:-len(".kvjpack")] + ".dead"
    if os.path.exists(dead_path):
        with open(dead_path, "rb") as f:
            entries = f.read()
        for at in range(0, len(entries) - 35, 36):
            key, entry_crc = entries[at:at + 32], struct.unpack_from("<I", entries, at + 32)[0]
            if crc32c(key) != entry_crc:
                break  # a torn append ends the list
            dead.add(key.hex())
    found: Dict[str, Segment] = {}
    expect = 16
    for i in range(count):
        key, offset, length = struct.unpack_from("<32sQQ", data, index_at + 48 * i)
        _need(offset == expect and length >= 32 and key.hex() not in found, path, index_at + 48 * i,
              "members not back to back from offset 16, too short, or repeated")
        expect = offset + length
        seg = read_segment(f"{path}@{offset}", data[offset:offset + length])
        _need(seg.key == key.hex(), path, offset, f"member digest {seg.key} is not its index key")
        if key.hex() not in dead:
            found[key.hex()] = seg
    _need(expect == index_at, path, index_at, "members do not end at the index")
    return found


def read_store(root: str) -> Dict[str, Segment]:
    """Every segment of a store (SEGMENT STORE): under objects/XX/KEY.kvjseg with KEY its digest,
    and the live members of packs/NAME.kvjpack."""
    found: Dict[str, Segment] = {}
    packs = os.path.join(root, "packs")
    for name in sorted(os.listdir(packs)) if os.path.isdir(packs) else []:
        if name.endswith(".kvjpack"):
            _need(re.fullmatch(r"[0-9a-f]{16}\.kvjpack", name) is not None, os.path.join(packs, name), None,
                  "not packs/NAME.kvjpack")
            found.update(read_pack(os.path.join(packs, name)))
    objects = os.path.join(root, "objects")
    for d in (root, objects) if os.path.isdir(objects) else ():
        check_mode(d)
    for xx in sorted(os.listdir(objects)) if os.path.isdir(objects) else []:
        check_mode(os.path.join(objects, xx))
        for name in sorted(os.listdir(os.path.join(objects, xx))):
            key = name[:-len(".kvjseg")] if name.endswith(".kvjseg") else ""
            path = os.path.join(objects, xx, name)
            check_mode(path)
            _need(KEY.fullmatch(key) is not None and xx == key[:2], path, None, "not objects/XX/KEY.kvjseg")
            seg = read_segment(path)
            _need(seg.key == key, path, None, f"digest {seg.key} is not the key in its name")
            found[key] = seg
    return found


# ============================================================================ LAYOUTS

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def check_layout(seg: Segment) -> Optional[str]:
    """Check a segment against the LAYOUTS section of its tag; returns the tag (None: no layout)."""
    lay, path = seg.layout, seg.path
    if not isinstance(lay, dict):
        return None
    if lay.get("kind") == "paged_kv_block":
        _need(set(lay) == {"kind", "model", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim"},
              path, None, f"paged layout {lay}")
        _need(seg.shape == [lay["num_layers"], 2, lay["block_size"], lay["num_kv_heads"], lay["head_dim"]]
              and seg.dtype == lay["dtype"], path, None, "paged block shape or dtype is not the layout's")
        return "paged_kv_block"
    fmt = lay.get("format")
    if fmt == "kvj-kv-block/2":
        identity = {k: lay[k] for k in ("format", "model", "dtype", "layers", "kv_heads", "head_dim", "block_size",
                                        "order", "tp_size", "pp_size", "quant")}
        rank = {"tp_rank", "pp_rank", "stage"}
        extra = set(lay) - set(identity) - rank
        _need(rank <= set(lay) and extra <= {"token_ids", "chain", "seed"} and ("chain" in lay) == ("seed" in lay),
              path, None, f"kv-block layout fields {sorted(lay)}")
        first, end = lay["stage"]
        _need(lay["order"] in ("L2NHD", "LHNC") and lay["kv_heads"] % lay["tp_size"] == 0
              and 0 <= lay["tp_rank"] < lay["tp_size"] and 0 <= lay["pp_rank"] < lay["pp_size"]
              and 0 <= first < end <= lay["layers"], path, None, "order, heads, rank or stage")
        heads = lay["kv_heads"] // lay["tp_size"]
        shape = ([end - first, 2, lay["block_size"], heads, lay["head_dim"]] if lay["order"] == "L2NHD"
                 else [end - first, heads, lay["block_size"], 2 * lay["head_dim"]])
        _need(seg.shape == shape and seg.dtype == lay["dtype"], path, None, "KV block shape or dtype is not the layout's")
        if "token_ids" in lay:
            _need(len(lay["token_ids"]) == lay["block_size"] + 1, path, None, "token_ids is not block_size + 1 ids")
        if "seed" in lay:
            _need(lay["seed"] == blake3.blake3(json.dumps(identity, sort_keys=True).encode()).hexdigest()
                  and KEY.fullmatch(lay["chain"]) is not None, path, None, "seed is not the identity's, or chain")
    elif fmt == "kvj-kv-block/1":
        _need(set(lay) == {"format", "model", "layers", "kv_heads", "head_dim", "block_size", "dtype", "token_ids"},
              path, None, f"kv-block layout fields {sorted(lay)}")
        _need(seg.shape == [lay["layers"], 2, lay["block_size"], lay["kv_heads"], lay["head_dim"]]
              and seg.dtype == lay["dtype"], path, None, "KV block shape or dtype is not the layout's")
        _need(len(lay["token_ids"]) == lay["block_size"] + 1, path, None, "token_ids is not block_size + 1 ids")
    elif fmt == "kvj-train/2":
        _need(set(lay) == {"format", "model", "name", "dtype", "numel"} and lay["name"] == "tree"
              and seg.dtype == "uint8" == lay["dtype"] and seg.shape == [lay["numel"]], path, None,
              f"training document layout {lay}")
        doc = unpack(seg.raw, path, None)
        _need(isinstance(doc, dict) and doc.get("format") == "kvj-train/2" and {"tree", "leaves"} <= set(doc)
              <= {"format", "tree", "leaves", "inline"}, path, None, "training document fields")
    elif fmt in ("kvj-train-full/1", "kvj-train-xor/1"):
        xor = fmt == "kvj-train-xor/1"
        _need(set(lay) == {"format", "model", "name", "dtype", "numel"} | ({"base_step"} if xor else set()),
              path, None, f"training stream layout {lay}")
        want = _INT_OF_SIZE[ELEMENT[lay["dtype"]]] if xor else lay["dtype"]
        _need(seg.dtype == want and seg.shape == [lay["numel"]], path, None,
              f"{fmt} stream is {seg.dtype} {seg.shape}, the layout says {want} [{lay['numel']}]")
        _need(lay["name"].endswith("." + lay["dtype"]), path, None, "stream name does not end in its dtype")
    elif fmt == "kvj-dcp/1":
        if lay.get("name") == "metadata":
            _need(set(lay) == {"format", "model", "name"} and seg.dtype == "uint8" and len(seg.shape) == 1, path,
                  None, f"DCP metadata layout {lay}")
            doc = unpack(seg.raw, path, None)
            _need(set(doc) == {"format", "entries", "planner", "storage", "version"} and doc["format"] == fmt,
                  path, None, "DCP metadata fields")
        else:
            _need(set(lay) == {"format", "model", "fqn", "kind", "offset"} and lay["kind"] in ("tensor", "bytes"),
                  path, None, f"DCP shard layout {lay}")
            if lay["kind"] == "bytes":
                _need(lay["offset"] is None and seg.dtype == "uint8" and len(seg.shape) == 1, path, None,
                      "DCP bytes item")
            else:
                _need(isinstance(lay["offset"], list) and len(lay["offset"]) == len(seg.shape), path, None,
                      "DCP shard offset")
    return fmt


# ============================================================================ what records say

def check_segment_records(journal: Journal, store: Dict[str, Segment]) -> None:
    """Every segment record names a stored segment and says what its header says; KV blocks of
    kvj 0.1.0 cover their block's tokens and continue the request's tokens."""
    starts = {r.payload["id"]: r.payload for r in journal.records if r.rtype == 1}
    for rec in (r for r in journal.records if r.rtype == 2):
        p = rec.payload
        seg = store.get(p["key"])
        _need(seg is not None, rec.path, rec.offset, f"segment {p['key']} is not in the store")
        _need((p["raw_size"], p["stored_size"], p["codec"], p["digest"], p["layout"])
              == (seg.header["raw_size"], seg.header["stored_size"], seg.header["codec"], seg.key, seg.layout or {}),
              rec.path, rec.offset, "the record disagrees with the segment's header")
        fmt = check_layout(seg)
        if fmt != "kvj-kv-block/1":
            continue
        lay, b = seg.layout, p["seg"]
        bs = lay["block_size"]
        _need(p["tokens"] == [b * bs, (b + 1) * bs], rec.path, rec.offset, f"block {b} covers {p['tokens']}")
        start = starts.get(p["id"])
        if start is not None and start["tokens"] is not None:
            known = start["tokens"][b * bs:(b + 1) * bs + 1]
            _need(lay["token_ids"][:len(known)] == known, rec.path, rec.offset, "token_ids contradict the prompt")


def training_state(journal: Journal, store: Dict[str, Segment]) -> Tuple[int, Any]:
    """The newest training state (TRAINING STATE): its step, and the tree with each leaf as
    (dtype, shape, bytes)."""
    state = fold(journal.records, journal.snapshot[1] if journal.snapshot else None)
    ckpt = state["checkpoint"]
    _need(ckpt is not None and ckpt["meta"].get("format") == "kvj-train/2", journal.path, None,
          "no kvj-train/2 checkpoint")

    def streams_of(entry: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Tuple[str, bytes]]]:
        doc_seg = store[entry["keys"]["tree"]]
        _need(check_layout(doc_seg) == "kvj-train/2", doc_seg.path, None, "document layout")
        doc = unpack(doc_seg.raw, doc_seg.path, None)
        out = {n: (d, bytes(b)) for n, (d, b) in (doc.get("inline") or {}).items()}
        for k, key in entry["keys"].items():
            if k.startswith("s:"):
                seg = store[key]
                check_layout(seg)
                out[k[2:]] = (seg.layout["dtype"], seg.raw)
        return doc, out

    base_doc, base = streams_of(ckpt)
    for k, key in ckpt["keys"].items():
        _need(k == "tree" or (k.startswith("s:") and store[key].layout["format"] == "kvj-train-full/1"),
              journal.path, None, f"checkpoint key {k}")
    step, doc, streams = ckpt["step"], base_doc, base
    deltas = [d for d in state["deltas"] if d["base_step"] == ckpt["step"]]
    if deltas:
        delta = max(deltas, key=lambda d: d["step"])
        _need(delta["meta"].get("format") == "kvj-train/2", journal.path, None, "delta format")
        doc, got = streams_of(delta)
        _need(set(got) == set(base), journal.path, None, f"delta streams {sorted(got)}, base {sorted(base)}")
        whole = set(delta["meta"].get("whole", []))
        streams = {}
        for name, (dtype, data) in got.items():
            key = delta["keys"].get("s:" + name)
            fmt = store[key].layout["format"] if key else None
            _need((fmt == "kvj-train-full/1") == (name in whole) or key is None, journal.path, None,
                  f"stream {name}: {fmt}, whole lists {sorted(whole)}")
            if fmt == "kvj-train-xor/1":
                _need(store[key].layout["base_step"] == ckpt["step"], journal.path, None, "XOR against another base")
                data = (np.frombuffer(base[name][1], np.uint8) ^ np.frombuffer(data, np.uint8)).tobytes()
            streams[name] = (dtype, data)
        step = delta["step"]

    def leaf(i: int) -> Tuple[str, List[int], bytes]:
        name, offset, shape, _kind = doc["leaves"][i]
        dtype, data = streams[name]
        size = ELEMENT[dtype]
        n = math.prod(shape) if shape else 1
        return dtype, shape, data[offset * size:(offset + n) * size]

    def tree(node: Any) -> Any:
        if isinstance(node, dict):
            (tag, body), = node.items()
            if tag in ("t", "n"):
                return leaf(body)
            if tag == "d":
                return {tree(k): tree(v) for k, v in body}
            if tag == "u":
                return tuple(tree(v) for v in body)
            _need(tag == "l", journal.path, None, f"tree node {tag!r}")
            return [tree(v) for v in body]
        return node

    return step, tree(doc["tree"])


def dcp_checkpoint(journal: Journal, store: Dict[str, Segment]) -> Tuple[int, Dict[str, Any], List[Segment]]:
    """The newest DCP checkpoint (DCP CHECKPOINTS): step, metadata map, and its item segments."""
    ckpt = fold(journal.records, journal.snapshot[1] if journal.snapshot else None)["checkpoint"]
    _need(ckpt is not None and ckpt["meta"].get("format") == "kvj-dcp/1", journal.path, None, "no DCP checkpoint")
    md_seg = store[ckpt["keys"]["metadata"]]
    check_layout(md_seg)
    md = unpack(md_seg.raw, md_seg.path, None)
    n = len(ckpt["keys"]) - 1
    _need(set(ckpt["keys"]) == {"metadata"} | {f"shard-{i}" for i in range(n)}, journal.path, None, "DCP keys")
    items = [store[ckpt["keys"][f"shard-{i}"]] for i in range(n)]
    for seg in items:
        _need(check_layout(seg) == "kvj-dcp/1", seg.path, None, "DCP item layout")
    _need(sorted(s[3]["key"] for s in md["storage"]) == sorted(s.key for s in items), md_seg.path, None,
          "metadata storage does not name the checkpoint's items")
    return ckpt["step"], md, items
