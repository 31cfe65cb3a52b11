"""``kvj recover`` (and ``journal_replay``): the after-reboot command."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvj.cli.common import JournalArg, JsonArg, StoreArg, emit_json, journal_path, out, progress, store_path
from kvj.cli.errors import FAILURE
from kvj.ops.inspection import human_size
from kvj.ops.recover import RecoveryResult, check_device, load_manifest
from kvj.ops.recover import recover as recover_journal

DeviceOpt = typer.Option("--device", metavar="DEVICE",
                         help="Also load every planned segment onto DEVICE (cpu, cuda:0, ...) and report "
                              "time and GB/s.")
DryRunOpt = typer.Option("--dry-run", "-n", help="Change nothing: no tail cut, no manifest, no epoch record.")


def recover(journal: JournalArg = None,
            store: StoreArg = None,
            device: Annotated[Optional[str], DeviceOpt] = None,
            dry_run: Annotated[bool, DryRunOpt] = False,
            as_json: JsonArg = False) -> None:
    """Recover after a crash: verify, plan, and write the recovery manifest.

    Takes the writer lock (fails with status 75 while a writer runs), cuts a damaged or
    torn tail (the cut bytes are kept in JOURNAL/torn/), replays the journal, verifies the digest of
    every segment the live state needs, and writes JOURNAL/recovery/manifest-EPOCH.json:
    the requests to resume with their prompt, tokens, resume positions and segment keys,
    and the training state to restore (checkpoint and deltas). A request whose newest
    segment is missing or damaged falls back to its newest good one, and the manifest
    says so. Then it appends a recovery-epoch record naming the manifest, so a restarted
    server knows exactly what to load. Reads legacy JSON-lines journals too (no epoch
    record is written into those).

    Arguments that cannot work are refused before anything is written: a --device that
    cannot be used here is status 64, a missing or empty store while the journal needs
    segments (a mistyped --store or KVJ_STORE) is status 66. Exit status 1 when --device
    could not load everything.
    """
    path = journal_path(journal)
    _run(path, store_path(path, store), device, dry_run, as_json)


def journal_replay(log: Annotated[Optional[str], typer.Option("--log", metavar="DIR", envvar="KVJ_JOURNAL",
                                                               help="Journal directory or JSON-lines file.")] = None,
                   kv_store: Annotated[Optional[str], typer.Option("--kv-store", metavar="DIR", envvar="KVJ_STORE",
                                                                    help="Segment store directory.")] = None,
                   do_recover: Annotated[bool, typer.Option("--recover", help="Recover (as kvj recover); without "
                                                            "it, only show what would be recovered.")] = False,
                   device: Annotated[Optional[str], DeviceOpt] = None,
                   as_json: JsonArg = False) -> None:
    """Replay a journal and, with --recover, recover it: kvj recover under the name of the
    well-known KVJournal write-up (journal_replay --log DIR --kv-store DIR --recover).

    Without --recover this is kvj recover --dry-run. See kvj-recover(1) for what recovery
    does and kvj(1) for exit statuses.
    """
    path = journal_path(log)
    _run(path, store_path(path, kv_store), device, not do_recover, as_json)


def _run(path: str, store: str, device: Optional[str], dry_run: bool, as_json: bool) -> None:
    if device is not None:
        check_device(device)  # before anything is written: a device that cannot work is a usage error
    with progress() as update:
        result = recover_journal(path, store, dry_run=dry_run, progress=update)
        if device is not None:
            result.load = load_manifest(result.manifest, store, device, progress=update)
    if as_json:
        emit_json({"manifest_path": result.manifest_path, "epoch_lsn": result.epoch_lsn, "dry_run": result.dry_run,
                   "load": result.load, "manifest": result.manifest})
    else:
        out.print(summary(result))
    if result.load is not None and result.load["failed"]:
        raise typer.Exit(FAILURE)


def summary(result: RecoveryResult) -> Group:
    m = result.manifest
    parts = []
    verb = "would recover" if result.dry_run else "recovered"
    parts.append(Text.assemble((f"{verb} ", "bold"), m["journal"],
                               f" up to LSN {m['recovered_lsn']} (epoch {m['epoch']})"))
    tail = m.get("torn_tail")
    if tail:
        kept = f", kept at {tail['kept_at']}" if tail.get("kept_at") else "; recovery cuts it and keeps the bytes in torn/"
        parts.append(Text(f"damaged or torn tail: {tail['length']} bytes{kept}", style="yellow"))
    parts.append(Text(f"requests to resume: {len(m['requests'])}  (ended: {m['ended_requests']})", style="bold"))
    if m["requests"]:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in ("request", "resume at", "segments", "note"):
            table.add_column(col, justify="right" if col in ("resume at", "segments") else "left")
        for r in m["requests"]:
            note = ""
            if r.get("fallback"):
                lost = r["fallback"]["lost_tokens"]
                note = f"fallback: tokens {lost[0]}..{lost[1]} lost ({len(r['fallback']['dropped'])} segments unusable)"
            elif r.get("verified") is False:
                note = "legacy: not verified (no digests)"
            resume = "-" if r["resume_position"] is None else str(r["resume_position"])
            table.add_row(r["id"], resume, str(len(r["segments"])), Text(note, style="yellow" if note else ""))
        parts.append(table)
    t = m["training"]
    if t["checkpoint"] is not None:
        parts.append(Text(f"training: checkpoint step {t['checkpoint']['step']} + {len(t['deltas'])} deltas "
                          f"-> restore step {t['step']}"))
    elif t["fallback"]:
        parts.append(Text(f"training: {t['fallback']['reason']}", style="red"))
    parts.append(Text(f"segments: {m['segments_verified']} verified, {m['segments_unusable']} unusable",
                      style="red" if m["segments_unusable"] else "green"))
    for line in m["fallbacks"]:
        parts.append(Text(f"fallback: {line}", style="yellow"))
    if result.manifest_path:
        epoch = f" (epoch record at LSN {result.epoch_lsn})" if result.epoch_lsn is not None else ""
        parts.append(Text(f"manifest: {result.manifest_path}{epoch}", style="bold"))
    if result.load is not None:
        load = result.load
        parts.append(Text(f"loaded {load['segments']} segments ({human_size(load['bytes'])}) onto {load['device']} "
                          f"in {load['seconds']:.3f} s: {load['gb_per_s']:.2f} GB/s"
                          + (f"; {len(load['failed'])} FAILED" if load["failed"] else ""),
                          style="red" if load["failed"] else ""))
    return Group(*parts)
