"""Record types and their payload schemas, defined once (spec: man/kvj-journal.5, RECORDS).

Each type's payload is a ``msgspec.Struct``; on disk it is a MessagePack map with the
field names as keys. The same schema checks a record on every path: ``encode`` before
anything is appended (the typed ``Journal`` methods, ``Journal.append``, ``kvj record``),
``decode_payload`` when a record is read back (``decode_fields`` for replay's fold: the same
checks, one decode), so a well-framed but malformed record is
refused at the call or reported as damage, never trusted. msgspec checks the types in C,
converting a new payload or decoding a stored one; what types cannot express (names that
become paths, token order, plain data in nested maps) is each struct's ``check``.
"""

from __future__ import annotations

import math
import types
from enum import IntEnum
from typing import Annotated, Any, Dict, List, Mapping, Optional, Set, Tuple, Type, Union

import msgspec

from kvj.errors import FormatError, InvalidName
from kvj.journal.framing import MAX_RECORD_PAYLOAD
from kvj.names import ID_RE, check_key, check_request_id


class RecordType(IntEnum):
    START = 1  # request start
    SEGMENT = 2  # segment flush: a durable segment now covers a token range of a request
    END = 3  # request end
    ALLOC = 4  # device memory allocation
    FREE = 5  # device memory free
    CHECKPOINT = 6  # full training checkpoint
    DELTA = 7  # optimizer/model delta against a base step
    EPOCH = 8  # recovery epoch, written by recovery
    TOKENS = 9  # tokens a request generated (durable whatever its KV)
    HANDOFF = 10  # request end: handed off to another engine, which continues it
    REPLY = 11  # a served reply finished (kvj serve's reply journal): its status and where it stopped


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
    RecordType.TOKENS: "tokens",
    RecordType.HANDOFF: "handoff",
    RecordType.REPLY: "reply",
}
BY_NAME: Dict[str, RecordType] = {v: k for k, v in NAMES.items()}


#: Token positions and ids are non-negative (checked by msgspec while converting).
Token = Annotated[int, msgspec.Meta(ge=0)]


class Schema(msgspec.Struct, gc=False, omit_defaults=True):
    """A record type's payload. msgspec checks the field types; ``check`` adds what types cannot say.
    A field left at its default is not written (the spec: an epoch has a salvage map only when one was made).
    (Not tracked by the cycle collector: one is built per record and dropped at once, and it
    never holds itself.)"""

    def check(self, new: bool) -> None:
        """Raise ``FormatError`` (``InvalidName`` for an unsafe name) for what types cannot express.
        ``new``: a record about to be appended, whose maps must also hold only finite numbers."""


#: The test of ``check_request_id`` on the hot path (a record a call): the checker runs only to
#: raise, saying why. Ids found valid are remembered (a request's id is in each of its records,
#: and a set lookup costs a fifth of the match), up to ``_GOOD_IDS_MAX`` of them.
_id_ok = ID_RE.fullmatch
_GOOD_IDS: Set[str] = set()
_GOOD_IDS_MAX = 1 << 16
#: ``check_key``'s test without a regex: 64 characters, none left once hex digits are stripped.
_HEX = "0123456789abcdef"


def _check_id(request_id: str) -> None:
    """``check_request_id`` for a decoded id (a str) not seen valid yet; it is remembered."""
    if _id_ok(request_id) is None:
        check_request_id(request_id)
    if len(_GOOD_IDS) >= _GOOD_IDS_MAX:
        _GOOD_IDS.clear()
    _GOOD_IDS.add(request_id)


class Start(Schema):
    id: str
    prompt_hash: Optional[str]
    tokens: Optional[List[Token]]
    meta: Dict[str, Any]

    def check(self, new: bool) -> None:
        if self.id not in _GOOD_IDS:
            _check_id(self.id)
        if not (_FLAT_NEW if new else _FLAT_READ).issuperset(map(type, self.meta.values())):
            _walk(self.meta, "meta", new)


class Segment(Schema):
    id: str
    seg: int
    key: str
    tokens: Tuple[Token, Token]  # [start, end): positions covered (a tuple, as a segment ref keeps it)
    layout: Dict[str, Any]
    raw_size: int
    stored_size: int
    digest: str
    codec: str

    def check(self, new: bool) -> None:
        if self.id not in _GOOD_IDS:
            _check_id(self.id)
        if len(self.key) != 64 or self.key.strip(_HEX):
            check_key(self.key)
        if new and self.seg < 0:  # read back, a negative number is kept: kvj 0.1.0 wrote what it was given
            raise FormatError(f"segment record has negative segment number {self.seg}")
        if self.tokens[0] > self.tokens[1]:
            raise FormatError(f"segment record has bad token range {self.tokens!r}")
        if not (_FLAT_NEW if new else _FLAT_READ).issuperset(map(type, self.layout.values())):
            _walk(self.layout, "layout", new)


class End(Schema):
    id: str
    status: str

    def check(self, new: bool) -> None:
        if self.id not in _GOOD_IDS:
            _check_id(self.id)


class Alloc(Schema):
    device: str
    addr: int
    size: int
    tag: str


class Free(Schema):
    device: str
    addr: int


class Checkpoint(Schema):
    step: int
    keys: Dict[str, str]  # tensor name -> segment key
    meta: Dict[str, Any]

    def check(self, new: bool) -> None:
        for key in self.keys.values():
            check_key(key)
        _plain(self.meta, "meta", new)


class Delta(Schema):
    step: int
    base_step: int
    keys: Dict[str, str]
    meta: Dict[str, Any]

    check = Checkpoint.check


class Epoch(Schema):
    epoch: int
    recovered_lsn: int
    time: float  # Unix seconds
    manifest: Optional[str]
    salvage: Optional[Dict[str, Any]] = None  # a salvaging recovery's decision: what it set aside and lost


class Tokens(Schema):
    id: str
    at: Annotated[int, msgspec.Meta(ge=0)]  # position of the first of them in the request's tokens
    tokens: Annotated[List[Token], msgspec.Meta(min_length=1)]

    def check(self, new: bool) -> None:
        check_request_id(self.id)


class Handoff(Schema):
    id: str
    to: str  # the engine that continues it (the name the operator gave the handoff)

    def check(self, new: bool) -> None:
        check_request_id(self.id)
        check_request_id(self.to)  # an engine's name: the characters of a request id


class Reply(Schema):
    id: str
    status: str  # completed, incomplete, cancelled, failed or handoff
    count: Token  # tokens that belong to the reply (a cancelled one's: those released before the cancel)
    at: float  # Unix seconds: when it finished (its retention runs from here)
    finish_reason: Optional[str] = None
    stop_reason: Union[None, int, str] = None  # the stop string or stop token id, as vLLM reports it
    cached_tokens: Token = 0  # prompt tokens whose KV was not computed for it (loaded or cached)
    to: Optional[str] = None  # with status handoff: the engine that continues it

    def check(self, new: bool) -> None:
        check_request_id(self.id)
        if not math.isfinite(self.at):
            raise FormatError(f"reply record of {self.id}: time {self.at} is not finite")
        if self.to is not None:
            check_request_id(self.to)


#: The schema: each record type's payload struct.
SCHEMA: Dict[RecordType, Type[Schema]] = {
    RecordType.START: Start, RecordType.SEGMENT: Segment, RecordType.END: End, RecordType.ALLOC: Alloc,
    RecordType.FREE: Free, RecordType.CHECKPOINT: Checkpoint, RecordType.DELTA: Delta, RecordType.EPOCH: Epoch,
    RecordType.TOKENS: Tokens, RecordType.HANDOFF: Handoff, RecordType.REPLY: Reply,
}

_STRUCTS: Dict[int, Type[Schema]] = {int(rtype): struct for rtype, struct in SCHEMA.items()}
_DECODERS = {int(rtype): msgspec.msgpack.Decoder(struct) for rtype, struct in SCHEMA.items()}
#: Decoders of payloads holding only their type's fields (``decode_fields``): a subclass of each
#: struct that refuses unknown fields, which msgspec would skip without checking their bytes.
_EXACT_DECODERS = {int(rtype): msgspec.msgpack.Decoder(types.new_class(struct.__name__, (struct,),
                                                                       {"forbid_unknown_fields": True}))
                   for rtype, struct in SCHEMA.items()}
_decode_any = msgspec.msgpack.Decoder().decode
_encode = msgspec.msgpack.Encoder().encode
_convert = msgspec.convert


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

    One conversion in C builds the typed struct and checks every field's type; the struct's
    ``check`` adds names, token order and plain, finite data in nested maps (stricter than
    reading, so that what is journaled stays valid JSON for ``kvj inspect --json``); the
    struct is what is encoded, and must fit ``MAX_RECORD_PAYLOAD``. Raises ``FormatError``,
    or ``InvalidName`` for a request id or key that is unsafe as a path component.
    """
    struct = _STRUCTS.get(rtype)
    if struct is None:
        raise FormatError(f"unknown record type {rtype}")
    try:
        rec = _convert(payload, struct)
    except msgspec.ValidationError as exc:
        raise FormatError(f"{NAMES[RecordType(rtype)]} record: {exc}") from None
    if len(payload) != len(struct.__struct_fields__) or struct.__struct_defaults__:  # defaults may be left out
        unknown = ", ".join(repr(k) for k in payload if k not in struct.__struct_fields__)
        if unknown:
            raise FormatError(f"{NAMES[RecordType(rtype)]} record: unknown field {unknown}")
    try:
        rec.check(True)
        data = _encode(rec)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FormatError(f"{NAMES[RecordType(rtype)]} record cannot be encoded: {exc}") from None
    except RecursionError:
        raise FormatError(f"{NAMES[RecordType(rtype)]} record: a map is nested too deeply (or holds itself)") from None
    if len(data) > MAX_RECORD_PAYLOAD:  # a reader would take it for damage: refused here, never acknowledged
        raise FormatError(f"{NAMES[RecordType(rtype)]} record is {len(data)} bytes, more than the "
                          f"{MAX_RECORD_PAYLOAD >> 20} MiB a record may hold: keep large data in segments")
    return data


def decode_payload(rtype: int, data: bytes) -> Dict[str, Any]:
    """Decode and validate a payload. A record of an unknown type is checked only for plain
    data; unknown fields of a known type are kept and ignored."""
    try:
        payload = _decode_any(data)
    except msgspec.DecodeError as exc:
        raise FormatError(f"undecodable payload: {exc}") from None
    except RecursionError:
        raise FormatError("payload is nested too deeply") from None
    if not isinstance(payload, dict):
        raise FormatError("payload is not a map")
    decoder = _DECODERS.get(rtype)
    try:
        if decoder is None:
            _walk(payload, "payload", False)
        else:
            decoder.decode(data).check(False)
    except (msgspec.DecodeError, InvalidName) as exc:  # read back, an unsafe name is damage
        raise FormatError(f"{_name(rtype)} record: {exc}") from None
    except RecursionError:
        raise FormatError(f"{_name(rtype)} record: a map is nested too deeply") from None
    return payload


def decode_fields(rtype: int, data: bytes) -> Any:
    """Decode and validate a payload, for replay's fold, refusing exactly what ``decode_payload``
    refuses (``FormatError``). A known type's payload with no field this kvj does not know (what
    kvj writes) is decoded once, into its type's struct: msgspec checks the types while decoding,
    ``check`` the rest. Any other payload (unknown fields, an unknown type, damage) goes the way
    of ``decode_payload`` and is returned as its map. ``JournalState.apply`` takes either."""
    decoder = _EXACT_DECODERS.get(rtype)
    if decoder is None:
        return decode_payload(rtype, data)
    try:
        fields = decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return decode_payload(rtype, data)
    try:
        fields.check(False)
    except InvalidName as exc:  # read back, an unsafe name is damage
        raise FormatError(f"{_name(rtype)} record: {exc}") from None
    except RecursionError:
        raise FormatError(f"{_name(rtype)} record: a map is nested too deeply") from None
    return fields


def _name(rtype: int) -> str:
    """A record type's name in messages ("type N" for one this kvj does not know)."""
    return NAMES[RecordType(rtype)] if rtype in _STRUCTS else f"type {rtype}"


_CONTAINERS = (dict, list)
_CONTAINERS_OR_FLOAT = (dict, list, float)
#: Leaves a nested map may hold: what JSON can show. Reading also accepts bytes (MessagePack
#: bin, which kvj 0.1.0 could write); nothing else (no extension types) is ever accepted.
_NEW_LEAVES = (type(None), bool, int, float, str)
_READ_LEAVES = _NEW_LEAVES + (bytes,)
#: Values a flat map may hold without a closer look (floats of a new record need one: finite?).
_FLAT_NEW = frozenset((type(None), bool, int, str))
_FLAT_READ = frozenset(_READ_LEAVES)


def _plain(value: Dict[str, Any], where: str, new: bool) -> None:
    """Check a map whose keys msgspec already checked are strings: one pass in C over the
    types of its values for the usual flat map of scalars, else the walk of ``_walk``
    (written out in the checks of start and segment records, the most frequent)."""
    if not (_FLAT_NEW if new else _FLAT_READ).issuperset(map(type, value.values())):
        _walk(value, where, new)


def _walk(value: Any, where: str, finite: bool) -> None:
    """Nested maps must hold only plain data with string keys throughout (they are shown as JSON
    and snapshotted); with ``finite`` (a new record), floats must be finite and bytes are refused.
    Only containers and floats are looked into."""
    look = _CONTAINERS_OR_FLOAT if finite else _CONTAINERS
    leaves = _NEW_LEAVES if finite else _READ_LEAVES
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise FormatError(f"{where} has a non-string key {key!r}")
            if type(item) in look:
                _walk(item, f"{where}.{key}", finite)
            elif type(item) not in leaves:
                raise FormatError(f"{where}.{key} is a {type(item).__name__}, not plain data")
    elif type(value) is list:
        for index, item in enumerate(value):
            if type(item) in look:
                _walk(item, f"{where}[{index}]", finite)
            elif type(item) not in leaves:
                raise FormatError(f"{where}[{index}] is a {type(item).__name__}, not plain data")
    elif type(value) is float and not math.isfinite(value):
        raise FormatError(f"{where} is {value}: only finite numbers can be journaled")
