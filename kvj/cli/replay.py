"""``kvj replay``: what recovery would do, from the journal alone."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvj.cli.options import JournalArg, JsonArg, journal_path
from kvj.cli.output import emit_json, out, warn
from kvj.cli.render import state_summary
from kvj.journal.replay import replay as replay_journal


def replay(journal: JournalArg = None,
           at: Annotated[Optional[int], typer.Option("--at", metavar="LSN", min=0,
                                                     help="Replay only up to this LSN (point in time).")] = None,
           strict: Annotated[bool, typer.Option(help="Fail on any damage, a torn tail included.")] = False,
           as_json: JsonArg = False) -> None:
    """Show what recovery would do, without touching any device or file.

    Requests in flight with their resume positions (tokens covered by durable segments)
    and segment counts (the oldest 50, the rest counted: --json lists all), ended requests,
    the training checkpoint and the deltas after it, device allocations, the LSN range, and
    any damage found (a torn tail, which recovery cuts; records replay had to skip). Segments are not read: kvj recover --dry-run
    verifies them.
    """
    path = journal_path(journal)
    state = replay_journal(path, at_lsn=at, strict=strict)
    if at is not None and (state.last_lsn or 0) < at:  # what is shown is the end, not a state that existed at ``at``
        end = f"LSN {state.last_lsn}" if state.last_lsn else "no record"
        warn(f"--at {at} is past the journal's last record ({end}): this is the state at its end")
    if as_json:
        emit_json({"journal": path, "at_lsn": at, **state.to_dict()})
        return
    out.print(state_summary(path, state, at))
