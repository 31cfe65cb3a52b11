"""``kvj restore``: rebuild a journal on this node from its S3 replica."""

from __future__ import annotations

import os
import re
from typing import Annotated, Optional

import typer

from kvj.cli.options import JournalArg, JsonArg, StoreArg, usage_error
from kvj.cli.output import done, progress, show
from kvj.cli.parse import parse_time
from kvj.ops.inspection import human_size
from kvj.replica.remote import open_remote
from kvj.replica.pull import RestoreResult
from kvj.replica.pull import restore as restore_replica
from kvj.trust import check_owner


def restore(source: Annotated[Optional[str], typer.Option("--from", metavar="URL",
                                                          help="The replica: s3://bucket/prefix.")] = None,
            journal: JournalArg = None,
            store: StoreArg = None,
            at: Annotated[Optional[str], typer.Option(metavar="LSN|TIME", help="Restore the state as of this LSN "
                                                      "(a bare integer), or as replicated at this TIME (ISO 8601, "
                                                      "@ and Unix seconds, or e.g. 10m for ten minutes ago).")] = None,
            as_json: JsonArg = False) -> None:
    """Restore a journal and its segments from a replica onto a new directory.

    Downloads the replica's snapshot, log files and every segment the restored state
    needs, and verifies each (the BLAKE3 the manifest recorded, every CRC, LSN
    continuity, each segment's chunks and content digest) before it is written durably.
    No read goes past the size the manifest or the journal declares for an object, and
    an object of another size is refused unread; a download fails after 30 s without a
    byte, however long it takes in all. The result is an ordinary journal: run
    kvj fsck and kvj recover on it as on the original node. --at restores an earlier
    point (not before the replica's snapshot).

    The target must be new or empty (an empty lost+found of a fresh file system is
    allowed): nothing existing is overwritten. It may be a mount point: the journal is
    staged in DIR/.kvj-restoring and moved into place, so DIR itself, its owner and mode,
    stays. A restore holds a lock on DIR: a second one into it is refused (status 75).
    One cut short (killed, power lost) leaves DIR/.kvj-restoring; the next restore into
    DIR removes it and what its move had put in DIR (log files, snapshots, segments/),
    and restores anew; anything else in DIR is refused (64), nothing removed. A target that is not empty or cannot be written fails before anything is
    downloaded, one without the space for the log files before they are, one without the
    space for the segments before any of them is. Run it as the user the journal's service runs as (User=): as
    root, a DIR another user owns is refused (77) unless KVJ_TRUST_OWNER=1.
    """
    if not source:
        raise usage_error("no replica given: use --from s3://bucket/prefix")
    if journal is None:
        raise usage_error("no journal given: use --journal DIR (a new or empty directory)")
    target = os.path.abspath(journal)
    for directory in (target, os.path.abspath(store) if store else None):
        if directory and os.path.isdir(directory):
            check_owner(directory)
    at_lsn = at_time = None
    if at is not None:
        if re.fullmatch(r"\s*\d+\s*", at):
            at_lsn = int(at)
        else:
            at_time = parse_time(at, "--at")
    remote = open_remote(source)
    with progress() as update:
        result = restore_replica(remote, target, store=os.path.abspath(store) if store else None, at_lsn=at_lsn,
                                 at_time=at_time, progress=update)
    done(f"restored {target} through LSN {result.last_lsn}")
    show(result, as_json, lambda: [_summary(result, target)])


def _summary(result: RestoreResult, target: str) -> str:
    """One line: what ``kvj restore`` brought back, and how fast it verified it."""
    snap = f", snapshot at LSN {result.snapshot_lsn}" if result.snapshot_lsn is not None else ""
    rate = result.bytes / result.seconds / 1e6 if result.seconds else 0.0
    cleaned = (f" (after removing what a restore cut short had left: {len(result.cleaned_up)} entries)"
               if result.cleaned_up else "")
    return (f"restored {target} through LSN {result.last_lsn}: {result.logs} log files{snap}, "
            f"{result.segments} segments, {human_size(result.bytes)} verified ({rate:.0f} MB/s){cleaned}")
