"""The replica's lease (Litestream's ``lock.json``): one replicator per replica at a time.

``lock.json`` holds ``{"owner", "generation", "expires_at"}``. It is acquired with a
create-only write, renewed and taken over (once expired or released) with a write
conditional on its ETag; releasing writes an expired lease the same way, so the object
is never deleted and generations only grow. The generation is the fencing token: it is
written into the manifest and into every log part and snapshot object name, and a
replicator that finds a newer generation in either stops (``Fenced``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import Callable, Optional, Tuple

from kvj.errors import JournalLocked, KvjError
from kvj.replica.remote import LostRace, Remote

LEASE_OBJECT = "lock.json"
DEFAULT_TTL = 30.0


class LeaseHeld(JournalLocked):
    """Another replicator holds the replica's lease (exit status 75, naming the holder)."""

    def __init__(self, url: str, owner: str, expires_at: float, now: float):
        self.path, self.pid, self.owner = url, None, owner
        KvjError.__init__(self, f"replica {url} is leased by another replicator ({owner}) for "
                                f"{max(0.0, expires_at - now):.0f} s more; try again later")


class Fenced(LeaseHeld):
    """This replicator's lease was taken over: nothing more it uploads may count."""

    def __init__(self, url: str, owner: str, generation: int, mine: int):
        self.path, self.pid, self.owner = url, None, owner
        KvjError.__init__(self, f"replica {url}: lease generation {mine} was taken over by {owner} "
                                f"(generation {generation}); this replicator stops")


def default_owner() -> str:
    """host:pid:random — unique per replicator process."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Lease:
    """This replicator's hold on ``lock.json``; ``generation`` is valid once acquired."""

    def __init__(self, remote: Remote, owner: Optional[str] = None, ttl: float = DEFAULT_TTL,
                 clock: Callable[[], float] = time.time):
        self.remote = remote
        self.owner = owner or default_owner()
        self.ttl = ttl
        self.clock = clock
        self.generation = 0
        self.expires_at = 0.0
        self._etag: Optional[str] = None

    def _read(self) -> Tuple[Optional[dict], Optional[str]]:
        found = self.remote.get(LEASE_OBJECT)
        if found is None:
            return None, None
        data, etag = found
        try:
            doc = json.loads(data)
            doc = {"owner": str(doc["owner"]), "generation": int(doc["generation"]),
                   "expires_at": float(doc["expires_at"])}
        except (ValueError, KeyError, TypeError):
            raise KvjError(f"{self.remote.url}/{LEASE_OBJECT} is not a kvj lease") from None
        return doc, etag

    def _write(self, generation: int, expires_at: float, etag: Optional[str], owner: Optional[str] = None) -> None:
        body = json.dumps({"owner": self.owner if owner is None else owner, "generation": generation,
                           "expires_at": expires_at}).encode()
        self._etag = self.remote.put_if_match(LEASE_OBJECT, body, etag)
        self.generation, self.expires_at = generation, expires_at

    def acquire(self, floor: int = 0) -> int:
        """Take the lease (new, expired or released); LeaseHeld if a live one is someone else's.

        ``floor`` is the highest generation seen elsewhere (the manifest's), so a lost or
        deleted ``lock.json`` never lets a generation repeat.
        """
        now = self.clock()
        doc, etag = self._read()
        if doc is not None and doc["owner"] != self.owner and doc["expires_at"] > now:
            raise LeaseHeld(self.remote.url, doc["owner"], doc["expires_at"], now)
        generation = max(doc["generation"] if doc else 0, floor) + 1
        try:
            self._write(generation, now + self.ttl, etag)
        except LostRace:
            doc, _ = self._read()
            owner = doc["owner"] if doc else "unknown"
            raise LeaseHeld(self.remote.url, owner, doc["expires_at"] if doc else now, now) from None
        return generation

    def renew(self) -> None:
        """Extend the lease; ``Fenced`` if another replicator took it over meanwhile."""
        try:
            self._write(self.generation, self.clock() + self.ttl, self._etag)
        except LostRace:
            self._fenced()

    def ensure(self) -> None:
        """Renew once less than half the TTL is left (called before every commit)."""
        if self.expires_at - self.clock() < self.ttl / 2:
            self.renew()

    def _fenced(self) -> None:
        raise self.fenced()

    def fenced(self) -> Fenced:
        """The error for this lease having been taken over, naming the current holder."""
        doc, _ = self._read()
        if doc is None:
            return Fenced(self.remote.url, "nobody (lock.json was removed)", 0, self.generation)
        return Fenced(self.remote.url, doc["owner"], doc["generation"], self.generation)

    def release(self) -> None:
        """Give the lease up (an expired lease, same generation); best effort if already lost."""
        if self._etag is None:
            return
        try:
            self._write(self.generation, 0.0, self._etag)
        except LostRace:
            pass
        self._etag = None
