"""How long a finished reply is held: a retention window and a byte budget, then END and compaction.

A client that returns after its reply finished gets it whole for ``--retention`` (default 1 h)
after it finished, as long as the held replies fit ``--retention-bytes`` (their tokens and
bodies); beyond the budget the oldest finished go first. Each is then ended (END ``expired`` or
``evicted``) and the reply journal is compacted, which forgets them. A running reply is never
ended here: it runs to its end (its budget of tokens), then its retention starts. Events kept
in memory for a finished reply nobody read for ``FRAMES_TTL`` seconds are dropped; they are
derived again from its tokens when asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Iterable, List, Tuple

from kvj.errors import JournalLocked, KvjError

if TYPE_CHECKING:
    from kvj.serve.replies import Reply
    from kvj.serve.server import Server

log = logging.getLogger("kvj.serve")

FRAMES_TTL = 60.0
DEFAULT_RETENTION = 3600.0
DEFAULT_BYTES = 1 << 30


def doomed(replies: Iterable["Reply"], now: float, retention: float, budget: int) -> List[Tuple["Reply", str]]:
    """The finished replies to end now, with why: past their retention (``expired``), then the
    oldest while the held ones exceed ``budget`` bytes (``evicted``)."""
    held = sorted((r for r in replies if r.end is not None), key=lambda r: r.end["at"])
    out = [(r, "expired") for r in held if now - r.end["at"] >= retention]
    kept = [r for r in held if now - r.end["at"] < retention]
    total = sum(r.held_bytes() for r in kept)
    for r in kept:
        if total <= budget:
            break
        out.append((r, "evicted"))
        total -= r.held_bytes()
    return out


class Retention:
    """The server's sweep: every ``every`` seconds, end what ``doomed`` says and compact."""

    def __init__(self, retention: float = DEFAULT_RETENTION, budget: int = DEFAULT_BYTES, every: float = 60.0):
        self.retention, self.budget = retention, budget
        self.every = max(0.05, min(every, retention / 4 if retention > 0 else every))

    def sweep(self, server: "Server", now: float) -> List[Tuple[str, str]]:
        """One pass; the (key, status) of each reply it ended."""
        ended = []
        for reply, why in doomed(list(server.replies.values()), now, self.retention, self.budget):
            if reply.readers == 0 or why == "expired":
                server.forget(reply, why)
                ended.append((reply.key, why))
        idle = time.monotonic() - FRAMES_TTL
        for reply in server.replies.values():
            if reply.finished and reply.readers == 0 and reply.last_read < idle and reply.done:
                reply.frames = None
        return ended

    async def run(self, server: "Server") -> None:
        """Sweep and compact until the server closes."""
        from kvj.ops.compact import compact

        from kvj.serve import shm

        while not server.closing:
            try:
                shm.record(server.journal)  # engine processes map more once they serve
            except OSError as exc:
                log.warning("kvj serve: the /dev/shm ledger could not be written: %s", exc)
            ended = self.sweep(server, time.time())
            if ended:
                log.info("kvj serve: %d replies past their retention or budget ended", len(ended))
            try:
                await asyncio.to_thread(compact, server.log.path, collect=False)
            except JournalLocked:
                pass
            except (KvjError, OSError) as exc:
                log.warning("kvj serve: compacting the reply journal failed (serving goes on): %s", exc)
            await asyncio.sleep(self.every)
