"""``kvj compact``: fold sealed logs into a snapshot and collect unreferenced segments."""

from __future__ import annotations

from typing import Annotated, Iterator, Optional

import typer

from kvj.cli.common import (
    JournalArg,
    JsonArg,
    StoreArg,
    done,
    journal_path,
    parse_duration,
    parse_size,
    progress,
    show,
    store_path,
    usage_error,
)
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
    """
    budget = parse_size(max_store_bytes, "--max-store-bytes") if max_store_bytes is not None else None
    if budget is not None and not segments:
        raise usage_error("--max-store-bytes evicts segments: it cannot go with --no-segments")
    path = journal_path(journal)
    with progress() as update:
        result = compact_journal(path, store_path(path, store), grace=parse_duration(grace, "--grace"), collect=segments,
                                 progress=update, dry_run=dry_run, max_store_bytes=budget)
    if not dry_run:
        done(f"compaction of {path} is done ({human_size(result.bytes_reclaimed)} reclaimed)")
    show(result, as_json, lambda: _lines(result, dry_run))


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
