"""``kvj status``: a journal at a glance, the first command in an incident."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from kvj.cli.options import JournalArg, JsonArg, StoreArg, engine_ranks, journal_path, store_path
from kvj.cli.output import ago, emit_json, out
from kvj.errors import FormatError

if TYPE_CHECKING:
    from rich.console import RenderableType


def status(journal: JournalArg = None, store: StoreArg = None, as_json: JsonArg = False) -> None:
    """Show a journal at a glance: writer, last write, rates, what is in flight, sizes, damage.

    Whether a writer holds the journal (its pid), the last complete commit group's LSN and
    how long ago it was written, records/s and bytes/s over the last minute and the commit
    lag (the longest interval between two commit groups of one writer in that minute, the
    most a record can have waited for its group; the pauses between writers, a dead
    writer's last group and recovery's epoch record or the next writer's first group, are
    left out: no record waited through them), requests in
    flight and ended, the training step, journal and store sizes (and the store's byte budget
    kvj.conf records, and its hit rate: loads a serving engine asked of it and how many it
    served), what kvj set aside (torn/,
    recovery/, quarantine) and the free space of their disks, the mirror (whether both
    copies reach the same LSN), the last recovery epoch
    and the last compaction, replay's warnings and any damage, with what to run about it.
    Like systemctl status or pg_controldata: the first command in an incident. Read-only:
    it writes nothing and takes no lock.

    A tensor/pipeline-parallel vLLM engine's directory (one journal per rank,
    JOURNAL/rank-T-P/) shows each rank's journal as above, then one line for the engine:
    live writers, the newest write, the last minute's writes, sizes, and the ranks that
    are damaged or have no journal (--json: "ranks", each rank's status, and "totals").
    """
    path = journal_path(journal, ranks_ok=True)
    ranks = engine_ranks(path, store)
    if ranks is not None:
        from kvj.ops.status import engine_status

        info = engine_status(path, [(name, j, _store_root(j, None) if j else None) for name, j in ranks])
    else:
        from kvj.ops.status import status as journal_status

        info = journal_status(path, _store_root(path, store))
    if as_json:
        emit_json(info)
        return
    if ranks is None:
        from kvj.cli.render import status_view  # rich's tables only for a person: --json starts sooner

        out.print(status_view(info))
        return
    out.print(_engine_view(info))


def _store_root(journal: str, store: Optional[str]) -> Optional[str]:
    """The journal's store; None for a kvj.conf that cannot be read: status shows it, it does not stop at it."""
    try:
        return store_path(journal, store)
    except FormatError:
        return None


def _engine_view(info: Dict[str, Any]) -> "RenderableType":
    """Each rank's ``status_view`` (a line for a rank without a journal), then the engine's line."""
    from rich.console import Group
    from rich.text import Text

    from kvj.cli.render import size, status_view

    parts: list = []
    for rank in info["ranks"]:
        parts.append(Text.assemble(("○ ", "dim"), (rank["journal"], "bold"), " — no journal (this rank made "
                                   "nothing durable: kvj recover resumes its requests from token 0)")
                     if rank["missing"] else status_view(rank))
        parts.append(Text(""))
    t = info["totals"]
    writers = f"{t['writers']} of {t['ranks']} writers running" if t["writers"] else "no writer"
    last = f"last write {ago(t['last_write'], info['now'])}" if t["last_write"] else "nothing written"
    m = t["last_minute"]
    trouble = [f"damaged: {', '.join(t['damaged'])}"] if t["damaged"] else []
    trouble += [f"torn or damaged tail: {', '.join(t['tails'])}"] if t["tails"] else []
    trouble += [f"no journal: {', '.join(t['missing'])}"] if t["missing"] else []
    if info.get("replies"):
        from kvj.cli.render import replies_row

        parts.append(Text.assemble(("replies ", "bold"), replies_row(info["replies"], info["now"])))
    parts.append(Text.assemble(
        ("engine ", "bold"), (info["journal"], "bold"),
        f": {t['journals']} of {t['ranks']} rank journals; {writers}, {last}; last minute "
        f"{m['records_per_s']:,.1f} records/s, {size(m['bytes_per_s'])}/s; journals "
        f"{size(t['log_bytes'] + t['snapshot_bytes'])}, stores {t['segments']:,} segments, {size(t['store_bytes'])}"
        + (f" ({t['quarantined']} quarantined)" if t["quarantined"] else "") + "; ",
        (("; ".join(trouble)) if trouble else "no damage found", "bold red" if t["damaged"] else
         "yellow" if trouble else "green")))
    return Group(*parts)
