"""The replica's lease (Litestream's ``lock.json``): one replicator per replica at a time.

``lock.json`` is ``{"owner", "generation", "expires_at"}``, taken create-only or over its
ETag, released by writing it expired (never deleted, so generations only grow). The
generation is the fencing token, written into the manifest and every object name: a
replicator that finds a newer one stops (``Fenced``). A lease ends ``MAX_TTL`` after it was
written whatever its ``expires_at``; ``acquire(breaking=HOLDER)`` takes a live one from the
holder named, who is then fenced out.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

from kvj.errors import FormatError, InvalidArgument, JournalLocked, KvjError
from kvj.replica.remote import LostRace, Remote, RemoteUnavailable, UnexpectedSize
from kvj.untrusted import json_field, load_json, printable

LEASE_OBJECT = "lock.json"
DEFAULT_TTL = 30.0
#: The longest a lease lasts after it was written (--lease-ttl is at most this).
MAX_TTL = 3600.0
MAX_LEASE_BYTES = 4096
MAX_OWNER = 256
#: The holder --break-lease names to replace a lock.json that is not a kvj lease.
UNREADABLE = "unreadable"


class LeaseHeld(JournalLocked):
    """Another replicator holds the replica's lease (exit status 75, naming the holder)."""

    def __init__(self, url: str, owner: str, expires_at: float, now: float, breaking: Optional[str] = None,
                 message: Optional[str] = None):
        self.path, self.pid, self.owner = url, None, printable(owner, 4 * MAX_OWNER)
        left = f"{max(0.0, expires_at - now):.0f} s more"
        if message is None and breaking is not None:
            message = (f"replica {url} is leased by {self.owner}, not {printable(breaking)}, for {left}: "
                       "nothing was broken")
        KvjError.__init__(self, message or f"replica {url} is leased by another replicator ({self.owner}) for "
                          f"{left}; try again later, or if that replicator is gone: "
                          f"kvj replicate --break-lease {shlex.quote(self.owner)}")


class Fenced(LeaseHeld):
    """This replicator's lease was taken over: nothing more it uploads may count."""

    def __init__(self, url: str, owner: str, generation: int, mine: int):
        shown = printable(owner, 4 * MAX_OWNER)
        super().__init__(url, owner, 0, 0, message=f"replica {url}: lease generation {mine} was taken over by "
                         f"{shown} (generation {generation}); this replicator stops")


@dataclass
class _Holder:
    """``lock.json`` as read; ``problem`` says why it is not a kvj lease, if it is not."""

    etag: Optional[str]
    owner: str = ""
    generation: int = 0
    expires_at: float = 0.0  # clamped to MAX_TTL after the object was written
    problem: Optional[str] = None


class Lease:
    """This replicator's hold on ``lock.json``; ``generation`` is valid once acquired."""

    def __init__(self, remote: Remote, owner: Optional[str] = None, ttl: float = DEFAULT_TTL,
                 clock: Callable[[], float] = time.time):
        if not 0 < ttl <= MAX_TTL:
            raise InvalidArgument(f"a lease TTL of {ttl:g} s is not in (0, {MAX_TTL:g}] s")
        self.remote = remote
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.ttl = ttl
        self.clock = clock
        self.generation = 0
        self.expires_at = 0.0
        self._etag: Optional[str] = None
        self._unacked: Optional[bytes] = None  # a body sent whose answer was lost
        self.broken: Optional[str] = None  # the holder acquire broke the lease of, as printed

    def _read(self) -> Optional[_Holder]:
        """``lock.json`` as it is now, None when there is none."""
        try:
            found = self.remote.get(LEASE_OBJECT, MAX_LEASE_BYTES)
        except UnexpectedSize as exc:
            return _Holder(exc.etag, problem=exc.reason)
        if found is None:
            return None
        try:
            doc = load_json(found.data, "the lease", max_bytes=MAX_LEASE_BYTES)
            owner = json_field(doc, "owner", str)
            if not 0 < len(owner) <= MAX_OWNER:
                raise FormatError(f"owner is not a name of 1-{MAX_OWNER} characters")
            generation, expires_at = json_field(doc, "generation", int), json_field(doc, "expires_at", float)
        except (FormatError, KeyError, TypeError) as exc:
            return _Holder(found.etag, problem=printable(exc))
        return _Holder(found.etag, owner, generation, min(expires_at, found.mtime + MAX_TTL))

    def _write(self, generation: int, expires_at: float, etag: Optional[str]) -> None:
        body = json.dumps({"owner": self.owner, "generation": generation, "expires_at": expires_at}).encode()
        try:
            self._etag = self.remote.put_if_match(LEASE_OBJECT, body, etag, unacked=self._unacked)
        except RemoteUnavailable:
            self._unacked = body  # it may have landed: if lock.json holds it, it is still ours
            raise
        self._unacked = None
        self.generation, self.expires_at = generation, expires_at

    def acquire(self, floor: int = 0, breaking: Optional[str] = None) -> int:
        """Take the lease (new, expired or released); ``LeaseHeld`` if a live one is another's.
        ``floor``: the highest generation seen elsewhere (the manifest's), so a lost
        ``lock.json`` never lets one repeat. ``breaking`` takes a live lease from the holder
        it names as kvj prints it (``UNREADABLE``: a ``lock.json`` that is not a lease)."""
        now = self.clock()
        held = self._read()
        broken = None
        if held is not None and held.problem is not None:
            if breaking != UNREADABLE:
                raise FormatError(f"{self.remote.url}/{LEASE_OBJECT} is not a kvj lease ({held.problem}); if no "
                                  f"replicator is running, replace it: kvj replicate --break-lease {UNREADABLE}")
            broken = UNREADABLE
        elif held is not None and held.owner != self.owner and held.expires_at > now:
            broken = printable(held.owner, 4 * MAX_OWNER)
            if breaking != broken:
                raise LeaseHeld(self.remote.url, held.owner, held.expires_at, now, breaking)
        generation = max(held.generation if held else 0, floor) + 1
        try:
            self._write(generation, now + self.ttl, held.etag if held else None)
        except LostRace:
            again = self._read()
            if again is None or again.problem is not None:
                raise LeaseHeld(self.remote.url, "unknown", now, now) from None
            raise LeaseHeld(self.remote.url, again.owner, again.expires_at, now) from None
        self.broken = broken
        return generation

    def ensure(self) -> None:
        """Renew once less than half the TTL is left (before every commit); ``Fenced`` if the
        lease was taken over meanwhile."""
        if self.expires_at - self.clock() < self.ttl / 2:
            try:
                self._write(self.generation, self.clock() + self.ttl, self._etag)
            except LostRace:
                raise self.fenced() from None

    def fenced(self) -> Fenced:
        """The error for this lease having been taken over, naming the current holder."""
        held = self._read()
        if held is None:
            return Fenced(self.remote.url, "nobody (lock.json was removed)", 0, self.generation)
        if held.problem is not None:
            return Fenced(self.remote.url, f"something that is not a kvj lease ({held.problem})", 0, self.generation)
        return Fenced(self.remote.url, held.owner, held.generation, self.generation)

    def release(self) -> None:
        """Give the lease up (written expired, same generation); best effort if already lost."""
        if self._etag is None:
            return
        try:
            self._write(self.generation, 0.0, self._etag)
        except LostRace:
            pass
        self._etag = None
