"""``kvj prune``: remove what kvj set aside long ago (torn/, recovery/, the store's quarantine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Iterator

import typer

from kvj.cli.common import (JournalArg, JsonArg, StoreArg, done, journal_path, parse_duration, show, store_path,
                            usage_error)
from kvj.ops.inspection import human_size

if TYPE_CHECKING:
    from kvj.ops.prune import PruneResult


def prune(journal: JournalArg = None,
          store: StoreArg = None,
          older_than: Annotated[str, typer.Option("--older-than", metavar="DURATION",
                                                  help="Remove what was set aside longer ago than this (a "
                                                  "DURATION with its unit: 7d, 12h; 7 alone is refused).")] = "",
          dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="List what would be removed; change "
                                                "nothing.")] = False,
          as_json: JsonArg = False) -> None:
    """Remove what kvj set aside long ago: torn/, recovery/ manifests, quarantined segments.

    kvj never deletes what it cuts or sets aside on its own: torn tails and set-aside files
    in JOURNAL/torn/, recovery manifests in JOURNAL/recovery/ and damaged segments in the
    store's quarantine/ stay until this removes those set aside longer ago than
    --older-than. The newest recovery manifest (the one a restarting server reads) is
    always kept. Takes the compactor lock (status 75 while a compactor or recovery runs).
    """
    if not older_than:
        raise usage_error("give --older-than DURATION (e.g. 7d)")
    from kvj.ops.prune import prune as prune_journal

    path = journal_path(journal)
    result = prune_journal(path, store_path(path, store), older_than=parse_duration(older_than, "--older-than"),
                           dry_run=dry_run)
    if not dry_run:
        done(f"pruned {path} ({human_size(result.bytes_reclaimed)} reclaimed)")
    show(result, as_json, lambda: _lines(result, dry_run))


def _lines(result: PruneResult, dry_run: bool) -> Iterator[str]:
    """What ``kvj prune`` says it removed (or, with --dry-run, would remove)."""
    verb = "would remove" if dry_run else "removed"
    for paths in result.removed.values():
        for p in paths:
            yield f"{verb} {p}"
    counts = ", ".join(f"{len(paths)} from {folder}" for folder, paths in result.removed.items())
    yield (f"{verb} {counts}; {'would reclaim' if dry_run else 'reclaimed'} {human_size(result.bytes_reclaimed)}"
           + (f"; {'would keep' if dry_run else 'kept'} the newest manifest {result.kept_newest_manifest}"
              if result.kept_newest_manifest else ""))
