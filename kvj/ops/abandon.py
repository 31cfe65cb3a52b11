"""Ending in-flight requests on purpose (``kvj recover --abandon``): END ``abandoned`` journaled
in the engine journal (every rank's) and kvj serve's reply journal, so that nothing resumes them
and compaction and handoff move on. Takes each journal's writer lock: while ``kvj serve`` runs
it fails, and ``POST /v1/kvj/replies/ID/abandon`` does it online.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import List, Optional, Sequence

import kvj
from kvj.errors import NotFound
from kvj.journal import ranks
from kvj.journal.reader import list_logs
from kvj.journal.replay import holds_journal
from kvj.journal.snapshot import list_snapshots
from kvj.serve.paths import replies_dir

STATUS = "abandoned"


@dataclass
class Abandoned:
    """One request ended (or, for a dry run, to be ended)."""

    journal: str
    id: str
    what: str  #: "request" (the engine's) or "reply" (kvj serve's)


def engine_journals(journal: str) -> List[str]:
    """The engine's journal, or its rank journals (a tensor/pipeline-parallel engine's)."""
    if ranks.holds_ranks(journal):
        return [j for j in ranks.rank_journals(journal).values() if os.path.isdir(j)]
    return [journal] if os.path.isdir(journal) and (list_logs(journal) or list_snapshots(journal)) else []


def abandon(journal: str, ids: Optional[Sequence[str]], dry_run: bool = False) -> List[Abandoned]:
    """END ``abandoned`` what ``ids`` name (None: everything in flight); what was (would be) ended.
    An id that names nothing in flight is ``NotFound``, before anything is written."""
    journal = os.path.abspath(journal)
    replies = replies_dir(journal)
    plans: List[Abandoned] = []
    for path in engine_journals(journal):
        for req in kvj.replay(path).in_flight():
            if ids is None or req.id in ids or (req.meta or {}).get("client") in ids:
                plans.append(Abandoned(path, req.id, "request"))
    named = {(kvj.replay(p.journal).requests[p.id].meta or {}).get("client") for p in plans}
    if os.path.isdir(replies) and holds_journal(replies):
        for req in kvj.replay(replies).in_flight():
            if ids is None or req.id in ids or req.id in named:
                plans.append(Abandoned(replies, req.id, "reply"))
    if ids is not None:
        found = {p.id for p in plans} | named
        unknown = [i for i in ids if i not in found]
        if unknown:
            raise NotFound(f"nothing in flight in {journal} is named {unknown[0]!r} (an engine request's id, or a "
                           "kvj serve reply's: chatcmpl-ID, cmpl-ID, resp_ID); nothing was changed")
    if not dry_run:
        with ExitStack() as stack:  # every writer lock first: a server holding one changes nothing anywhere
            writers = {path: stack.enter_context(kvj.Journal.open(path, create=False))
                       for path in sorted({p.journal for p in plans})}
            for p in plans:
                writers[p.journal].end(p.id, STATUS)
            for j in writers.values():
                j.sync()
    return plans
