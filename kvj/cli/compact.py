"""``kvj compact``: fold sealed logs into a snapshot and collect unreferenced segments."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, Iterator, List, Optional, Tuple

import typer

from kvj.cli.options import (JournalArg, JsonArg, StoreArg, engine_ranks, journal_path, on_rank, rank_lines, store_path,
                             usage_error)
from kvj.cli.output import done, progress, show
from kvj.cli.parse import parse_duration, parse_size
from kvj.ops.compact import DEFAULT_GRACE, CompactResult
from kvj.ops.compact import compact as compact_journal
from kvj.ops.inspection import human_size


def compact(journal: JournalArg = None,
            store: StoreArg = None,
            grace: Annotated[str, typer.Option(metavar="DURATION", help="Never collect an unreferenced segment "
                                               "younger than this (a DURATION: 90s, 15m, 1h, 2d; 0 for none: a "
                                               "segment a writer has not journaled yet is claimed, whatever the "
                                               "grace).")] = f"{int(DEFAULT_GRACE)}s",
            segments: Annotated[bool, typer.Option("--segments/--no-segments",
                                                   help="Collect unreferenced segments.")] = True,
            max_store_bytes: Annotated[Optional[str], typer.Option(
                metavar="SIZE", help="Then evict segments nothing needs, least recently used first, until the "
                "store holds at most SIZE (64GiB, 500M; a bare number is bytes) [default: the budget "
                "JOURNAL/kvj.conf records, else none].")] = None,
            dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Say what would be written, removed and "
                                                  "reclaimed; change nothing.")] = False,
            as_json: JsonArg = False) -> None:
    """Compact the journal; safe from cron while the writer runs.

    Folds every sealed log file (all but the newest) into a snapshot of the live state,
    makes it durable, then deletes the log files and older snapshots it replaces. Collects
    segments that no live record references, no writer claims and that are older than the
    grace period: a writer claims what it stores until the record naming it is durable
    (kvj-segment(5), CLAIMS), so a segment written just before its record is never
    collected, whatever the grace period.

    With a byte budget (--max-store-bytes, or the one kvj init --max-store-bytes recorded),
    it then evicts segments until the store holds at most that many bytes, least recently
    used first (a load by a serving engine, a store or a put that finds the segment stored
    counts as use; kvj-segment(5), USE LOG). Never evicted: a segment an in-flight request
    or a training checkpoint references, one a recovery manifest in recovery/ plans to load,
    one a writer claims, and one stored or claimed in the last minute (or the grace period,
    if shorter) or while it runs. What is still above the budget then is reported. A second compactor exits
    with status 75 naming the first one's pid. Reports the bytes reclaimed. --dry-run
    says what it would do and changes nothing. Files kvj sets aside (torn/, recovery/,
    the store's quarantine) are kept until kvj prune removes them.

    A tensor/pipeline-parallel vLLM engine's directory (one journal per rank,
    JOURNAL/rank-T-P/) has each rank's journal compacted as above, each under its own
    locks, with its own store (and budget: --max-store-bytes applies to each); a rank
    that fails (one line on stderr naming it) does not stop the others, and its status is
    the command's.
    """
    budget = parse_size(max_store_bytes, "--max-store-bytes") if max_store_bytes is not None else None
    if budget is not None and not segments:
        raise usage_error("--max-store-bytes evicts segments: it cannot go with --no-segments")
    path = journal_path(journal, ranks_ok=True)
    ranks = engine_ranks(path, store)
    options = dict(grace=parse_duration(grace, "--grace"), collect=segments, dry_run=dry_run, max_store_bytes=budget)
    if ranks is not None:
        _compact_engine(path, ranks, options, as_json)
        return
    with progress() as update:
        result = compact_journal(path, store_path(path, store), progress=update, **options)
    if not dry_run:
        done(f"compaction of {path} is done ({human_size(result.bytes_reclaimed)} reclaimed)")
    show(result, as_json, lambda: _lines(result, dry_run))


def _compact_engine(path: str, ranks: List[Tuple[str, Optional[str]]], options: Dict[str, Any],
                    as_json: bool) -> None:
    """Compact each rank journal of the engine directory ``path`` as one journal is (its own locks,
    store and budget); one that fails (one line on stderr naming its rank) does not stop the others,
    and the first failure's status is the command's once every rank's result is printed."""
    dry_run = options["dry_run"]
    engine = _Engine(path, dry_run)
    with progress() as update:
        for name, journal in ranks:
            entry: Dict[str, Any] = {"rank": name, "journal": journal or os.path.join(path, name)}
            if journal is None:
                engine.ranks.append({**entry, "missing": True})
                continue
            result, status, message = on_rank(name, lambda: compact_journal(journal, store_path(journal, None),
                                                                             progress=update, **options))
            if result is None:
                engine.status = engine.status or status
                engine.ranks.append({**entry, "error": message})
                continue
            engine.results[name] = result
            engine.ranks.append({**entry, **result.to_dict()})
    if not dry_run and engine.results:
        done(f"compaction of {', '.join(engine.results)} in {path} is done "
             f"({human_size(engine.total('bytes_reclaimed'))} reclaimed)")
    show(engine, as_json, engine.lines)
    if engine.status:
        raise typer.Exit(engine.status)


@dataclass
class _Engine:
    """What compacting each rank journal of an engine directory did: ``ranks`` as --json shows
    them (a rank's result, ``missing`` or its ``error``), the first failure's exit status."""

    path: str
    dry_run: bool
    ranks: List[Dict[str, Any]] = field(default_factory=list)
    results: Dict[str, CompactResult] = field(default_factory=dict)
    status: int = 0

    def total(self, name: str) -> int:
        values = [getattr(r, name) for r in self.results.values()]
        return sum(len(v) if isinstance(v, list) else v for v in values)

    def to_dict(self) -> Dict[str, Any]:
        return {"journal": self.path, "dry_run": self.dry_run, "ranks": self.ranks,
                "totals": {name: self.total(name) for name in ("bytes_reclaimed", "logs_removed", "snapshots_removed",
                                                               "segments_removed", "segments_evicted")}}

    def lines(self) -> Iterator[str]:
        """Each rank's lines (after its name), then the engine's."""
        yield from rank_lines(self.ranks, lambda name: _lines(self.results[name], self.dry_run), "compact", "compacted")
        yield (f"engine {self.path}: {len(self.results)} of {len(self.ranks)} rank journals "
               f"{'would be ' if self.dry_run else ''}compacted; {'would reclaim' if self.dry_run else 'reclaimed'} "
               f"{human_size(self.total('bytes_reclaimed'))}")


def _lines(result: CompactResult, dry_run: bool) -> Iterator[str]:
    """What ``kvj compact`` says it did (or, with --dry-run, would do)."""
    would = "would be " if dry_run else ""
    if result.snapshot:
        yield f"snapshot at LSN {result.snapshot_lsn} {would}written ({human_size(result.snapshot_bytes)})"
    else:
        yield "no sealed records to fold: no new snapshot"
    verb = "would remove" if dry_run else "removed"
    yield (f"{verb} {len(result.logs_removed)} log files, {len(result.snapshots_removed)} old snapshots, "
           f"{len(result.segments_removed)} unreferenced segments "
           f"({result.segments_kept_young} kept: younger than the grace period)")
    if result.max_store_bytes is not None and result.store_bytes is not None:
        evicted = "would evict" if dry_run else "evicted"
        left = (f"; {human_size(result.over_budget)} over it in segments needed or used too recently"
                if result.over_budget else "")
        yield (f"{evicted} {len(result.segments_evicted)} least recently used segments: the store "
               f"{'would hold' if dry_run else 'holds'} {human_size(result.store_bytes)} of its "
               f"{human_size(result.max_store_bytes)} budget{left}")
    yield f"{'would reclaim' if dry_run else 'reclaimed'} {human_size(result.bytes_reclaimed)}"
