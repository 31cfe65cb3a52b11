"""Resume at start: recover the engine journal, replay the reply journal, join the two.

Before vLLM starts (``prepare``): clean ``/dev/shm`` of a killed server's leftovers
(``kvj.serve.shm``); recover the engine journal as ``kvj recover`` does (damage refused as it
refuses it); open the reply journal (its torn tail cut); then ``join`` them. Each reply that did
not finish continues from the longest of its own tokens and those its engine incarnations
journaled (they agree on what they share: the same greedy or seeded run); a finished one is
held. Every engine request still in flight is then ended in the engine journal, before the
engine opens it: ``resumed`` when a reply continues it (the continuation is a new engine
request, prompt + known tokens, whose KV the connector loads by chain key: the blocks of an
ended request stay a prefix cache), ``abandoned`` when none does. So whatever mix of
``kvj recover``, ``journal_replay --recover``, handoffs and restarts came before, each reply is
resumed once, by one drive, in this server.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import kvj
from kvj.journal import ranks
from kvj.ops.abandon import engine_journals
from kvj.serve import shm
from kvj.serve.paths import CANCEL_DIR, replies_dir
from kvj.serve.replies import REPLY_FORMAT, Reply, ReplyLog

log = logging.getLogger("kvj.serve")


@dataclass
class Incarnation:
    """An engine request of a reply (START ``meta.client``), as its engine journal left it."""

    jid: str
    client: Optional[str]
    generated: List[int]  #: the tokens it generated, after the original prompt
    in_flight: bool


@dataclass
class Join:
    """What the start-up does with the two journals."""

    replies: List[Reply] = field(default_factory=list)  #: restored: held (finished) or to continue
    supersede: List[str] = field(default_factory=list)  #: engine requests a reply continues: END resumed
    abandon: List[str] = field(default_factory=list)  #: engine requests no reply continues: END abandoned
    notes: List[str] = field(default_factory=list)


def incarnations(state: "kvj.JournalState") -> List[Incarnation]:
    """The engine journal's requests (in flight, or ended and not yet compacted away)."""
    found = []
    for req in state.requests.values():
        meta = req.meta or {}
        if "prompt_len" not in meta:
            found.append(Incarnation(req.id, None, [], not req.ended))
            continue
        known = list(req.tokens or []) + list(req.output)
        found.append(Incarnation(req.id, meta.get("client"), known[int(meta["prompt_len"]):], not req.ended))
    return found


def join(replies: "kvj.JournalState", engine: List[Incarnation]) -> Join:
    """The pure decision (module docstring), tested without vLLM."""
    out = Join()
    by_client: Dict[str, List[Incarnation]] = {}
    for inc in engine:
        if inc.client is not None:
            by_client.setdefault(inc.client, []).append(inc)
    continued = set()
    for req in replies.in_flight():
        if (req.meta or {}).get("format") != REPLY_FORMAT:
            continue
        reply = Reply.from_state(req)
        mine = by_client.get(req.id, [])
        if reply.finished:
            reply.restored = "held"
        else:
            known = list(reply.tokens)
            for inc in sorted(mine, key=lambda i: -len(i.generated)):
                common = min(len(known), len(inc.generated))
                if inc.generated[:common] != known[:common]:
                    out.notes.append(f"reply {req.id}: engine request {inc.jid} journaled other tokens than the "
                                     "reply released; the reply's are kept")
                elif len(inc.generated) > len(known):
                    known = list(inc.generated)
            reply.known = known
            reply.restored = "resume" if mine else "scratch"
            continued.add(req.id)
        out.replies.append(reply)
    for inc in engine:
        if inc.in_flight:
            (out.supersede if inc.client in continued else out.abandon).append(inc.jid)
    return out


def _recover(journal: str, journals: List[str], mode: str) -> Optional[str]:
    """``kvj recover`` of the engine journal when it has requests in flight; its manifest."""
    from kvj.ops.recover import recover
    from kvj.ops.recover_ranks import recover_ranks

    if not any(kvj.replay(j).in_flight() for j in journals):
        return None
    result = recover_ranks(journal, mode=mode) if ranks.holds_ranks(journal) else recover(journal, mode=mode)
    return result.manifest_path


def take_over(log_: ReplyLog, source: str) -> Tuple[List[str], List[Incarnation]]:
    """``--from SOURCE``: the replies the kvj serve of ``SOURCE`` handed off to this one (its last
    ``kvj handoff``'s target) and this journal does not hold yet, copied in (their START, their
    tokens): the join continues them. Returns their keys and their engine requests in ``SOURCE``
    (ended there, moved: their tokens count). ``SOURCE`` is read, never written."""
    from kvj.ops.armed import read_control

    control = read_control(source) or {}
    to = control.get("to")
    theirs = replies_dir(source)
    if to is None or not os.path.isdir(theirs):
        return [], []
    have = kvj.replay(log_.path).requests
    keys = []
    for req in kvj.replay(theirs).in_flight():
        end = req.reply or {}
        if end.get("status") != "handoff" or end.get("to") != to or req.id in have:
            continue
        log_.journal.start(req.id, req.prompt_hash, None, dict(req.meta))
        tokens = list(req.output[:end["count"]])
        if tokens:
            log_.journal.tokens(req.id, 0, tokens)
        keys.append(req.id)
    log_.sync()
    moved = [inc for j in engine_journals(source) for inc in incarnations(kvj.replay(j)) if inc.client in keys]
    return keys, [Incarnation(inc.jid, inc.client, inc.generated, False) for inc in moved]


def prepare(journal: str, mode: str = "tolerate-torn-tail",
            source: Optional[str] = None) -> Tuple[ReplyLog, Join, List[str]]:
    """Everything before vLLM starts (module docstring): the reply journal open for writing, the join
    carried out, and one line per thing done. ``source``: see ``take_over``."""
    lines = []
    os.makedirs(journal, exist_ok=True)
    log_ = ReplyLog.open(replies_dir(journal))  # first: an unwritable journal fails here, nothing else done
    try:
        removed = shm.cleanup(journal)
        if removed:
            lines.append(f"removed {len(removed)} /dev/shm files a killed server left: {', '.join(removed)}")
        journals = engine_journals(journal)
        manifest = _recover(journal, journals, mode)
        if manifest is not None:
            lines.append(f"recovered the engine journal: {manifest}")
        engine: Dict[str, Incarnation] = {}
        if source is not None:
            keys, moved = take_over(log_, source)
            engine.update((inc.jid, inc) for inc in moved)
            if keys:
                lines.append(f"took over {len(keys)} replies handed off by the kvj serve of {source}")
        for j in journals:  # every rank journals every request's tokens; keep the longest
            for inc in incarnations(kvj.replay(j)):
                if inc.jid not in engine or len(inc.generated) > len(engine[inc.jid].generated):
                    engine[inc.jid] = inc
        done = join(kvj.replay(log_.path), list(engine.values()))
        for j in journals:
            _end(j, done)
        shutil.rmtree(os.path.join(log_.path, CANCEL_DIR), ignore_errors=True)
        lines += done.notes
        resumed = [r for r in done.replies if not r.finished]
        lines.append(f"{len(resumed)} replies to continue ({sum(len(r.known) for r in resumed)} tokens known), "
                     f"{len(done.replies) - len(resumed)} held, {len(done.abandon)} engine requests abandoned")
        return log_, done, lines
    except BaseException:
        log_.close()
        raise


def _end(path: str, done: Join) -> None:
    """END, in one engine journal, the requests the join supersedes or abandons."""
    live = {r.id for r in kvj.replay(path).in_flight()}
    ends = [(jid, "resumed") for jid in done.supersede if jid in live] + \
        [(jid, "abandoned") for jid in done.abandon if jid in live]
    if not ends:
        return
    with kvj.Journal.open(path, create=False) as j:
        for jid, status in ends:
            j.end(jid, status)
        j.sync()
