"""``kvj inspect``: records as a table or NDJSON, statistics, and segment headers of a journal."""

from __future__ import annotations

import os
import sys
from collections import deque
from enum import Enum
from typing import Annotated, Any, Deque, Dict, Iterator, List, Optional, Tuple

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvj.cli.options import JournalArg, JsonArg, StoreArg, engine_ranks, journal_path, store_path, usage_error
from kvj.cli.output import emit_json, out
from kvj.cli.parse import parse_time
from kvj.cli.render import EXPORT_SUFFIXES, export, record_line, record_row, record_table, segment_view, stats_view
from kvj.cli.launch import on_interrupt
from kvj.errors import NotFound
from kvj.journal.follow import Follower
from kvj.journal.reader import list_logs
from kvj.journal.records import BY_NAME
from kvj.journal.replay import replay
from kvj.ops.inspection import (Entries, Filter, Stats, engine_stats, file_windows, human_size, record_json,
                                record_time)

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
    segment: Annotated[Optional[str], typer.Option("--segment", metavar="KEY", help="Show one segment's header "
                                                   "(dtype, shape, codec, sizes, digest, layout) and the records that "
                                                   "refer to it, without decoding it; KEY may be a prefix of 8+ hex "
                                                   "digits.")] = None,
    store: StoreArg = None,
    export_to: Annotated[Optional[str], typer.Option("--export", metavar="FILE", callback=_check_export,
                                                      help="Also write the table or statistics to FILE "
                                                      "(.svg or .html) for an incident report.")] = None,
    as_json: JsonArg = False,
) -> None:
    """Show journal records: a table (one per line, pg_waldump style) or NDJSON with --json.

    Filter by request, type, LSN range and time. Each record carries the wall-clock time
    of its commit group, which --since/--until select on and the listing shows; records
    of kvj 0.1.0 (no times) match when the log file holding them was written in that
    window. --follow tails a live journal and never shows a record that is not completely
    written. --stats summarises instead of listing; --export saves what is shown as SVG
    or HTML.

    A tensor/pipeline-parallel vLLM engine's directory (one journal per rank,
    JOURNAL/rank-T-P/) is shown rank by rank, each under its name (LSNs and --last are
    each rank's own), then a line for the engine; in JSON each record carries its
    "rank", and --stats and --segment print one object with "ranks" (and for --stats
    "totals"). --follow takes one rank's journal.
    """
    path = journal_path(journal, ranks_ok=True)
    ranks = engine_ranks(path, store)
    modes = [name for name, on in (("--follow", follow), ("--stats", stats), ("--segment", segment is not None)) if on]
    if len(modes) > 1:
        raise usage_error(f"{' and '.join(modes)} cannot be combined")
    if follow and export_to is not None:
        raise usage_error("--follow cannot --export")
    if follow and ranks is not None:
        raise usage_error(f"--follow follows one journal: give one rank's, -j {os.path.join(path, ranks[0][0])}")
    if follow:
        on_interrupt(0, None)  # Ctrl-C is how one stops following, as with tail -f
    engine = _Engine(path, ranks, as_json)
    if segment is not None:
        if ranks is None:
            _segment(path, store, segment, as_json)
        else:
            _segment_engine(engine, segment)
        return
    flt = Filter(requests=set(request or []), types={BY_NAME[t.value] for t in rtype or []},
                 lsn_from=from_lsn, lsn_to=to_lsn,
                 since=parse_time(since, "--since") if since else None,
                 until=parse_time(until, "--until") if until else None)
    if stats:
        accs = {journal: _stats(journal, flt) for journal in engine.journals().values()}
        totals = engine_stats(list(accs.values())) if ranks is not None else None
        if as_json:
            engine.emit({journal: acc.to_dict() for journal, acc in accs.items()}, totals)
        else:
            _show(engine.view({journal: stats_view(acc.to_dict(), journal) for journal, acc in accs.items()},
                              totals and f"{totals['records']:,} records, {human_size(totals['bytes'])}, "
                              f"{totals['commit_groups']:,} commit groups, {totals['requests']:,} requests"),
                  export_to, "kvj journal statistics")
        return
    keep = last if last is not None else (FOLLOW_BACKLOG if follow and from_lsn is None else None)
    tables: Dict[str, RenderableType] = {}
    shown = 0
    for name, journal in engine.sections():
        if journal is None:
            continue
        table = record_table() if export_to is not None else None
        entries, seen, count = _list(journal, flt, keep, table, as_json, name)
        shown += count
        if table is not None:
            tables[journal] = table
    if ranks is not None and not as_json:
        out.print(engine.summary(f"{shown:,} records shown"))
    if export_to is not None:
        export(engine.view(tables, f"{shown:,} records shown"), str(export_to), "kvj journal records")
    if follow:
        _follow(path, entries.after_lsn if seen is None else seen, flt, as_json)


def _list(path: str, flt: Filter, keep: Optional[int], table: Optional[Table], as_json: bool,
          rank: Optional[str]) -> Tuple[Entries, Optional[int], int]:
    """Print the records of the journal at ``path`` that ``flt`` matches (the last ``keep`` of
    them), adding them to ``table`` for --export; returns its entries, the last LSN read and how
    many records were shown. A rank journal's records carry its ``rank`` in JSON."""
    entries = Entries(path)
    windows = file_windows(list_logs(path))
    shown: Deque = deque(maxlen=keep)
    seen: Optional[int] = None
    count = 0
    for entry in entries:
        seen = entry.record.lsn
        if not flt(entry.record, record_time(entry.record, windows)):
            continue
        count += 1
        if keep is None and table is None:
            _print_record(entry.record, as_json, rank)
        else:
            shown.append(entry.record)
    for rec in shown:
        if table is not None:
            record_row(table, rec)
        _print_record(rec, as_json, rank)
    return entries, seen, min(count, keep) if keep is not None else count


def _stats(path: str, flt: Filter) -> Stats:
    """``--stats`` of the records of the journal at ``path`` that ``flt`` matches."""
    acc = Stats()
    entries = Entries(path)
    windows = file_windows(list_logs(path))
    for entry in entries:
        if flt(entry.record, record_time(entry.record, windows)):
            acc.add(entry)
    return acc


class _Engine:
    """What ``kvj inspect`` shows of one journal, or of each rank journal of an engine directory
    (``ranks``: (rank name, journal or None where that rank has none)): a section a rank,
    headed by its name, then a line for the engine; in JSON, ``ranks`` (each with its
    ``rank``) and ``totals``."""

    def __init__(self, path: str, ranks: Optional[List[Tuple[str, Optional[str]]]], as_json: bool):
        self.path, self.ranks, self.as_json = path, ranks, as_json

    def sections(self) -> Iterator[Tuple[Optional[str], Optional[str]]]:
        """(rank name, journal) in order, each rank's heading printed (not in JSON) as it comes."""
        if self.ranks is None:
            yield None, self.path
            return
        for name, journal in self.ranks:
            if not self.as_json:
                out.print(self.heading(name, journal))
            yield name, journal

    def journals(self) -> Dict[Optional[str], str]:
        """Rank name (None for one journal) -> journal, of every rank that has one."""
        if self.ranks is None:
            return {None: self.path}
        return {name: journal for name, journal in self.ranks if journal is not None}

    def heading(self, name: str, journal: Optional[str]) -> Text:
        if journal is None:
            return Text.assemble((name, "bold"), ": no journal (this rank made nothing durable)")
        return Text.assemble((name, "bold"), f" {journal}")

    def summary(self, what: str) -> Text:
        made = sum(1 for _name, journal in self.ranks or [] if journal is not None)
        return Text.assemble(("engine ", "bold"), (self.path, "bold"),
                             f": {made} of {len(self.ranks or [])} rank journals; {what}")

    def emit(self, by_journal: Dict[str, Dict[str, Any]], totals: Optional[Dict[str, Any]] = None) -> None:
        """One JSON object: one journal's, or the engine's with ``ranks`` and ``totals``."""
        if self.ranks is None:
            emit_json(by_journal[self.path])
            return
        ranks = [{"rank": name, "journal": journal, **by_journal[journal]} if journal is not None
                 else {"rank": name, "journal": os.path.join(self.path, name), "missing": True}
                 for name, journal in self.ranks]
        emit_json({"journal": self.path, "ranks": ranks, **({"totals": totals} if totals is not None else {})})

    def view(self, by_journal: Dict[str, RenderableType], summary: Optional[str] = None) -> RenderableType:
        """One journal's view, or each rank's under its heading, then the engine's line."""
        if self.ranks is None:
            return by_journal[self.path]
        parts: List[RenderableType] = []
        for name, journal in self.ranks:
            parts.append(self.heading(name, journal))
            if journal is not None:
                parts.append(by_journal[journal])
        if summary is not None:
            parts.append(self.summary(summary))
        return Group(*parts)


def _segment(path: str, store: Optional[str], text: str, as_json: bool) -> None:
    """A segment's header and its users, without reading its chunks."""
    from kvj.segments.check import opened_store

    root = store_path(path, store)
    with opened_store(root, root) as seg_store:
        if seg_store is None:
            raise NotFound(f"no segment store at {root}")
        info = _segment_info(path, seg_store, text)
    if as_json:
        emit_json(info)
        return
    out.print(segment_view(info))


def _segment_engine(engine: _Engine, text: str) -> None:
    """The segment ``text`` names in the store of whichever rank journal holds it."""
    from kvj.segments.check import opened_store

    found: Dict[str, Dict[str, Any]] = {}
    for journal in engine.journals().values():
        root = store_path(journal, None)
        with opened_store(root, root) as seg_store:
            if seg_store is None:
                continue
            try:
                found[journal] = _segment_info(journal, seg_store, text)
            except NotFound:
                continue
    if not found:
        raise NotFound(f"no segment key {text} (or beginning with it) in the store of any rank journal of {engine.path}")
    engine.ranks = [(name, journal) for name, journal in engine.ranks or [] if journal in found]
    if engine.as_json:
        engine.emit(found)
    else:
        out.print(engine.view({journal: segment_view(info) for journal, info in found.items()}))


def _segment_info(path: str, seg_store: Any, text: str) -> Dict[str, Any]:
    """The header of the segment of ``seg_store`` that ``text`` names, and the records of the journal
    at ``path`` that refer to it."""
    from kvj.ops.dump import resolve_key, segment_users

    key = resolve_key(seg_store, text)
    info = seg_store.info(key).to_dict()
    info["users"] = segment_users(replay(path), key)
    return info


def _print_record(rec, as_json: bool, rank: Optional[str] = None) -> None:  # type: ignore[no-untyped-def]
    if as_json:
        emit_json({"rank": rank, **record_json(rec)} if rank else record_json(rec))
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
