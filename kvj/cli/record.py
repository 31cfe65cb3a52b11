"""``kvj record``: append records durably from a shell or from NDJSON on stdin."""

from __future__ import annotations

import re
import sys
from typing import Annotated, Any, Dict, List, Optional, Tuple

import typer

from kvj.cli.options import (JournalArg, JsonArg, MirrorArg, MirrorPolicyArg, StoreArg, journal_path, store_path,
                             usage_and_exit)
from kvj.cli.output import done, emit_json, out
from kvj.cli.parse import loads_strict, parse_pairs
from kvj.errors import FormatError, InvalidArgument, KvjError
from kvj.journal.journal import Journal
from kvj.journal.legacy import convert_legacy
from kvj.journal.records import BY_NAME, NAMES, RecordType, encode
from kvj.names import check_request_id

app = typer.Typer(no_args_is_help=False, help="""Append records to the journal; exits only once they are durable.

One record from the command line (kvj record start ID, kvj record end ID, ...) or many
from NDJSON (kvj record ndjson < records.ndjson). Takes the writer lock, so it fails
while a writer holds the journal. Records that point at segments (checkpoint, delta,
segment) are refused unless the store holds those segments.
""")

@app.callback(invoke_without_command=True)
def record(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        usage_and_exit(ctx)


MetaOpt = Annotated[Optional[List[str]], typer.Option("--meta", metavar="KEY=VALUE",
                                                      help="Metadata entry (repeatable); JSON values keep their type.")]
KeysOpt = Annotated[List[str], typer.Option("--key", metavar="NAME=KEY",
                                            help="Tensor name and its segment key (repeatable).")]

#: Fields ``kvj inspect --json`` adds to a record; ignored on input so its output can be fed back.
LOCATION_FIELDS = ("lsn", "time", "file", "offset")


def _append(journal: Optional[str], store: Optional[str], records: List[Tuple[int, Dict[str, Any]]],
            as_json: bool, mirror: Optional[str], mirror_policy: str) -> None:
    """Validate, append (as one commit group where they fit in one) and sync ``records``;
    print their LSNs."""
    from kvj.segments.check import require_segments

    path = journal_path(journal, writing=True)
    keys = [key for rtype, payload in records for key in _segment_keys(rtype, payload)]
    if keys:
        require_segments(store_path(path, store), keys)
    with Journal.open(path, create=False, mirror=mirror,
                      mirror_policy=mirror_policy) as j:
        lsns = j.append_many(records)
        j.sync()
    if lsns:
        done(f"{len(lsns)} records durable in {path} (LSN {lsns[0]}..{lsns[-1]})")
    if as_json:
        for (rtype, _payload), lsn in zip(records, lsns):
            emit_json({"lsn": lsn, "type": NAMES[RecordType(rtype)], "durable": True})
    elif len(lsns) == 1:
        out.print(f"LSN {lsns[0]} durable", markup=False)
    elif lsns:
        out.print(f"{len(lsns)} records durable, LSN {lsns[0]}..{lsns[-1]}", markup=False)
    else:
        out.print("no records", markup=False)


def _segment_keys(rtype: int, payload: Dict[str, Any]) -> List[Tuple[str, Optional[str]]]:
    """(key, digest the record claims) for every segment a record points at."""
    if rtype == RecordType.SEGMENT:
        return [(payload["key"], payload.get("digest"))]
    if rtype in (RecordType.CHECKPOINT, RecordType.DELTA):
        return [(key, None) for key in payload["keys"].values()]
    return []


#: Fields a record may leave out, with the value the typed ``Journal`` methods default to.
OPTIONAL = {
    RecordType.START: {"prompt_hash": None, "tokens": None, "meta": {}},
    RecordType.END: {"status": "ok"},
    RecordType.ALLOC: {"tag": ""},
    RecordType.CHECKPOINT: {"meta": {}},
    RecordType.DELTA: {"meta": {}},
}

#: Token ids are stored as MessagePack unsigned integers.
MAX_TOKEN = (1 << 64) - 1


def _checked(rtype: int, payload: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
    """Fill optional fields and validate a record against its type's schema (a bad request id
    is InvalidName; a bad token list FormatError)."""
    payload = {**OPTIONAL.get(RecordType(rtype), {}), **payload}
    if "id" in payload:
        check_request_id(payload["id"])
    if rtype == RecordType.START and payload["tokens"] is not None:
        tokens = payload["tokens"]
        if not isinstance(tokens, list) or not all(
                type(t) is int and 0 <= t <= MAX_TOKEN for t in tokens):  # noqa: E721 - bool is no token
            raise FormatError(f"'tokens' must be a list of integers from 0 to 2^64-1, not {_short(tokens)}")
    encode(rtype, payload)  # the check every new record gets (finite numbers only), before anything is appended
    return rtype, payload


def _argument(rtype: int, payload: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
    """``_checked`` for a record built from command-line arguments: what it refuses is a usage
    error (64), not malformed input (65)."""
    try:
        return _checked(rtype, payload)
    except FormatError as exc:
        raise InvalidArgument(str(exc)) from None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_tokens(text: str) -> List[int]:
    """``--tokens 1,2,3``: non-negative integers separated by single commas (``1,,2`` is an error)."""
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of non-negative integers",
                                 param_hint="--tokens")
    tokens = [int(t) for t in text.split(",")]
    if any(t > MAX_TOKEN for t in tokens):
        raise typer.BadParameter("token ids go up to 2^64-1", param_hint="--tokens")
    return tokens


@app.command()
def start(request: Annotated[str, typer.Argument(help="Request id.")],
          journal: JournalArg = None,
          prompt_hash: Annotated[Optional[str], typer.Option(help="Hash of the prompt.")] = None,
          tokens: Annotated[Optional[str], typer.Option(metavar="ID,ID,...",
                                                        help="Prompt token ids, comma-separated.")] = None,
          meta: MetaOpt = None, as_json: JsonArg = False,
          mirror: MirrorArg = None, mirror_policy: MirrorPolicyArg = "fail") -> None:
    """Record that a request started."""
    token_ids = parse_tokens(tokens) if tokens is not None else None
    _append(journal, None, [_argument(RecordType.START, {"id": request, "prompt_hash": prompt_hash,
                                                        "tokens": token_ids, "meta": parse_pairs(meta, "--meta")})],
            as_json, mirror, mirror_policy)


@app.command()
def end(request: Annotated[str, typer.Argument(help="Request id.")],
        journal: JournalArg = None,
        status: Annotated[str, typer.Option(help="How it ended (ok, aborted, error, ...).")] = "ok",
        as_json: JsonArg = False,
        mirror: MirrorArg = None, mirror_policy: MirrorPolicyArg = "fail") -> None:
    """Record that a request ended (its segments become collectable)."""
    _append(journal, None, [_argument(RecordType.END, {"id": request, "status": status})],
            as_json, mirror, mirror_policy)


@app.command()
def checkpoint(step: Annotated[int, typer.Argument(min=0, help="Training step.")],
               key: KeysOpt, journal: JournalArg = None, store: StoreArg = None,
               meta: MetaOpt = None, as_json: JsonArg = False,
               mirror: MirrorArg = None, mirror_policy: MirrorPolicyArg = "fail") -> None:
    """Record a full training checkpoint whose tensors are already in the store."""
    keys = parse_pairs(key, "--key", typed=False)
    _append(journal, store, [_argument(RecordType.CHECKPOINT, {"step": step, "keys": keys,
                                                              "meta": parse_pairs(meta, "--meta")})],
            as_json, mirror, mirror_policy)


@app.command()
def delta(step: Annotated[int, typer.Argument(min=0, help="Training step.")],
          base_step: Annotated[int, typer.Argument(min=0, help="Step the delta applies to.")],
          key: KeysOpt, journal: JournalArg = None, store: StoreArg = None,
          meta: MetaOpt = None, as_json: JsonArg = False,
          mirror: MirrorArg = None, mirror_policy: MirrorPolicyArg = "fail") -> None:
    """Record an optimizer/model delta against the state at BASE_STEP."""
    _append(journal, store, [_argument(RecordType.DELTA, {"step": step, "base_step": base_step,
                                                         "keys": parse_pairs(key, "--key", typed=False),
                                                         "meta": parse_pairs(meta, "--meta")})],
            as_json, mirror, mirror_policy)


@app.command()
def ndjson(source: Annotated[str, typer.Argument(metavar="FILE", help="NDJSON file, or - for stdin.")] = "-",
           journal: JournalArg = None, store: StoreArg = None, as_json: JsonArg = False,
           mirror: MirrorArg = None, mirror_policy: MirrorPolicyArg = "fail") -> None:
    """Append many records from NDJSON, all validated before any is appended.

    One object per line: {"type": "start", "id": "req-1", "prompt_hash": null,
    "tokens": null, "meta": {}}, with the fields of that record type (man kvj-journal(5)).
    Types: start, end, alloc, free, checkpoint, delta, segment. The fields lsn, time, file
    and offset that kvj inspect --json prints are ignored, so its output can be fed back.
    Seed-era lines ({"op": "start", ...}, {"op": "end", ...}) are accepted as the records
    kvj migrate makes of them.
    """
    stream = sys.stdin if source == "-" else open(source, encoding="utf-8")
    try:
        records = list(parse_ndjson(stream))
    finally:
        if stream is not sys.stdin:
            stream.close()
    _append(journal, store, records, as_json, mirror, mirror_policy)


def parse_ndjson(lines: Any) -> Any:
    """Yield (type, payload) from NDJSON lines; a bad line raises ``FormatError`` naming it.

    Seed-era lines (``{"op": "start"|"end", ...}``) are taken as the records kvj migrate
    makes of them, so a program that writes the seed's format can still pipe it in.
    """
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = loads_strict(line)
            if not isinstance(obj, dict):
                raise FormatError("not a JSON object")
            if "type" not in obj and "op" in obj:
                yield _seed_era(obj)
                continue
            if "type" not in obj:
                raise FormatError('neither a kvj record ({"type": ...}) nor a seed-era one ({"op": ...})')
            name = obj.pop("type")
            rtype = BY_NAME.get(name) if isinstance(name, str) else None
            if rtype is None or rtype == RecordType.EPOCH:
                allowed = ", ".join(n for t, n in NAMES.items() if t != RecordType.EPOCH)
                raise FormatError(f"'type' must be one of {allowed}, not {name!r}")
            for location in LOCATION_FIELDS:
                obj.pop(location, None)
            yield _checked(rtype, obj)
        except (ValueError, KvjError) as exc:
            raise FormatError(f"NDJSON line {lineno}: {exc}") from None


def _seed_era(obj: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
    """A seed-era line as the kvj record kvj migrate writes for it (``convert_legacy``); a
    ``seg_flush`` is refused as kvj migrate refuses it: it points into the seed's KV file."""
    rtype, payload = convert_legacy(obj)
    if rtype == RecordType.SEGMENT:
        raise FormatError("a seed-era seg_flush points at bytes in the seed's KV file (ptr), which a kvj journal "
                          "cannot refer to: store the KV with kvj flush; seed-era start and end lines are accepted")
    return _checked(rtype, payload)
