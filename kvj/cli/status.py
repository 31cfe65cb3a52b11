"""``kvj status``: a journal at a glance, the first command in an incident."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvj.cli.common import JournalArg, JsonArg, StoreArg, ago, emit_json, journal_path, out, store_path
from kvj.cli.render import clock
from kvj.errors import FormatError
from kvj.ops.inspection import human_size


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
    """
    from kvj.ops.status import status as journal_status

    path = journal_path(journal)
    try:
        root: Optional[str] = store_path(path, store)
    except FormatError:  # a kvj.conf that cannot be read: status shows it, it does not stop at it
        root = None
    info = journal_status(path, root)
    if as_json:
        emit_json(info)
        return
    out.print(view(info))


def _mirror_row(m: Dict[str, Any], disk: Dict[str, int]) -> Text:
    if not m["linked"]:
        return Text(f"{m['path']} is named as the mirror but is missing or does not name this journal back "
                    f"(a writer refuses to open it under --mirror-policy fail)", style="bold red")
    if m["error"]:
        return Text(f"{m['path']}: a copy cannot be read ({m['error']}; kvj fsck -n says which groups each "
                    "copy holds)", style="bold red")
    j, mi = m["journal_lsn"], m["mirror_lsn"]
    if j == mi:
        text = Text(f"{m['path']}, in step (both copies to LSN {j})")
    else:
        behind, lsn = ("the mirror", mi) if mi < j else ("the journal's copy", j)
        text = Text(f"{m['path']}: {behind} reaches LSN {lsn}, the other LSN {max(j, mi)} "
                    f"(reads take each group from the copy that has it; the next writer evens them out)",
                    style="yellow")
    if m["disk"]["device"] != disk["device"]:
        text.append(f"; {human_size(m['disk']['free'])} free of {human_size(m['disk']['size'])}")
    else:
        text.append("; on the journal's own file system", style="yellow")
    return text


def view(s: Dict[str, Any]) -> RenderableType:
    writer = s["writer"]
    head = Text.assemble(("● " if writer else "○ ", "bold green" if writer else "dim"), (s["journal"], "bold"),
                         " — " + (f"writer running (pid {writer['pid']})" if writer and writer["pid"] else
                                  "writer running" if writer else "no writer"))
    if s["compactor"]:
        head.append(f"; compaction running (pid {s['compactor']['pid']})")
    rows: List[List[Any]] = []
    when = f", {ago(s['last_write'], s['now'])} ({clock(s['last_write'])})" if s["last_write"] else ""
    rows.append(["last write", f"LSN {s['last_lsn']}{when}"
                 + (f"; {s['incomplete_tail']} bytes after it" if s["incomplete_tail"] else "")])
    m = s["last_minute"]
    rows.append(["last minute", f"{m['records_per_s']:,.1f} records/s, {human_size(m['bytes_per_s'])}/s "
                                f"({m['records']:,} records)"])
    if m["groups"]:
        lag = f", commit lag at most {m['commit_lag']:.3g} s" if m["commit_lag"] is not None else ""
        rows.append(["commits", f"{m['groups']:,} groups of {m['records_per_group']:,.1f} records{lag}"])
    if s["in_flight"] is not None:
        step = f"; training at step {s['training_step']}" if s.get("training_step") is not None else ""
        rows.append(["in flight", f"{s['in_flight']:,} requests ({s['ended']:,} ended), {s['needed_segments']:,} "
                                  f"segments needed{step}"])
    compaction = (f"; snapshot at LSN {s['last_compaction']['snapshot_lsn']} ({human_size(s['snapshot_bytes'])}), "
                  f"compacted {ago(s['last_compaction']['time'], s['now'])}" if s["last_compaction"]
                  else "; never compacted")
    rows.append(["journal", f"{s['logs']} log files, {human_size(s['log_bytes'])}{compaction}"])
    st = s["store"]
    budget = st.get("max_store_bytes")
    rows.append(["store", f"{st['segments']:,} segments, {human_size(st['bytes'])}"
                          + (f" of a {human_size(budget)} budget ({st['bytes'] / budget:.0%})" if budget else
                             " (budget 0: kvj compact evicts all it may)" if budget == 0 else "")
                          + (f", {st['quarantined']} quarantined" if st["quarantined"] else "")
                 if st["exists"] else f"none at {st['path']}" if st["path"] else "unknown (kvj.conf cannot be read)"])
    loads = st.get("loads")
    if loads and loads["asked"]:
        rows.append(["loads", f"{loads['served']:,} of {loads['asked']:,} served from the store "
                              f"(hit rate {loads['hit_rate']:.1%})"])
    if s.get("config_error"):
        rows.append(["kvj.conf", Text(f"{s['config_error']} (kvj uses none of the journal's settings until it "
                                      "is fixed: commands that need them refuse it)", style="bold red")])
    aside = s["set_aside"]
    quarantined = st["quarantined_bytes"] if st["exists"] else 0
    if aside["torn"] or aside["recovery"] or quarantined:
        rows.append(["set aside", f"torn/ {human_size(aside['torn'])}, recovery/ {human_size(aside['recovery'])}, "
                                  f"quarantine {human_size(quarantined)} (kvj prune --older-than removes them)"])
    disk = s["disk"]
    low = disk["free"] < max(64 << 20, disk["size"] // 20)
    rows.append(["disk", Text(f"{human_size(disk['free'])} free of {human_size(disk['size'])}"
                              + (" (nearly full)" if low else ""), style="bold red" if low else "")])
    if st["exists"] and st["disk"]["device"] != disk["device"]:
        rows.append(["store disk", f"{human_size(st['disk']['free'])} free of {human_size(st['disk']['size'])}"])
    if s.get("mirror"):
        rows.append(["mirror", _mirror_row(s["mirror"], disk)])
    epoch = s.get("last_epoch")
    if epoch:
        rows.append(["last recovery", f"epoch {epoch['epoch']} at LSN {epoch['lsn']}, {ago(epoch['time'], s['now'])}, "
                                      f"manifest {epoch['manifest']}"])
    handoff = s.get("handoff")
    if handoff:
        if handoff.get("state") == "done":
            rows.append(["handoff", f"done: {handoff.get('requests', 0)} request(s) moved to {handoff['to']}, "
                                    f"manifest {handoff.get('manifest')}"])
        else:
            rows.append(["handoff", Text(f"in progress to {handoff['to']} (mode {handoff.get('mode')}): "
                                         f"{s.get('moved') or 0} moved, {s.get('in_flight')} in flight",
                                         style="bold yellow")])
    if s.get("salvage_pending"):
        rows.append(["salvage", Text("a salvaging recovery was interrupted after setting files aside (kvj recover, "
                                     "with --until-damage while the log is damaged, completes its report of what "
                                     "was lost)", style="bold red")])
    if s["damage"]:
        rows.append(["damage", Text(f"{s['damage']} (kvj fsck -j {s['journal']} says what it is and what to do)",
                                    style="bold red")])
    elif s.get("tail"):
        rows.append(["damage", Text(f"damaged or torn tail of {s['tail']['length']} bytes in "
                                    f"{os.path.basename(s['tail']['path'])} (kvj recover cuts it)", style="yellow")])
    else:
        rows.append(["damage", Text("none found in the log", style="green")])
    if s.get("warnings"):
        rows.append(["warnings", Text(f"{s['warnings']} (kvj fsck lists them)", style="yellow")])
    table = Table(box=None, pad_edge=False, show_header=False)
    table.add_column(justify="right", style="bold")
    table.add_column(overflow="fold")
    for name, value in rows:
        table.add_row(name, value)
    return Group(head, table)
