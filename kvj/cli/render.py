"""Rich renderings: summaries, tables and ``kvj status``.

Everything here returns a rich renderable; ``export`` writes any of them to SVG or HTML
for incident reports. Colour follows the console (off with NO_COLOR or when piped).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Dict, List, Optional

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvj.cli.output import ago
from kvj.journal.replay import Record
from kvj.journal.state import JournalState
from kvj.ops.inspection import describe, type_name
from kvj.ops.inspection import human_size as size

TYPE_STYLE = {"start": "green", "segment": "cyan", "end": "blue", "alloc": "yellow", "free": "magenta",
              "checkpoint": "bright_green", "delta": "bright_cyan", "epoch": "bold red"}


# -- replay summary ------------------------------------------------------------------------


def lsn_span(first: Optional[int], last: Optional[int]) -> str:
    """``LSN first..last``, or "no records" for a journal that holds none (never "LSN None..None")."""
    return f"LSN {first}..{last}" if first is not None and last is not None else "no records"


#: Rows a table of requests lists for a person; past this many the rest are counted (rich lays
#: out a table of 10^5 rows many times slower than --json prints them all, and nobody reads it).
ROWS = 50


def more_rows(total: int, what: str, command: str) -> List[RenderableType]:
    """The line under a table cut at ``ROWS`` of ``total`` rows: how many more, and how to see all."""
    if total <= ROWS:
        return []
    return [Text(f"... and {total - ROWS:,} more {what} ({command} --json lists them all)", style="dim")]


def state_summary(path: str, state: JournalState, at: Optional[int] = None) -> RenderableType:
    """``kvj replay`` for a person: the LSN range, the oldest ``ROWS`` requests in flight (the
    rest counted), ended requests, training, allocations, damage and warnings."""
    parts: List[RenderableType] = []
    lsns = lsn_span(state.first_lsn, state.last_lsn)
    snap = f", snapshot at LSN {state.snapshot_lsn}" if state.snapshot_lsn else ""
    point = f" (as of LSN {at})" if at is not None else ""
    parts.append(Text.assemble(("journal ", "bold"), path, f"  {lsns}{snap}{point}"))
    inflight = sorted(state.in_flight(), key=lambda r: r.start_lsn)
    parts.append(Text(f"in flight: {len(inflight)} requests", style="bold"))
    if inflight:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in ("request", "resume at", "segments", "prompt tokens", "started (LSN)"):
            table.add_column(col, justify="left" if col == "request" else "right")
        for req in inflight[:ROWS]:
            table.add_row(req.id, str(req.resume_position), str(len(req.segments)),
                          "-" if req.tokens is None else str(len(req.tokens)), str(req.start_lsn))
        parts.append(table)
        parts += more_rows(len(inflight), "requests in flight", "kvj replay")
    ended = state.ended()
    compacted = f" (+{state.ended_compacted} compacted away)" if state.ended_compacted else ""
    parts.append(Text(f"ended: {len(ended)} requests{compacted}"))
    parts.append(Text(training_line(state)))
    for device, allocs in sorted(state.allocations.items()):
        total = sum(a.size for a in allocs.values())
        parts.append(Text(f"device {device}: {len(allocs)} allocations, {size(total)}"))
    if state.epochs:
        last = state.epochs[-1]
        parts.append(Text(f"recovered {len(state.epochs)} times; last epoch {last['epoch']} at LSN {last['lsn']}"))
    if state.tail:
        t = state.tail
        parts.append(Text(f"damage: damaged or torn tail of {t['length']} bytes in {os.path.basename(t['path'])} at "
                          f"offset {t['offset']}: the end of the log (a crash while writing it, or damage to its last "
                          "group, whose records may have been acknowledged); recovery cuts it and keeps the bytes in "
                          "torn/", style="yellow"))
    else:
        parts.append(Text("damage: none found in the journal", style="green"))
    for warning in state.warnings[:20]:
        parts.append(Text(f"warning: {warning}", style="yellow"))
    if len(state.warnings) > 20:
        parts.append(Text(f"... and {len(state.warnings) - 20} more warnings (--json lists them)", style="yellow"))
    return Group(*parts)


def training_line(state: JournalState) -> str:
    ckpt = state.checkpoint
    if ckpt is None:
        return "training: no checkpoint"
    line = f"training: checkpoint step {ckpt['step']} ({len(ckpt['keys'])} tensors, LSN {ckpt['lsn']})"
    if state.deltas:
        line += f", {len(state.deltas)} deltas after it (steps {state.deltas[0]['step']}..{state.deltas[-1]['step']})"
    return line


# -- records -------------------------------------------------------------------------------


def clock(when: Optional[float]) -> str:
    """A record's time as local wall-clock time to the millisecond; "-" when it has none."""
    if when is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + f".{int(when * 1000) % 1000:03d}"


def record_table() -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("LSN", justify="right")
    table.add_column("time")
    table.add_column("type")
    table.add_column("file:offset")
    table.add_column("description", overflow="fold")
    return table


def record_row(table: Table, rec: Record) -> None:
    name = type_name(rec.rtype)
    table.add_row(str(rec.lsn), clock(rec.time), Text(name, style=TYPE_STYLE.get(name, "")),
                  f"{os.path.basename(rec.path)}:{rec.offset}", describe(rec))


def record_line(rec: Record) -> Text:
    """One record as one line (for --follow and piped output)."""
    name = type_name(rec.rtype)
    return Text.assemble(f"{rec.lsn:>10} {clock(rec.time):<23} ", (f"{name:<10}", TYPE_STYLE.get(name, "")),
                         f" {os.path.basename(rec.path)}:{rec.offset:<10} ", describe(rec))


def segment_view(info: Dict[str, Any]) -> RenderableType:
    """A segment's header fields and the records that refer to it."""
    table = Table(box=None, pad_edge=False, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    ratio = info["raw_size"] / info["stored_size"] if info["stored_size"] else 0.0
    for name, value in (("key", info["key"]), ("dtype", info["dtype"]), ("shape", str(info["shape"])),
                        ("codec", info["codec"]), ("size", f"{size(info['raw_size'])} raw, {size(info['stored_size'])} "
                                                           f"stored ({ratio:.2f}x)"),
                        ("digest", f"blake3 {info['digest']}"), ("layout", str(info["layout"] or {}))):
        table.add_row(name, value)
    users = info["users"]
    lines = [f"request {u['request']} segment {u['segment']}"
             + (f" tokens {u['tokens'][0]}..{u['tokens'][1]}" if u["tokens"] else "")
             + (" (ended)" if u["ended"] else "") + f", LSN {u['lsn']}" if "request" in u
             else f"training step {u['training_step']} tensor {u['tensor']}, LSN {u['lsn']}" for u in users]
    table.add_row("used by", "\n".join(lines) if lines else "no live record (an orphan: kvj compact collects it)")
    return table


def stats_view(stats: Dict[str, Any], path: str) -> RenderableType:
    parts: List[RenderableType] = [Text.assemble(("journal ", "bold"), path,
                                                 f"  {lsn_span(stats['first_lsn'], stats['last_lsn'])}")]
    table = Table(title="records by type", box=None, header_style="bold", title_justify="left")
    for col in ("type", "count", "bytes", "share"):
        table.add_column(col, justify="left" if col == "type" else "right")
    total = stats["bytes"] or 1
    for name, row in sorted(stats["by_type"].items(), key=lambda kv: -kv[1]["bytes"]):
        table.add_row(Text(name, style=TYPE_STYLE.get(name, "")), f"{row['count']:,}", size(row["bytes"]),
                      f"{100 * row['bytes'] / total:.1f}%")
    table.add_row("total", f"{stats['records']:,}", size(stats["bytes"]), "100%", style="bold")
    parts.append(table)
    parts.append(Text(f"commits: {stats['commit_groups']:,} groups, {stats['records_per_commit']} records per "
                      f"commit on average, at most {stats['largest_commit']}"))
    seg = stats["segments"]
    if seg["stored_bytes"]:
        codecs = ", ".join(f"{name} {c['segments']} ({c['raw'] / c['stored']:.2f}x)" if c["stored"] else name
                           for name, c in sorted(seg["by_codec"].items()))
        parts.append(Text(f"segments: {size(seg['raw_bytes'])} raw -> {size(seg['stored_bytes'])} stored, "
                          f"ratio {seg['ratio']}x; by codec: {codecs}"))
    if stats["largest_requests"]:
        big = Table(title="largest requests", box=None, header_style="bold", title_justify="left")
        for col in ("request", "segments", "tokens", "raw", "stored", "state"):
            big.add_column(col, justify="left" if col in ("request", "state") else "right")
        for r in stats["largest_requests"]:
            big.add_row(r["id"], str(r["segments"]), str(r["tokens"]), size(r["raw"]), size(r["stored"]),
                        f"moved to {r['moved_to']}" if r.get("moved_to") else "ended" if r["ended"] else "in flight")
        parts.append(big)
    if stats.get("moved"):
        moved = Table(title="handed off", box=None, header_style="bold", title_justify="left")
        moved.add_column("request", justify="left")
        moved.add_column("moved to", justify="left")
        for rid, to in sorted(stats["moved"].items()):
            moved.add_row(rid, to)
        parts.append(moved)
    return Group(*parts)


EXPORT_SUFFIXES = (".svg", ".html", ".htm")


def export(renderable: RenderableType, target: str, title: str) -> None:
    """Write ``renderable`` to ``target`` as SVG, or HTML for any other suffix in EXPORT_SUFFIXES."""
    from kvj.fileio import atomic_write

    suffix = os.path.splitext(target)[1].lower()
    console = Console(record=True, width=120, file=open(os.devnull, "w"), force_terminal=True, color_system="truecolor")
    console.print(renderable)
    text = console.export_svg(title=title) if suffix == ".svg" else console.export_html(inline_styles=True)
    console.file.close()
    # rich's SVG asks a CDN for its font: an incident report must render offline (a local
    # Fira Code if installed, else the viewer's monospace)
    text = re.sub(r',\s*url\("https?://[^"]*"\)\s*format\("[^"]*"\)', "", text)
    atomic_write(target, text.encode("utf-8"), mode=0o644)


def _mirror_row(m: Dict[str, Any], disk: Dict[str, int]) -> Text:
    """The mirror's line of ``kvj status``: in step, behind, unreadable or unlinked, and its disk."""
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
        text.append(f"; {size(m['disk']['free'])} free of {size(m['disk']['size'])}")
    else:
        text.append("; on the journal's own file system", style="yellow")
    return text


def replies_row(r: Dict[str, Any], now: float) -> Any:
    """``kvj status``'s line for kvj serve's reply journal: replies running and held."""
    if r["damage"]:
        return Text(f"the reply journal is damaged: {r['damage']} (kvj fsck -j {os.path.dirname(r['path'])})",
                    style="bold red")
    oldest = f", oldest finished {ago(now - r['oldest_held_age'], now)}" if r["oldest_held_age"] is not None else ""
    server = f"kvj serve running (pid {r['writer']['pid']})" if r["writer"] and r["writer"].get("pid") else \
        "no kvj serve running"
    return (f"{r['running']:,} running, {r['held']:,} held ({size(r['held_bytes'])}){oldest}, "
            f"{r['ended']:,} ended; {server}")


def status_view(s: Dict[str, Any]) -> RenderableType:
    """``kvj status`` for a person: what ``kvj.ops.status.status`` found, a line a subject."""
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
    rows.append(["last minute", f"{m['records_per_s']:,.1f} records/s, {size(m['bytes_per_s'])}/s "
                                f"({m['records']:,} records)"])
    if m["groups"]:
        lag = f", commit lag at most {m['commit_lag']:.3g} s" if m["commit_lag"] is not None else ""
        rows.append(["commits", f"{m['groups']:,} groups of {m['records_per_group']:,.1f} records{lag}"])
    if s["in_flight"] is not None:
        step = f"; training at step {s['training_step']}" if s.get("training_step") is not None else ""
        rows.append(["in flight", f"{s['in_flight']:,} requests ({s['ended']:,} ended), {s['needed_segments']:,} "
                                  f"segments needed{step}"])
    if s.get("replies"):
        rows.append(["replies", replies_row(s["replies"], s["now"])])
    compaction = (f"; snapshot at LSN {s['last_compaction']['snapshot_lsn']} ({size(s['snapshot_bytes'])}), "
                  f"compacted {ago(s['last_compaction']['time'], s['now'])}" if s["last_compaction"]
                  else "; never compacted")
    rows.append(["journal", f"{s['logs']} log files, {size(s['log_bytes'])}{compaction}"])
    st = s["store"]
    budget = st.get("max_store_bytes")
    rows.append(["store", f"{st['segments']:,} segments, {size(st['bytes'])}"
                          + (f" of a {size(budget)} budget ({st['bytes'] / budget:.0%})" if budget else
                             " (budget 0: kvj compact evicts all it may)" if budget == 0 else "")
                          + (f", {st['quarantined']} quarantined" if st["quarantined"] else "")
                 if st["exists"] else f"none at {st['path']}" if st["path"] else "unknown (kvj.conf cannot be read)"])
    loads = st.get("loads")
    if loads and loads["asked"]:
        rows.append(["loads", f"{loads['served']:,} of {loads['asked']:,} served from the store "
                              f"(hit rate {loads['hit_rate']:.1%})"])
    conn = s.get("connector")
    if conn:
        skipped = (f"; {conn['blocks_skipped']:,} not journaled in {conn['steps_skipping']:,} steps (kvj was behind: "
                   "those requests are durable up to their last journaled block)" if conn["blocks_skipped"] else "")
        rows.append(["connector", Text(f"{conn['steps']:,} steps, {conn['blocks_saved']:,} blocks journaled, "
                                       f"{conn['blocks_referenced']:,} by reference, {conn['blocks_loaded']:,} "
                                       f"loaded ({conn['blocks_failed']:,} failed){skipped}; as of "
                                       f"{ago(conn['time'], s['now'])}", style="yellow" if skipped else "")])
    if s.get("connector_error"):
        rows.append(["connector", Text(f"{s['connector_error']} (the vLLM connector's counters)", style="yellow")])
    if s.get("config_error"):
        rows.append(["kvj.conf", Text(f"{s['config_error']} (kvj uses none of the journal's settings until it "
                                      "is fixed: commands that need them refuse it)", style="bold red")])
    aside = s["set_aside"]
    quarantined = st["quarantined_bytes"] if st["exists"] else 0
    if aside["torn"] or aside["recovery"] or quarantined:
        rows.append(["set aside", f"torn/ {size(aside['torn'])}, recovery/ {size(aside['recovery'])}, "
                                  f"quarantine {size(quarantined)} (kvj prune --older-than removes them)"])
    disk = s["disk"]
    low = disk["free"] < max(64 << 20, disk["size"] // 20)
    rows.append(["disk", Text(f"{size(disk['free'])} free of {size(disk['size'])}"
                              + (" (nearly full)" if low else ""), style="bold red" if low else "")])
    if st["exists"] and st["disk"]["device"] != disk["device"]:
        rows.append(["store disk", f"{size(st['disk']['free'])} free of {size(st['disk']['size'])}"])
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
    if s.get("handoff_error"):
        rows.append(["handoff", Text(f"{s['handoff_error']} (an engine hands nothing off while it cannot be read)",
                                     style="bold red")])
    if s.get("salvage_pending"):
        rows.append(["salvage", Text("a salvaging recovery was interrupted after setting files aside (kvj recover, "
                                     "with --recovery-mode point-in-time while the log is damaged, completes its report of what "
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
