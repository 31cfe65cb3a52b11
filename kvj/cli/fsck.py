"""``kvj fsck``: check a journal and its store; --repair fixes what can be fixed without loss."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from kvj.cli.common import (
    JournalArg,
    JsonArg,
    OutputClosed,
    StoreArg,
    click,
    emit_json,
    journal_path,
    out,
    progress,
    store_path,
)
from kvj.cli.errors import FSCK_CANCELED, fail, fsck_status, report
from kvj.cli.launch import on_interrupt
from kvj.ops.fsck import FsckResult
from kvj.ops.fsck import fsck as check_journal

STYLE = {"error": "bold red", "warning": "yellow", "note": "dim"}


def fsck(journal: JournalArg = None,
         store: StoreArg = None,
         repair: Annotated[bool, typer.Option("--repair", "-y", help="Cut torn tails (bytes kept in torn/), set "
                                              "disagreeing snapshots aside, quarantine damaged segments.")] = False,
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
    recover` recovers after a crash: a damaged or torn tail (recovery cuts it and keeps
    the bytes in torn/), an empty newest log file, a needed segment an earlier --repair
    quarantined (recovery falls back to the segments before it).

    Exit status, as e2fsck: 0 no errors; 1 errors corrected; 4 errors left uncorrected
    (5 when both); 8 operational error (no journal, locked, permission denied, I/O
    error); 16 usage error; 32 interrupted (Ctrl-C).
    """
    on_interrupt(FSCK_CANCELED)
    try:
        path = journal_path(journal)
        with progress() as update:
            result = check_journal(path, store_path(path, store), repair=repair, progress=update)
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
    raise typer.Exit(result.exit_code)


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
        summary = (f"{path}: {result.logs} log files, {result.records} records (LSN {result.first_lsn}.."
                   f"{result.last_lsn}), {result.snapshots} snapshots, {result.segments_checked} segments checked, "
                   f"{len(result.orphans)} orphans; ")
        if errors:
            summary += f"{len(errors)} errors, {len(warned)} warnings, {fixed} corrected"
        elif warned:
            summary += (f"no errors, {len(warned)} warnings" + (f", {fixed} corrected" if fixed else
                                                                 " (recovery handles them)"))
        else:
            summary += "clean"
        out.print(summary, markup=False)
