"""``kvj recover`` (and ``journal_replay``): the after-reboot command."""

from __future__ import annotations

import os
from typing import Annotated, Any, Dict, List, Optional

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvj.cli.options import (JournalArg, JsonArg, MirrorArg, MirrorPolicyArg, RecoveryModeArg, StoreArg, journal_path,
                             store_path)
from kvj.cli.output import ago, done, emit_json, out, progress, rate
from kvj.cli.errors import FAILURE
from kvj.cli.render import ROWS, more_rows
from kvj.errors import CorruptionError, InvalidArgument
from kvj.integrations.vllm.resuming import START_FORMAT
from kvj.journal.ranks import holds_ranks
from kvj.ops.inspection import human_size
from kvj.ops.recover import RecoveryResult, check_device, load_manifest
from kvj.ops.recover import recover as recover_journal
from kvj.ops.recover_ranks import recover_ranks
from kvj.journal.recovery import PENDING_NAME

DeviceOpt = typer.Option("--device", metavar="DEVICE",
                         help="Also load every planned segment onto DEVICE (cpu, cuda:0, ...) and report "
                              "time and GB/s.")
DryRunOpt = typer.Option("--dry-run", "-n", help="Change nothing: no tail cut, no manifest, no epoch record.")
AbandonOpt = typer.Option("--abandon", metavar="ID",
                          help="End this request on purpose instead of resuming it (repeatable): an engine request's "
                               "journal id, or a kvj serve reply's id (chatcmpl-ID, cmpl-ID, resp_ID), which ends the "
                               "engine requests behind it too. Journaled (END abandoned) before recovering, so that "
                               "nothing resumes it and compaction and handoff move on.")
AbandonAllOpt = typer.Option("--abandon-all", help="As --abandon, for every request in flight and every kvj serve "
                             "reply (those held for their clients too).")


def recover(journal: JournalArg = None,
            store: StoreArg = None,
            device: Annotated[Optional[str], DeviceOpt] = None,
            dry_run: Annotated[bool, DryRunOpt] = False,
            mode: RecoveryModeArg = "tolerate-torn-tail",
            as_json: JsonArg = False,
            mirror: MirrorArg = None,
            mirror_policy: MirrorPolicyArg = "fail",
            abandon: Annotated[Optional[List[str]], AbandonOpt] = None,
            abandon_all: Annotated[bool, AbandonAllOpt] = False) -> None:
    """Recover after a crash: verify, plan, and write the recovery manifest.

    Takes the writer lock (fails with status 75 while a writer runs), cuts a torn tail
    (the cut bytes are kept in JOURNAL/torn/), replays the journal, verifies the digest of
    every segment the live state needs, and writes JOURNAL/recovery/manifest-EPOCH.json:
    the requests to resume with their prompt, tokens, resume positions and segment keys,
    and the training state to restore (checkpoint and deltas). A request whose newest
    segment is missing or damaged falls back to its newest good one, and the manifest
    says so. Then it appends a recovery-epoch record naming the manifest, so a restarted
    server or training run knows exactly what to load. A seed-era JSON-lines journal is refused (status
    65): kvj migrate makes a kvj journal of it.

    A directory of rank journals (a tensor/pipeline-parallel vLLM engine's, JOURNAL/rank-T-P/,
    kvj-journal(5), Rank journals) is recovered rank by rank, each as above, and one more
    manifest, JOURNAL/recovery/manifest-EPOCH.json, plans the engine's resume: each request's
    resume position is the minimum over the ranks (a block missing on any rank is recomputed
    on all).

    Arguments that cannot work are refused before anything is written: a --device that
    cannot be used here is status 64, a missing or empty store while the journal needs
    segments (a mistyped --store or KVJ_STORE; not one that quarantined a needed segment)
    is status 66. Exit status 1 when --device could not load everything.

    --abandon ID (repeatable) or --abandon-all first ends requests on purpose, journaled (END
    abandoned) in the engine journal (every rank's) and in kvj serve's reply journal
    (JOURNAL/replies/), so that nothing resumes them and compaction and handoff move on: an
    engine request's id, or a kvj serve reply's (chatcmpl-ID, cmpl-ID, resp_ID), which ends
    the engine requests behind it too; an id naming nothing in flight is status 66, nothing
    changed. While kvj serve runs it is status 75: the server's POST
    /v1/kvj/replies/ID/abandon does it online.

    It tells the story: per request the tokens restorable and lost (the first 50 requests,
    the rest counted: --json lists all), the totals, what the journal recorded since the
    previous recovery, and the next step. A journal damaged in
    the middle of its log is refused (status 65), and so is a damaged tail: a last group
    that a torn write cannot leave (one flipped bit, a record failing its CRC where its
    sectors verify, bytes after it), whose records may have been acknowledged; the error
    says how many it held. --recovery-mode point-in-time is the
    explicit way forward (as pg_resetwal): recovery as of the last record before the
    damage, the damage and everything after it kept in torn/, and the LSNs, requests,
    tokens and training steps lost stated and recorded in the recovery-epoch record.
    --recovery-mode absolute-consistency refuses a torn tail too (status 65), for a
    journal that was shut down cleanly.
    """
    if abandon or abandon_all:
        _abandon(journal_path(journal, ranks_ok=True), None if abandon_all else list(abandon or []), dry_run,
                 as_json)
    _recover(journal, store, device, dry_run, as_json, mirror, mirror_policy, mode)


def _abandon(path: str, ids: Optional[List[str]], dry_run: bool, as_json: bool) -> None:
    """``--abandon``: END abandoned what ``ids`` name (None: everything in flight), one line each."""
    from kvj.ops.abandon import abandon as abandon_requests

    if ids is not None and not ids:
        raise InvalidArgument("--abandon needs an id (or --abandon-all)")
    ended = abandon_requests(path, ids, dry_run=dry_run)
    if not dry_run and ended:
        done(f"abandoned {len(ended)} request(s) and replies in {path}")
    if not as_json:
        verb = "would abandon" if dry_run else "abandoned"
        for a in ended[:ROWS]:
            out.print(Text(f"{verb} {a.what} {a.id} ({a.journal})"))
        if len(ended) > ROWS:
            out.print(Text(f"... and {len(ended) - ROWS} more"))
        if not ended:
            out.print(Text("nothing in flight to abandon"))


def journal_replay(log: Annotated[Optional[str], typer.Option("--log", metavar="DIR", envvar="KVJ_JOURNAL",
                                                               help="Journal directory.")] = None,
                   kv_store: Annotated[Optional[str], typer.Option("--kv-store", metavar="DIR", envvar="KVJ_STORE",
                                                                    help="Segment store directory.")] = None,
                   do_recover: Annotated[bool, typer.Option("--recover", help="Recover (as kvj recover); without "
                                                            "it, only show what would be recovered.")] = False,
                   device: Annotated[Optional[str], DeviceOpt] = None,
                   as_json: JsonArg = False,
                   mirror: MirrorArg = None,
                   mirror_policy: MirrorPolicyArg = "fail") -> None:
    """Replay a journal and, with --recover, recover it: kvj recover under the name of the
    well-known KVJournal write-up (journal_replay --log DIR --kv-store DIR --recover).

    Without --recover this is kvj recover --dry-run. A tensor/pipeline-parallel engine's
    directory of rank journals is recovered as kvj recover recovers it. See kvj-recover(1)
    for what recovery does and kvj(1) for exit statuses.
    """
    _recover(log, kv_store, device, not do_recover, as_json, mirror, mirror_policy)


def _recover(journal: Optional[str], store: Optional[str], device: Optional[str], dry_run: bool, as_json: bool,
             mirror: Optional[str], mirror_policy: str, mode: str = "tolerate-torn-tail") -> None:
    """What kvj recover and journal_replay do: recover one journal, or each rank journal of an
    engine directory (which has no one store, mirror or device to name)."""
    path = journal_path(journal, ranks_ok=True)
    if holds_ranks(path):
        if store is not None or device is not None or mirror is not None:
            raise InvalidArgument(f"{path} holds one journal per rank, each with its own store and mirror: "
                                  "--store, --mirror and --device apply to one journal (-j JOURNAL/rank-T-P)")
        _run_ranks(path, dry_run, as_json, mode)
        return
    _run(path, store_path(path, store), device, dry_run, as_json, mirror, mirror_policy, mode)


def _run(path: str, store: str, device: Optional[str], dry_run: bool, as_json: bool, mirror: Optional[str],
         mirror_policy: str, mode: str = "tolerate-torn-tail") -> None:
    if device is not None:
        check_device(device)  # before anything is written: a device that cannot work is a usage error
    with progress() as update:
        try:
            result = recover_journal(path, store, dry_run=dry_run, mode=mode, progress=update,
                                     mirror=mirror, mirror_policy=mirror_policy)
        except CorruptionError as exc:
            if mode == "point-in-time":
                raise
            raise CorruptionError(exc.path, exc.offset, f"{exc.reason}; nothing was changed (kvj recover "
                                  "--recovery-mode point-in-time recovers what precedes the damage, "
                                  "see kvj-recover(1))") from None
        if not result.dry_run:
            epoch = f", epoch record at LSN {result.epoch_lsn}" if result.epoch_lsn is not None else ""
            done(f"recovery is done: manifest {result.manifest_path}{epoch}")
        if device is not None:
            result.load = load_manifest(result.manifest, store, device, progress=update)
    if as_json:
        emit_json({"manifest_path": result.manifest_path, "epoch_lsn": result.epoch_lsn, "dry_run": result.dry_run,
                   "load": result.load, "manifest": result.manifest})
    else:
        out.print(summary(result))
    if result.load is not None and result.load["failed"]:
        raise typer.Exit(FAILURE)


def _run_ranks(path: str, dry_run: bool, as_json: bool, mode: str) -> None:
    with progress() as update:
        result = recover_ranks(path, dry_run=dry_run, mode=mode, progress=update)
    if not result.dry_run:
        done(f"recovery is done: manifest {result.manifest_path}")
    if as_json:
        emit_json({"manifest_path": result.manifest_path, "epoch_lsn": None, "dry_run": result.dry_run,
                   "load": None, "manifest": result.manifest})
    else:
        out.print(summary(result))


def summary(result: RecoveryResult) -> Group:
    """The story of a recovery: what it found and did, what is restorable and lost, what
    changed since the previous recovery, and what to do next."""
    m = result.manifest
    parts: List[RenderableType] = []
    verb = "would recover" if result.dry_run else "recovered"
    if m.get("ranks"):
        parts.append(Text.assemble((f"{verb} ", "bold"), m["journal"], f": {len(m['ranks'])} rank journals "
                                   f"(epoch {m['epoch']}); each request resumes at the minimum over the ranks"))
        for name, rank in m["ranks"].items():
            where = (f"up to LSN {rank['recovered_lsn']}, {rank['requests']} in flight" if rank["epoch"] is not None
                     else "no journal (nothing of this rank is durable)")
            parts.append(Text(f"  {name}: {where}" + (f", manifest {rank['manifest_path']}"
                                                      if rank.get("manifest_path") else "")))
    else:
        parts.append(Text.assemble((f"{verb} ", "bold"), m["journal"],
                                   f" up to LSN {m['recovered_lsn']} (epoch {m['epoch']})"))
    parts += _since(m.get("since_previous"))
    tail = m.get("torn_tail")
    if tail:
        kept = f", kept at {tail['kept_at']}" if tail.get("kept_at") else "; recovery cuts it and keeps the bytes in torn/"
        parts.append(Text(f"torn tail: {tail['length']} bytes{kept}", style="yellow"))
    salvage = m.get("salvage")
    if salvage:
        parts += _salvage(salvage, result.dry_run)
    lost_by_id = {r["id"]: r["tokens_lost"] for r in (salvage or {}).get("requests", [])}
    parts.append(Text(f"requests to resume: {len(m['requests'])}  (ended: {m['ended_requests']})", style="bold"))
    if m["requests"]:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in ("request", "resume at", "segments", "lost tokens"):
            table.add_column(col, justify="left" if col == "request" else "right", no_wrap=True)
        for r in m["requests"][:ROWS]:
            span = r["fallback"]["lost_tokens"] if r.get("fallback") else (0, 0)
            lost = span[1] - span[0] + lost_by_id.get(r["id"], 0)
            table.add_row(r["id"], str(r["resume_position"]), str(len(r["segments"])),
                          Text(str(lost), style="yellow" if lost else ""))
        parts.append(table)
        parts += more_rows(len(m["requests"]), "requests to resume", "kvj recover")
    fell_back = [r for r in m["requests"] if r.get("fallback")]
    for r in fell_back[:ROWS]:
        span = r["fallback"]["lost_tokens"]
        parts.append(Text(f"  {r['id']}: tokens {span[0]}..{span[1]} lost "
                          f"({len(r['fallback']['dropped'])} segments unusable)", style="yellow"))
    parts += more_rows(len(fell_back), "requests that fell back to an older segment", "kvj recover")
    tokens = m.get("tokens") or {"restorable": 0, "lost": 0}
    salvaged = (salvage or {}).get("tokens_lost", 0)
    lost_total = tokens["lost"] + salvaged
    parts.append(Text(f"tokens: {tokens['restorable']} restorable from segments, {lost_total} lost"
                      + (f" ({salvaged} in records after the damage)" if salvaged else ""),
                      style="yellow" if lost_total else "green"))
    t = m["training"]
    if t["checkpoint"] is not None:
        parts.append(Text(f"training: checkpoint step {t['checkpoint']['step']} + {len(t['deltas'])} deltas "
                          f"-> restore step {t['step']}"))
    elif t["fallback"]:
        parts.append(Text(f"training: {t['fallback']['reason']}", style="red"))
    parts.append(Text(f"segments: {m['segments_verified']} verified, {m['segments_unusable']} unusable",
                      style="red" if m["segments_unusable"] else "green"))
    for line in m["fallbacks"][:ROWS]:
        parts.append(Text(f"fallback: {line}", style="yellow"))
    parts += more_rows(len(m["fallbacks"]), "fallbacks", "kvj recover")
    if result.manifest_path:
        epoch = f" (epoch record at LSN {result.epoch_lsn})" if result.epoch_lsn is not None else ""
        parts.append(Text(f"manifest: {result.manifest_path}{epoch}", style="bold"))
    if result.load is not None:
        load = result.load
        parts.append(Text(f"loaded {load['segments']} segments ({human_size(load['bytes'])}) onto {load['device']} "
                          f"in {load['seconds']:.3f} s: {rate(load['bytes'], load['seconds'])}"
                          + (f"; {len(load['failed'])} FAILED" if load["failed"] else ""),
                          style="red" if load["failed"] else ""))
    parts.append(Text(f"next: {next_step(result)}", style="bold"))
    return Group(*parts)


def _since(since: Optional[Dict[str, Any]]) -> List[RenderableType]:
    if not since:
        return []
    when = (f"since epoch {since['epoch']} (LSN {since['lsn']}, {ago(since['time'])})" if since["epoch"] is not None
            else "since the journal began")
    return [Text(f"{when}: {since['records']} records, {since['started']} requests started, {since['ended']} ended, "
                 f"{since['segments']} segments flushed")]


def _salvage(s: Dict[str, Any], dry_run: bool) -> List[RenderableType]:
    first = s["damage"][0]
    where = f"{os.path.basename(first['path'])} at offset {first['offset']}"
    lost = (f"LSNs {s['kept_lsn'] + 1}..{s['lost_to']}" if s["lost_to"] is not None
            else f"LSN {s['kept_lsn'] + 1} on")
    parts: List[RenderableType] = [
        Text(f"SALVAGE: the log is damaged at {where} ({first['reason']}); recovering as of LSN {s['kept_lsn']}, "
             f"the last record before it", style="bold red"),
        Text(f"lost: {lost}, and whatever the damaged groups held ({len(s['damage'])} damaged "
             f"{'place' if len(s['damage']) == 1 else 'places'})", style="red")]
    if s.get("resumed"):
        parts.append(Text("an earlier recovery began this salvage and was interrupted; its report "
                          f"({PENDING_NAME}) is completed here", style="red"))
    if dry_run:
        plan = ([f"{os.path.basename(s['cut_file'])} from offset {s['cut_offset']}"]
                + [os.path.basename(p) for p in s["later_files"]])
        parts.append(Text("would set aside: " + ", ".join(plan), style="red"))
        if s["set_aside_to"]:
            parts.append(Text("named by the interrupted salvage (in torn/ or to be moved there): "
                              + ", ".join(s["set_aside_to"]), style="red"))
    else:
        parts.append(Text("set aside (kept): " + ", ".join(s["set_aside_to"]), style="red"))
    parts += _salvaged_requests(s["requests"])
    if s.get("training"):
        parts.append(Text(f"  training: step {s['training']['step_after_damage']} lost; restores step "
                          f"{s['training']['kept_step']}", style="red"))
    return parts


#: Requests a salvage report names one per line; past this many, they are counted (--json lists each).
SALVAGE_LINES = 10


def _salvaged_requests(requests: List[Dict[str, Any]]) -> List[RenderableType]:
    """What the damage changed per request: those that lose tokens first, most lost first,
    at most ``SALVAGE_LINES`` of them named; the rest counted by what happened to them."""
    ordered = sorted(requests, key=lambda r: (-r["tokens_lost"], r["id"]))
    named = [r for r in ordered if r["tokens_lost"]][:SALVAGE_LINES]
    parts: List[RenderableType] = [Text(f"  {r['id']}: {r['what']}", style="red") for r in named]
    rest: Dict[str, int] = {}
    for r in ordered[len(named):]:
        kind = "lose tokens too (kvj recover --json lists each)" if r["tokens_lost"] else r["what"]
        rest[kind] = rest.get(kind, 0) + 1
    for kind, count in rest.items():
        parts.append(Text(f"  {count} {'request' if count == 1 else 'requests'}: {kind}",
                          style="red" if kind.startswith("lose") else "yellow"))
    return parts


#: What resumes each kind of work a manifest plans: the one place that says it (a ``kvj serve``
#: would change the vLLM line). Filled in with the manifest, the journal and the training step.
RESUMES = {
    "served": "start kvj serve on this journal again (kvj serve MODEL --journal {journal}): it continues the replies "
              "of these requests in the background and their clients re-attach (kvj recover --abandon ID ends one "
              "instead)",
    "vllm": 'resume the vLLM requests in an engine with KvjConnector: resume(llm, "{manifest}") '
            "(kvj.integrations.vllm.resuming)",
    "requests": "start the server: it resumes from {manifest}",
    "training": "restart training: it continues from step {step} (Trainer: resume_from_checkpoint="
                'cb.resume(trainer) with KvjCallback, DCP: JournalReader("{journal}"), your own loop: '
                "recover_training)",
}


def next_step(result: RecoveryResult) -> str:
    """What the operator does now: what resumes the requests and the training the manifest plans
    (``RESUMES``), then, after damage, kvj fsck."""
    m = result.manifest
    journal = m["journal"]
    if result.dry_run:
        return f"kvj recover -j {journal} (this was a dry run: nothing was changed)"
    vllm = [(r.get("meta") or {}).get("format") == START_FORMAT for r in m["requests"]]
    served = [bool((r.get("meta") or {}).get("client")) for r in m["requests"]]  # kvj serve's (kvj.serve)
    kinds = []
    if any(served):
        kinds.append("served")
    if any(v and not c for v, c in zip(vllm, served)):
        kinds.append("vllm")
    if not all(vllm):  # requests journaled another way (kvj.integrations.blocks, hf, your own)
        kinds.append("requests")
    if m["training"]["step"] is not None:
        kinds.append("training")
    steps = [RESUMES[kind].format(manifest=result.manifest_path, journal=journal, step=m["training"]["step"])
             for kind in kinds] or ["nothing to resume (no request in flight, no training state)"]
    if m["segments_unusable"] or m["fallbacks"] or m.get("salvage"):
        steps.append(f"then look at the damage with kvj fsck -j {journal} (kvj fsck --repair moves "
                     "damaged segments to quarantine)")
    return "; ".join(steps)
