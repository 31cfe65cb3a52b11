"""Record types and their payload schemas (spec: man/kvj-journal.5, RECORDS).

Payloads are msgpack maps with short string keys. ``validate`` checks a decoded payload
against its type's schema so a well-framed but malformed record is reported, not trusted.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Dict, Mapping, Tuple

import msgpack

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

_INT = (int,)
_STR = (str,)
_OPT_STR = (str, type(None))
_LIST = (list, tuple)
_OPT_LIST = (list, tuple, type(None))
_DICT = (dict,)
_NUM = (int, float)

#: Required fields per type: name -> accepted Python types after msgpack decoding.
SCHEMA: Dict[RecordType, Dict[str, Tuple[type, ...]]] = {
    RecordType.START: {"id": _STR, "prompt_hash": _OPT_STR, "tokens": _OPT_LIST, "meta": _DICT},
    RecordType.SEGMENT: {"id": _STR, "seg": _INT, "key": _STR, "tokens": _LIST, "layout": _DICT,
                         "raw_size": _INT, "stored_size": _INT, "digest": _STR, "codec": _STR},
    RecordType.END: {"id": _STR, "status": _STR},
    RecordType.ALLOC: {"device": _STR, "addr": _INT, "size": _INT, "tag": _STR},
    RecordType.FREE: {"device": _STR, "addr": _INT},
    RecordType.CHECKPOINT: {"step": _INT, "keys": _DICT, "meta": _DICT},
    RecordType.DELTA: {"step": _INT, "base_step": _INT, "keys": _DICT, "meta": _DICT},
    RecordType.EPOCH: {"epoch": _INT, "recovered_lsn": _INT, "time": _NUM, "manifest": _OPT_STR},
}

def encode_payload(payload: Mapping[str, Any]) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


def decode_payload(rtype: int, data: bytes) -> Dict[str, Any]:
    """Decode and validate a payload. Unknown types are decoded but not validated."""
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise FormatError(f"undecodable payload: {exc}") from None
    if not isinstance(payload, dict):
        raise FormatError("payload is not a map")
    try:
        schema = SCHEMA[RecordType(rtype)]
    except ValueError:
        return payload
    for name, types in schema.items():
        if name not in payload:
            raise FormatError(f"{NAMES[RecordType(rtype)]} record lacks field {name!r}")
        value = payload[name]
        if not isinstance(value, types) or (types is _INT and isinstance(value, bool)):
            raise FormatError(f"{NAMES[RecordType(rtype)]} record field {name!r} has type {type(value).__name__}")
    if rtype in (RecordType.START, RecordType.SEGMENT, RecordType.END):
        try:
            check_request_id(payload["id"])
        except InvalidName as exc:
            raise FormatError(str(exc)) from None
    if rtype == RecordType.SEGMENT:
        tokens = payload["tokens"]
        if (len(tokens) != 2 or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
                or not 0 <= tokens[0] <= tokens[1]):
            raise FormatError(f"segment record has bad token range {tokens!r}")
        try:
            check_key(payload["key"])
        except InvalidName as exc:
            raise FormatError(str(exc)) from None
    return payload
