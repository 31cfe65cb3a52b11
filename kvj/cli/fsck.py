"""``kvj fsck``: check a journal and its store; --repair fixes what can be fixed without loss."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Dict, List, NoReturn, Optional, Tuple

import typer
from rich.text import Text

from kvj.cli.options import (JournalArg, JsonArg, RecoveryModeArg, StoreArg, click, engine_ranks, journal_path, on_rank,
                             store_path, usage_error)
from kvj.cli.output import OutputClosed, OutputFailed, emit_json, out, progress
from kvj.cli.errors import FSCK_CANCELED, FSCK_CLEAN, FSCK_OPERATIONAL, fail, fsck_status, report
from kvj.cli.launch import on_interrupt
from kvj.cli.render import lsn_span
from kvj.ops.fsck import USE_LOG_KIND, Finding, FsckResult
from kvj.ops.fsck import fsck as check_journal
from kvj.journal.replay import holds_journal
from kvj.serve.paths import REPLIES_DIR

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

    A tensor/pipeline-parallel vLLM engine's directory (one journal per rank,
    JOURNAL/rank-T-P/; kvj-journal(5), Rank journals) is checked rank by rank, each as
    above: each finding and summary line names its rank, then a line sums up the engine.
    The worst status wins (the ranks' statuses OR'd); an operational error in one rank
    (one line on stderr naming it) does not stop the others. A rank without a journal is
    a warning: kvj recover resumes its requests from token 0.
    """
    on_interrupt(FSCK_CANCELED)
    if sum((repair, preen, read_only)) > 1:
        raise usage_error("--repair, --preen and --read-only exclude each other")
    sample = parse_percent(subset) if subset is not None else None
    options = dict(repair=repair, preen=preen, sample=sample, mode=mode)
    try:
        path = journal_path(journal, ranks_ok=True)
        ranks = engine_ranks(path, store)
        with progress() as update:
            if ranks is not None:
                engine = _check_engine(path, ranks, options, update)
            else:
                result = check_journal(path, store_path(path, store), progress=update, **options)
    except (typer.Exit, click.exceptions.ClickException):
        raise
    except KeyboardInterrupt:
        report("kvj", "interrupted")
        raise typer.Exit(FSCK_CANCELED) from None
    except Exception as exc:
        raise typer.Exit(fsck_status(fail("kvj", exc)[0])) from None
    if ranks is not None:
        _finish(path, engine.exit_code, engine.fixed, lambda: _show_engine(engine, as_json))
    _finish(path, result.exit_code, sum(1 for f in result.findings if f.fixed), lambda: _show(result, path, as_json))


def _finish(path: str, status: int, fixed: int, show: Callable[[], None]) -> NoReturn:
    """Print the report (``show``) and exit with ``status``; when the report cannot be written,
    one line on stderr says what was done, and 8 is added to the status."""
    try:
        show()
    except OutputClosed:  # kvj fsck | head: the check is done, its status still counts
        pass
    except OutputFailed as failed:  # its status still says what was found and corrected, plus 8 for the output
        what = f"the repairs are done ({fixed} corrected)" if fixed else "the check is done"
        report("kvj", f"fsck of {path}: {what}, status {status}; but its report could not be written "
                      f"to standard output: {failed.reason}")
        raise typer.Exit(status | FSCK_OPERATIONAL) from None
    raise typer.Exit(status)


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
        return
    _print_findings(result.findings)
    out.print(_summary(result, path), markup=False)
    _preen_note(result.preen, result.findings)


def _summary(result: FsckResult, path: str) -> str:
    """The line that ends a journal's report: what was checked, and the verdict."""
    checked = (f"{result.segments_checked} segments checked" if not result.headers_checked else
               f"{result.data_verified} segments read in full, {result.headers_checked} by their headers "
               f"(sample seed {result.sample_seed})")
    span = lsn_span(result.first_lsn, result.last_lsn)
    records = f"{result.records} records" + (f" ({span})" if result.first_lsn is not None else "")
    return (f"{path}: {result.logs} log files, {records}, {result.snapshots} snapshots, {checked}, "
            f"{len(result.orphans)} orphans" + (f", {result.cached} cached KV blocks" if result.cached else "")
            + f"; {_verdict(result.findings)}")


def _print_findings(findings: List[Finding], rank: Optional[str] = None) -> None:
    """One line a finding (after ``rank: `` for a rank journal of an engine directory)."""
    for f in findings:
        where = f" [{f.path}" + (f" at offset {f.offset}" if f.offset is not None else "") + "]" if f.path else ""
        line = Text.assemble(f"{rank}: " if rank else "", (f"{f.severity}: ", STYLE[f.severity]), f"{f.message}{where}")
        if f.action:
            line.append(f" -> {f.action}", style="green" if f.fixed else "yellow")
        out.print(line)


def _verdict(findings: List[Finding]) -> str:
    """What the findings add up to: clean, warnings only, or errors (and how many were corrected)."""
    errors = sum(1 for f in findings if f.severity == "error")
    warned = sum(1 for f in findings if f.severity == "warning")
    fixed = sum(1 for f in findings if f.fixed)
    if errors:
        return f"{errors} errors, {warned} warnings, {fixed} corrected"
    if warned:
        return f"no errors, {warned} warnings" + (f", {fixed} corrected" if fixed else f" ({_handled(findings)})")
    return "clean"


def _handled(findings: List[Finding]) -> str:
    """Who takes care of the warnings: recovery, and for a damaged use log, which recovery never
    reads, the next compaction (``UseLog.fold`` rewrites it with the valid records only)."""
    use_log = any(f.kind == USE_LOG_KIND for f in findings)
    others = any(f.severity == "warning" and f.kind != USE_LOG_KIND for f in findings)
    said = (["the store's use log is advisory: eviction order and the hit rate may be off, its damaged records "
             "left out; the next kvj compact rewrites it"] if use_log else [])
    if others:
        said.append("recovery handles " + ("the others" if use_log else "them"))
    return "; ".join(said)


def _preen_note(preen: bool, findings: List[Finding]) -> None:
    if preen and any(f.severity == "error" and not f.fixed for f in findings):
        out.print("UNEXPECTED INCONSISTENCY: run kvj fsck --repair by hand (preen repairs only what needs no "
                  "decision)", style="bold red")


# -- an engine directory: one journal per rank -------------------------------------------


@dataclass
class _Rank:
    """One rank journal's check: its result, or the operational error that stopped it (``error``)."""

    name: str
    path: str
    result: Optional[FsckResult] = None
    error: Optional[str] = None
    status: int = FSCK_CLEAN

    def to_dict(self) -> Dict[str, Any]:
        if self.result is None:
            return {"rank": self.name, "path": self.path, "exit_code": self.status, "error": self.error}
        return {"rank": self.name, **self.result.to_dict()}


@dataclass
class _Engine:
    """The check of every rank journal of an engine directory; the worst status wins (the bits OR'd)."""

    path: str
    options: Dict[str, Any]
    ranks: List[_Rank] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        code = FSCK_CLEAN
        for rank in self.ranks:
            code |= rank.status
        return code

    @property
    def findings(self) -> List[Tuple[str, Finding]]:
        return [(rank.name, f) for rank in self.ranks if rank.result for f in rank.result.findings]

    @property
    def fixed(self) -> int:
        return sum(1 for _name, f in self.findings if f.fixed)

    def total(self, name: str) -> int:
        return sum(getattr(rank.result, name) for rank in self.ranks if rank.result)

    def to_dict(self) -> Dict[str, Any]:
        checked = [rank.result for rank in self.ranks if rank.result]
        return {"path": self.path, "repair": self.options["repair"], "preen": self.options["preen"],
                "mode": self.options["mode"], "exit_code": self.exit_code,
                "ranks": [rank.to_dict() for rank in self.ranks],
                **{name: self.total(name) for name in ("logs", "records", "snapshots", "segments_checked",
                                                         "data_verified", "headers_checked")},
                "orphans": [key for r in checked for key in r.orphans],
                "cached": sum(r.cached for r in checked),
                "writer_live": any(r.writer_live for r in checked),
                "findings": [{"rank": name, **f.to_dict()} for name, f in self.findings]}


def _check_engine(path: str, ranks: List[Tuple[str, Optional[str]]], options: Dict[str, Any],
                  update: Callable[[str, int, int], None]) -> _Engine:
    """Check each rank journal of the engine directory ``path`` as ``kvj fsck -j`` checks one; an
    operational error in one (one line on stderr, naming its rank) does not stop the others."""
    engine = _Engine(path, options)
    replies = os.path.join(path, REPLIES_DIR)  # kvj serve's reply journal, checked as a journal of its own
    for name, journal in ranks + ([(REPLIES_DIR, replies)] if os.path.isdir(replies) and holds_journal(replies) else []):
        rank = _Rank(name, journal or os.path.join(path, name))
        engine.ranks.append(rank)
        if journal is None:  # as kvj recover takes it: this rank holds nothing, its blocks are recomputed
            rank.result = FsckResult(rank.path, options["repair"], options["preen"], options["mode"], findings=[
                Finding("warning", "rank-missing", "this rank has no journal (it made nothing durable): kvj recover "
                        "resumes every request at token 0 on all ranks", rank.path)])
            continue
        rank.result, status, rank.error = on_rank(name, lambda: check_journal(journal, store_path(journal, None),
                                                                              progress=update, **options))
        rank.status = rank.result.exit_code if rank.result is not None else fsck_status(status)
    return engine


def _show_engine(engine: _Engine, as_json: bool) -> None:
    """Each rank's findings (after its name) and summary line, then the engine's."""
    if as_json:
        emit_json(engine.to_dict())
        return
    for rank in engine.ranks:
        if rank.result is None:
            out.print(f"{rank.path}: not checked: {rank.error}", markup=False)
        else:
            _print_findings(rank.result.findings, rank.name)
            out.print(_summary(rank.result, rank.path), markup=False)
    findings = [f for _name, f in engine.findings]
    unchecked = [rank.name for rank in engine.ranks if rank.result is None]
    failing = [rank.name for rank in engine.ranks if rank.result and rank.result.errors]
    out.print(f"{engine.path}: {len(engine.ranks)} rank journals; "
              + (f"not checked: {', '.join(unchecked)}; " if unchecked else "") + _verdict(findings)
              + (f" (in {', '.join(failing)})" if failing else ""), markup=False)
    _preen_note(engine.options["preen"], findings)
