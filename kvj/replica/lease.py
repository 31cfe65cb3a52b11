"""The replica's lease (Litestream's ``lock.json``): one replicator per replica at a time.

``lock.json`` holds ``{"owner", "generation", "expires_at"}``. It is acquired with a
create-only write, renewed and taken over (once expired or released) with a write
conditional on its ETag; releasing writes an expired lease the same way, so the object
is never deleted and generations only grow. The generation is the fencing token: it is
written into the manifest and into every log part and snapshot object name, and a
replicator that finds a newer generation in either stops (``Fenced``).

A lease lasts at most ``MAX_TTL`` after it was written (the object's last-modified time),
whatever its ``expires_at`` says, so a lease claiming the year 3000 still ends. Breaking a
lease (``acquire(breaking=HOLDER)``, ``kvj replicate --break-lease HOLDER``) takes it over
before it expires, only from the holder named: a live holder is then fenced out like one
whose lease expired, so breaking can cost the old holder its round, never the replica its
consistency.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

from kvj.errors import FormatError, InvalidArgument, JournalLocked, KvjError
from kvj.replica.remote import LostRace, UnexpectedSize, Remote, RemoteUnavailable
from kvj.untrusted import MAX_INT, load_json, printable

LEASE_OBJECT = "lock.json"
DEFAULT_TTL = 30.0
#: The longest a lease lasts after it was written (--lease-ttl is at most this).
MAX_TTL = 3600.0
MAX_LEASE_BYTES = 4096
MAX_OWNER = 256
#: The holder --break-lease names to replace a lock.json that is not a kvj lease.
UNREADABLE = "unreadable"


def _break_hint(holder: str) -> str:
    import shlex

    return f"kvj replicate --break-lease {shlex.quote(holder)}"


class LeaseHeld(JournalLocked):
    """Another replicator holds the replica's lease (exit status 75, naming the holder)."""

    def __init__(self, url: str, owner: str, expires_at: float, now: float, breaking: Optional[str] = None):
        shown = printable(owner, 4 * MAX_OWNER)
        self.path, self.pid, self.owner = url, None, shown
        left = f"{max(0.0, expires_at - now):.0f} s more"
        if breaking is not None:
            KvjError.__init__(self, f"replica {url} is leased by {shown}, not {printable(breaking)}, for {left}: "
                                    "nothing was broken")
        else:
            KvjError.__init__(self, f"replica {url} is leased by another replicator ({shown}) for {left}; try again "
                                    f"later, or if that replicator is gone: {_break_hint(shown)}")


class Fenced(LeaseHeld):
    """This replicator's lease was taken over: nothing more it uploads may count."""

    def __init__(self, url: str, owner: str, generation: int, mine: int):
        shown = printable(owner, 4 * MAX_OWNER)
        self.path, self.pid, self.owner = url, None, shown
        KvjError.__init__(self, f"replica {url}: lease generation {mine} was taken over by {shown} "
                                f"(generation {generation}); this replicator stops")


def default_owner() -> str:
    """host:pid:random — unique per replicator process."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass
class _Holder:
    """``lock.json`` as read: its lease (None when it is not a kvj lease: ``problem`` says why)."""

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
        self.owner = owner or default_owner()
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
            return _Holder(exc.etag, problem=f"{exc.reason}")
        if found is None:
            return None
        try:
            doc = load_json(found.data, "the lease", max_bytes=MAX_LEASE_BYTES)
            owner, generation, expires_at = doc["owner"], doc["generation"], doc["expires_at"]
        except (FormatError, KeyError, TypeError) as exc:
            return _Holder(found.etag, problem=printable(exc))
        if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER:
            return _Holder(found.etag, problem=f"owner is not a name of 1-{MAX_OWNER} characters")
        if type(generation) is not int or not 0 <= generation <= MAX_INT:
            return _Holder(found.etag, problem=f"generation {printable(generation, 40)} is not a 64-bit count")
        if type(expires_at) not in (int, float) or not math.isfinite(expires_at):
            return _Holder(found.etag, problem=f"expires_at {printable(expires_at, 40)} is not a time")
        return _Holder(found.etag, owner, generation, min(float(expires_at), found.mtime + MAX_TTL))

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
        """Take the lease (new, expired or released); LeaseHeld if a live one is someone else's.

        ``floor`` is the highest generation seen elsewhere (the manifest's), so a lost or
        deleted ``lock.json`` never lets a generation repeat. ``breaking`` takes the lease
        from a live holder, only if it names that holder as kvj prints it (or is
        ``UNREADABLE`` for a ``lock.json`` that is not a kvj lease).
        """
        now = self.clock()
        held = self._read()
        broken = None
        if held is not None and held.problem is not None:
            if breaking != UNREADABLE:
                raise FormatError(f"{self.remote.url}/{LEASE_OBJECT} is not a kvj lease ({held.problem}); if no "
                                  f"replicator is running, replace it: {_break_hint(UNREADABLE)}")
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

    def renew(self) -> None:
        """Extend the lease; ``Fenced`` if another replicator took it over meanwhile."""
        try:
            self._write(self.generation, self.clock() + self.ttl, self._etag)
        except LostRace:
            raise self.fenced() from None

    def ensure(self) -> None:
        """Renew once less than half the TTL is left (called before every commit)."""
        if self.expires_at - self.clock() < self.ttl / 2:
            self.renew()

    def fenced(self) -> Fenced:
        """The error for this lease having been taken over, naming the current holder."""
        held = self._read()
        if held is None:
            return Fenced(self.remote.url, "nobody (lock.json was removed)", 0, self.generation)
        if held.problem is not None:
            return Fenced(self.remote.url, f"something that is not a kvj lease ({held.problem})", 0, self.generation)
        return Fenced(self.remote.url, held.owner, held.generation, self.generation)

    def release(self) -> None:
        """Give the lease up (an expired lease, same generation); best effort if already lost."""
        if self._etag is None:
            return
        try:
            self._write(self.generation, 0.0, self._etag)
        except LostRace:
            pass
        self._etag = None
