"""``kvj inspect``: records as a table or NDJSON, statistics, and pictures of a journal."""

from __future__ import annotations

import os
import sys
from collections import deque
from enum import Enum
from typing import Annotated, Callable, Deque, List, Optional

import typer
from rich.console import RenderableType

from kvj.cli.common import (
    JournalArg,
    JsonArg,
    StoreArg,
    emit_json,
    journal_path,
    out,
    parse_time,
    store_path,
    usage_error,
    warn_past_end,
)
from kvj.cli.render import (
    EXPORT_SUFFIXES,
    export,
    layout_picture,
    record_line,
    record_row,
    record_table,
    segment_view,
    stats_view,
    timeline_picture,
)
from kvj.cli.launch import on_interrupt
from kvj.errors import NotFound
from kvj.journal.follow import Follower
from kvj.journal.reader import list_logs
from kvj.journal.records import BY_NAME
from kvj.journal.replay import replay
from kvj.ops.inspection import Entries, Filter, Stats, file_windows, record_json, record_time

RecordTypeName = Enum("RecordTypeName", {name: name for name in BY_NAME}, type=str)  # type: ignore[misc]

FOLLOW_BACKLOG = 10


def _check_export(value: Optional[str]) -> Optional[str]:
    if value is not None and os.path.splitext(value)[1].lower() not in EXPORT_SUFFIXES:
        raise typer.BadParameter(f"{value} must end in .svg or .html")
    return value


def inspect(
    journal: JournalArg = None,
    request: Annotated[Optional[List[str]], typer.Option("--request", "-r", metavar="ID",
                                                         help="Only records of this request (repeatable).")] = None,
    rtype: Annotated[Optional[List[RecordTypeName]], typer.Option(
        "--type", "-t", case_sensitive=False, metavar="TYPE", show_choices=False,
        help="Only records of this type (repeatable): " + ", ".join(BY_NAME) + ".")] = None,
    from_lsn: Annotated[Optional[int], typer.Option("--from-lsn", metavar="LSN", min=0,
                                                    help="First LSN to show.")] = None,
    to_lsn: Annotated[Optional[int], typer.Option("--to-lsn", metavar="LSN", min=0, help="Last LSN to show.")] = None,
    since: Annotated[Optional[str], typer.Option(metavar="TIME", help="Only records written at or after TIME "
                                                 "(ISO 8601, @ and Unix seconds, or a duration ago like 10m).")] = None,
    until: Annotated[Optional[str], typer.Option(metavar="TIME",
                                                 help="Only records written at or before TIME.")] = None,
    last: Annotated[Optional[int], typer.Option("--last", "-n", min=1, metavar="N",
                                                help="Only the last N matching records.")] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing records as they become durable (like tail -f; starts with the last "
        "10 unless --last or --from-lsn).")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Counts and bytes by type, records per commit, "
                                        "compression ratio, largest requests.")] = False,
    layout: Annotated[bool, typer.Option("--layout", help="Draw the device memory map from alloc/free records "
                                         "(as of --at).")] = False,
    timeline: Annotated[bool, typer.Option("--timeline", help="Draw request lifetimes (as of --at).")] = False,
    at: Annotated[Optional[int], typer.Option("--at", metavar="LSN", min=0,
                                              help="Point in time for --layout and --timeline.")] = None,
    segment: Annotated[Optional[str], typer.Option("--segment", metavar="KEY", help="Show one segment's header "
                                                   "(dtype, shape, codec, sizes, digest, layout) and the records that "
                                                   "refer to it, without decoding it; KEY may be a prefix of 8+ hex "
                                                   "digits.")] = None,
    store: StoreArg = None,
    export_to: Annotated[Optional[str], typer.Option("--export", metavar="FILE", callback=_check_export,
                                                      help="Also write the table or picture to FILE "
                                                      "(.svg or .html) for an incident report.")] = None,
    as_json: JsonArg = False,
) -> None:
    """Show journal records: a table (one per line, pg_waldump style) or NDJSON with --json.

    Filter by request, type, LSN range and time. Each record carries the wall-clock time
    of its commit group, which --since/--until select on and the listing shows; records
    of kvj 0.1.0 (no times) match when the log file holding them was written in that
    window. --follow tails a live journal and never shows a record that is not completely
    written. --stats, --layout and --timeline summarise instead of listing (the timeline
    with a time axis); --export saves what is shown as SVG or HTML.
    """
    path = journal_path(journal)
    modes = [name for name, on in (("--follow", follow), ("--stats", stats), ("--layout", layout),
                                   ("--timeline", timeline), ("--segment", segment is not None)) if on]
    if len(modes) > 1:
        raise usage_error(f"{' and '.join(modes)} cannot be combined")
    if at is not None and not (layout or timeline):
        raise usage_error("--at applies to --layout and --timeline (use --to-lsn to cut a listing)")
    if follow and export_to is not None:
        raise usage_error("--follow cannot --export")
    if follow:
        on_interrupt(0, None)  # Ctrl-C is how one stops following, as with tail -f
    if segment is not None:
        _segment(path, store, segment, as_json)
        return
    if layout or timeline:
        state = replay(path, at_lsn=at)
        warn_past_end(at, state.last_lsn)
        if as_json:
            emit_json({"allocations": state.to_dict()["allocations"]} if layout else
                      {"requests": [_lifetime(r) for r in state.requests.values()], "epochs": state.epochs,
                       "last_lsn": state.last_lsn})
        else:
            _show(layout_picture(state, at) if layout else timeline_picture(state, columns=out.size.width, time_of=lsn_times(path)), export_to,
                  "kvj memory layout" if layout else "kvj request timeline")
        return
    flt = Filter(requests=set(request or []), types={BY_NAME[t.value] for t in rtype or []},
                 lsn_from=from_lsn, lsn_to=to_lsn,
                 since=parse_time(since, "--since") if since else None,
                 until=parse_time(until, "--until") if until else None)
    entries = Entries(path)
    windows = file_windows(list_logs(path))
    if stats:
        acc = Stats()
        for entry in entries:
            if flt(entry.record, record_time(entry.record, windows)):
                acc.add(entry)
        if as_json:
            emit_json(acc.to_dict())
        else:
            _show(stats_view(acc.to_dict(), path), export_to, "kvj journal statistics")
        return
    keep = last if last is not None else (FOLLOW_BACKLOG if follow and from_lsn is None else None)
    shown: Deque = deque(maxlen=keep)
    seen: Optional[int] = None
    table = record_table() if export_to is not None else None
    for entry in entries:
        seen = entry.record.lsn
        if not flt(entry.record, record_time(entry.record, windows)):
            continue
        if keep is None and table is None:
            _print_record(entry.record, as_json)
        else:
            shown.append(entry.record)
    for rec in shown:
        if table is not None:
            record_row(table, rec)
        _print_record(rec, as_json)
    if table is not None and export_to is not None:
        export(table, str(export_to), "kvj journal records")
    if follow:
        _follow(path, entries.after_lsn if seen is None else seen, flt, as_json)


def _segment(path: str, store: Optional[str], text: str, as_json: bool) -> None:
    """A segment's header and its users, without reading its chunks."""
    from kvj.ops.dump import resolve_key, segment_users
    from kvj.segments.check import opened_store

    root = store_path(path, store)
    with opened_store(root, root) as seg_store:
        if seg_store is None:
            raise NotFound(f"no segment store at {root}")
        key = resolve_key(seg_store, text)
        info = seg_store.info(key).to_dict()
    info["users"] = segment_users(replay(path), key)
    if as_json:
        emit_json(info)
        return
    out.print(segment_view(info))


def lsn_times(path: str) -> Callable[[int], Optional[float]]:
    """When each LSN was written, from the commit groups' times (None for kvj 0.1.0 records):
    one pass that keeps only the LSNs where the time changes."""
    import bisect

    firsts: List[int] = []
    stamps: List[Optional[float]] = []
    for entry in Entries(path):  # from the snapshot on: what it folded has no times left
        rec = entry.record
        if not stamps or rec.time != stamps[-1]:
            firsts.append(rec.lsn)
            stamps.append(rec.time)

    def time_of(lsn: int) -> Optional[float]:
        i = bisect.bisect_right(firsts, lsn) - 1
        return stamps[i] if i >= 0 else None
    return time_of


def _lifetime(req) -> dict:  # type: ignore[no-untyped-def]
    return {"id": req.id, "start_lsn": req.start_lsn, "end_lsn": req.end_lsn, "status": req.status,
            "segment_lsns": sorted(r.lsn for r in req.segments.values()), "resume_position": req.resume_position}


def _print_record(rec, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    if as_json:
        emit_json(record_json(rec))
    else:
        out.print(record_line(rec))


def _show(renderable: RenderableType, export_to: Optional[str], title: str) -> None:
    out.print(renderable)
    if export_to is not None:
        export(renderable, str(export_to), title)


def _follow(path: str, after_lsn: int, flt: Filter, as_json: bool) -> None:
    """Print matching records as they become durable, until interrupted."""
    follower = Follower(path, after_lsn=after_lsn)
    try:
        for rec in follower.follow():
            if flt(rec):
                _print_record(rec, as_json)
                sys.stdout.flush()
    except KeyboardInterrupt:  # the normal way to stop following
        return
