"""Record types and their payload schemas, defined once (spec: man/kvj-journal.5, RECORDS).

Each type's payload is a ``msgspec.Struct``; on disk it is a MessagePack map with the
field names as keys. The same schema checks a record on every path: ``encode`` before
anything is appended (the typed ``Journal`` methods, ``Journal.append``, ``kvj record``),
``decode_payload`` when a record is read back, so a well-framed but malformed record is
refused at the call or reported as damage, never trusted. msgspec validates while it
decodes, in C; the checks types cannot express (names that become paths, token ranges,
string keys in nested maps) follow in ``_check``.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

import msgspec

from kvj.errors import FormatError, InvalidName
from kvj.names import check_key, check_request_id


class RecordType(IntEnum):
    START = 1  # request start
    SEGMENT = 2  # segment flush: a durable segment now covers a token range of a request
    END = 3  # request end
    ALLOC = 4  # device memory allocation
    FREE = 5  # device memory free
    CHECKPOINT = 6  # full training checkpoint
    DELTA = 7  # optimizer/model delta against a base step
    EPOCH = 8  # recovery epoch, written by recovery


#: Short names used by the CLI, NDJSON output and ``kvj record``.
NAMES: Dict[RecordType, str] = {
    RecordType.START: "start",
    RecordType.SEGMENT: "segment",
    RecordType.END: "end",
    RecordType.ALLOC: "alloc",
    RecordType.FREE: "free",
    RecordType.CHECKPOINT: "checkpoint",
    RecordType.DELTA: "delta",
    RecordType.EPOCH: "epoch",
}
BY_NAME: Dict[str, RecordType] = {v: k for k, v in NAMES.items()}


class Start(msgspec.Struct):
    id: str
    prompt_hash: Optional[str]
    tokens: Optional[List[int]]
    meta: Dict[str, Any]


class Segment(msgspec.Struct):
    id: str
    seg: int
    key: str
    tokens: List[int]  # [start, end): token positions covered
    layout: Dict[str, Any]
    raw_size: int
    stored_size: int
    digest: str
    codec: str


class End(msgspec.Struct):
    id: str
    status: str


class Alloc(msgspec.Struct):
    device: str
    addr: int
    size: int
    tag: str


class Free(msgspec.Struct):
    device: str
    addr: int


class Checkpoint(msgspec.Struct):
    step: int
    keys: Dict[str, str]  # tensor name -> segment key
    meta: Dict[str, Any]


class Delta(msgspec.Struct):
    step: int
    base_step: int
    keys: Dict[str, str]
    meta: Dict[str, Any]


class Epoch(msgspec.Struct):
    epoch: int
    recovered_lsn: int
    time: float  # Unix seconds
    manifest: Optional[str]


#: The schema: each record type's payload struct.
SCHEMA: Dict[RecordType, Type[msgspec.Struct]] = {
    RecordType.START: Start, RecordType.SEGMENT: Segment, RecordType.END: End, RecordType.ALLOC: Alloc,
    RecordType.FREE: Free, RecordType.CHECKPOINT: Checkpoint, RecordType.DELTA: Delta, RecordType.EPOCH: Epoch,
}

_DECODERS = {int(rtype): msgspec.msgpack.Decoder(struct) for rtype, struct in SCHEMA.items()}
_decode_any = msgspec.msgpack.Decoder().decode
_encode = msgspec.msgpack.Encoder().encode


def fields(rtype: RecordType) -> Tuple[str, ...]:
    """The payload field names of ``rtype``, in schema order."""
    return SCHEMA[rtype].__struct_fields__


def encode_payload(payload: Mapping[str, Any]) -> bytes:
    """MessagePack bytes of a payload map, unchecked (``encode`` checks against the schema)."""
    try:
        return _encode(payload)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FormatError(f"payload cannot be encoded: {exc}") from None


def encode(rtype: int, payload: Mapping[str, Any]) -> bytes:
    """Check a new record's payload against its type's schema and return its bytes.

    Stricter than reading: floats in nested maps must be finite too, so that what is
    journaled stays valid JSON for ``kvj inspect --json``. Raises ``FormatError``, or
    ``InvalidName`` for a request id or key that is unsafe as a path component.
    """
    if rtype not in _DECODERS:
        raise FormatError(f"unknown record type {rtype}")
    data = encode_payload(payload)
    _check(rtype, data, finite=True)
    return data


def decode_payload(rtype: int, data: bytes) -> Dict[str, Any]:
    """Decode and validate a payload. Unknown types are decoded but not validated."""
    try:
        payload = _decode_any(data)
    except msgspec.DecodeError as exc:
        raise FormatError(f"undecodable payload: {exc}") from None
    if not isinstance(payload, dict):
        raise FormatError("payload is not a map")
    if rtype in _DECODERS:
        _check(rtype, data, finite=False)
    else:
        _plain(payload, "payload", finite=False)
    return payload


def _check(rtype: int, data: bytes, finite: bool) -> None:
    """Validate encoded payload ``data`` of a known type: the schema, then what types cannot say."""
    name = NAMES[RecordType(rtype)]
    try:
        rec = _DECODERS[rtype].decode(data)
    except msgspec.ValidationError as exc:
        raise FormatError(f"{name} record: {exc}") from None
    except msgspec.DecodeError as exc:
        raise FormatError(f"undecodable payload: {exc}") from None
    try:
        if isinstance(rec, (Start, Segment, End)):
            check_request_id(rec.id)
        if isinstance(rec, Segment):
            tokens = rec.tokens
            if len(tokens) != 2 or not 0 <= tokens[0] <= tokens[1]:
                raise FormatError(f"segment record has bad token range {tokens!r}")
            check_key(rec.key)
            _plain(rec.layout, "layout", finite)
        elif isinstance(rec, Start):
            if rec.tokens is not None and any(t < 0 for t in rec.tokens):
                raise FormatError("start record has a negative token")
            _plain(rec.meta, "meta", finite)
        elif isinstance(rec, (Checkpoint, Delta)):
            for key in rec.keys.values():
                check_key(key)
            _plain(rec.meta, "meta", finite)
    except InvalidName as exc:
        if finite:  # a new record (``encode``): the caller passed an unsafe name
            raise
        raise FormatError(f"{name} record: {exc}") from None


_CONTAINERS = (dict, list)
_CONTAINERS_OR_FLOAT = (dict, list, float)
#: Leaves a nested map may hold: what JSON can show. Reading also accepts bytes (MessagePack
#: bin, which kvj 0.1.0 could write); nothing else (no extension types) is ever accepted.
_NEW_LEAVES = (type(None), bool, int, float, str)
_READ_LEAVES = _NEW_LEAVES + (bytes,)


def _plain(value: Any, where: str, finite: bool) -> None:
    """A nested map must hold only plain data with string keys throughout (it is shown as JSON
    and snapshotted); with ``finite`` (a new record), floats must be finite and bytes are refused.
    Only containers and floats are looked into: a flat map of scalars costs two type tests a value."""
    look = _CONTAINERS_OR_FLOAT if finite else _CONTAINERS
    leaves = _NEW_LEAVES if finite else _READ_LEAVES
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise FormatError(f"{where} has a non-string key {key!r}")
            if type(item) in look:
                _plain(item, f"{where}.{key}", finite)
            elif type(item) not in leaves:
                raise FormatError(f"{where}.{key} is a {type(item).__name__}, not plain data")
    elif type(value) is list:
        for index, item in enumerate(value):
            if type(item) in look:
                _plain(item, f"{where}[{index}]", finite)
            elif type(item) not in leaves:
                raise FormatError(f"{where}[{index}] is a {type(item).__name__}, not plain data")
    elif type(value) is float and not math.isfinite(value):
        raise FormatError(f"{where} is {value}: only finite numbers can be journaled")
