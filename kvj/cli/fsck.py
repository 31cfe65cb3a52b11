"""``kvj fsck``: check a journal and its store; --repair fixes what can be fixed without loss."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer
from rich.text import Text

from kvj.cli.common import (
    JournalArg,
    JsonArg,
    OutputClosed,
    OutputFailed,
    RecoveryModeArg,
    StoreArg,
    click,
    emit_json,
    journal_path,
    out,
    progress,
    store_path,
    usage_error,
)
from kvj.cli.errors import FSCK_CANCELED, FSCK_OPERATIONAL, fail, fsck_status, report
from kvj.cli.launch import on_interrupt
from kvj.cli.render import lsn_span
from kvj.ops.fsck import FsckResult
from kvj.ops.fsck import fsck as check_journal

STYLE = {"error": "bold red", "warning": "yellow", "note": "dim"}


def fsck(journal: JournalArg = None,
         store: StoreArg = None,
         repair: Annotated[bool, typer.Option("--repair", "-y", help="Cut torn tails (bytes kept in torn/), set "
                                              "disagreeing snapshots aside, quarantine damaged segments.")] = False,
         preen: Annotated[bool, typer.Option("--preen", "-p", help="Repair only what needs no decision (what "
                                             "recovery would cut anyway, damaged segments nothing refers to); "
                                             "status 4 when a person must run --repair.")] = False,
         read_only: Annotated[bool, typer.Option("--read-only", "-n", help="Open nothing for writing (the "
                                                 "default without --repair or --preen; says so explicitly).")]
         = False,
         subset: Annotated[Optional[str], typer.Option("--read-data-subset", metavar="PERCENT",
                                                       help="Read only this share of the segments in full (e.g. "
                                                       "10%), chosen at random; check the others' headers.")]
         = None,
         mode: RecoveryModeArg = "tolerate-torn-tail",
         as_json: JsonArg = False) -> None:
    """Check framing and CRCs, LSN order, snapshots and every segment; list orphans.

    Every log file's header, commit groups and record CRCs; LSNs in order within and
    across files; each snapshot's checksum, its place in the log and its agreement with
    the log it was compacted from (while that log exists); that every segment the live
    state needs exists with a matching digest; damaged and orphan segments. Without
    --repair nothing is written, not even a lock file (it works on a read-only mount; a
    live writer is allowed: its unfinished tail is not an error). --repair needs the
    writer stopped and never deletes data: cut bytes go to torn/, damaged segments to the
    store's quarantine.

    What recovery handles by itself is a warning, not an error, so that `kvj fsck && kvj
    recover` recovers after a crash: a torn tail (the bytes a crash while writing the last
    group leaves; recovery cuts it and keeps the bytes in torn/), an empty newest log
    file, a needed segment an earlier --repair quarantined (recovery falls back to the
    segments before it). A damaged tail, a last group a torn write cannot leave (one
    flipped bit, a record failing its CRC where its sectors verify, bytes after it), is
    an error (status 4) that --repair leaves, since its records may have been
    acknowledged: the finding says how many; kvj recover --recovery-mode point-in-time
    sets it aside and records the loss. --recovery-mode judges the end of the log as
    recovery in that mode would: point-in-time makes a damaged tail a warning,
    absolute-consistency makes a torn tail an error (--repair cuts it).

    The segment store's use log (uses.kvjuse, what eviction orders by) is checked too: a
    record failing its CRC with valid records after it is damage, a warning that adds 64
    to the status (the next kvj compact rewrites the log); bytes after its last valid
    record are a torn append, which a crash leaves, and only a note.

    Exit status, as e2fsck: 0 no errors; 1 errors corrected; 4 errors left uncorrected
    (5 when both); 8 operational error (no journal, locked, permission denied, I/O
    error, a kvj.conf every command refuses, a seed-era JSON-lines journal: kvj migrate
    converts it); 16 usage error; 32 interrupted (Ctrl-C); 64 added for a damaged use
    log (see above). When the report cannot be written
    (standard output closed or full), 8 is added to the status of what was found and
    corrected (9: corrected, then the output failed), and one line on stderr says so:
    what --repair corrected is done and durable.

    --preen (e2fsck's -p, for boot scripts) cuts what recovery would cut anyway and
    quarantines damaged segments nothing refers to; anything else stays an error (status
    4) for --repair and a person. Segments are verified in parallel, with progress on a
    terminal; --read-data-subset 10% reads a random tenth of them in full (restic) and
    checks the rest by their headers, for large stores.
    """
    on_interrupt(FSCK_CANCELED)
    if sum((repair, preen, read_only)) > 1:
        raise usage_error("--repair, --preen and --read-only exclude each other")
    sample = parse_percent(subset) if subset is not None else None
    try:
        path = journal_path(journal)
        with progress() as update:
            result = check_journal(path, store_path(path, store), repair=repair, preen=preen, sample=sample,
                                   progress=update, mode=mode)
    except (typer.Exit, click.exceptions.ClickException):
        raise
    except KeyboardInterrupt:
        report("kvj", "interrupted")
        raise typer.Exit(FSCK_CANCELED) from None
    except Exception as exc:
        raise typer.Exit(fsck_status(fail("kvj", exc))) from None
    try:
        _show(result, path, as_json)
    except OutputClosed:  # kvj fsck | head: the check is done, its status still counts
        pass
    except OutputFailed as failed:  # its status still says what was found and corrected, plus 8 for the output
        fixed = sum(1 for f in result.findings if f.fixed)
        what = f"the repairs are done ({fixed} corrected)" if fixed else "the check is done"
        report("kvj", f"fsck of {path}: {what}, status {result.exit_code}; but its report could not be written "
                      f"to standard output: {failed.reason}")
        raise typer.Exit(result.exit_code | FSCK_OPERATIONAL) from None
    raise typer.Exit(result.exit_code)


def parse_percent(text: str) -> float:
    """``10%`` (or ``10``) as the fraction 0.1; 0 < PERCENT <= 100."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%?\s*", text)
    if not m or not 0 < float(m.group(1)) <= 100:
        raise typer.BadParameter(f"{text!r} is not a percentage above 0 and up to 100 (e.g. 10%)",
                                 param_hint="--read-data-subset")
    return float(m.group(1)) / 100


def _show(result: FsckResult, path: str, as_json: bool) -> None:
    if as_json:
        emit_json(result.to_dict())
    else:
        for f in result.findings:
            where = f" [{f.path}" + (f" at offset {f.offset}" if f.offset is not None else "") + "]" if f.path else ""
            line = Text.assemble((f"{f.severity}: ", STYLE[f.severity]), f"{f.message}{where}")
            if f.action:
                line.append(f" -> {f.action}", style="green" if f.fixed else "yellow")
            out.print(line)
        errors = result.errors
        warned = [f for f in result.findings if f.severity == "warning"]
        fixed = sum(1 for f in result.findings if f.fixed)
        checked = (f"{result.segments_checked} segments checked" if not result.headers_checked else
                   f"{result.data_verified} segments read in full, {result.headers_checked} by their headers "
                   f"(sample seed {result.sample_seed})")
        span = lsn_span(result.first_lsn, result.last_lsn)
        records = f"{result.records} records" + (f" ({span})" if result.first_lsn is not None else "")
        summary = (f"{path}: {result.logs} log files, {records}, {result.snapshots} snapshots, {checked}, "
                   f"{len(result.orphans)} orphans; ")
        if errors:
            summary += f"{len(errors)} errors, {len(warned)} warnings, {fixed} corrected"
        elif warned:
            summary += (f"no errors, {len(warned)} warnings" + (f", {fixed} corrected" if fixed else
                                                                 " (recovery handles them)"))
        else:
            summary += "clean"
        out.print(summary, markup=False)
        if result.preen and any(not f.fixed for f in errors):
            out.print("UNEXPECTED INCONSISTENCY: run kvj fsck --repair by hand (preen repairs only what needs no "
                      "decision)", style="bold red")
