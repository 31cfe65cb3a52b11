"""``kvj prune``: remove what kvj set aside long ago (torn/, recovery/, the store's quarantine)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvj.cli.common import (JournalArg, JsonArg, StoreArg, done, emit_json, journal_path, out, parse_duration,
                            store_path, usage_error)
from kvj.ops.inspection import human_size


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
    if as_json:
        emit_json(result.to_dict())
        return
    verb = "would remove" if dry_run else "removed"
    for folder, paths in result.removed.items():
        for p in paths:
            out.print(f"{verb} {p}", markup=False)
    counts = ", ".join(f"{len(paths)} from {folder}" for folder, paths in result.removed.items())
    out.print(f"{verb} {counts}; {'would reclaim' if dry_run else 'reclaimed'} {human_size(result.bytes_reclaimed)}"
              + (f"; {'would keep' if dry_run else 'kept'} the newest manifest {result.kept_newest_manifest}"
                 if result.kept_newest_manifest else ""),
              markup=False)
