"""What a writer knows of the requests in flight: their segment numbers and token ranges.

``Journal.flush`` asks ``InFlight.claim`` before anything is stored, so that a flush the
log could never make sense of is refused at the call and nothing is appended: a request
that is not in flight (never started, or ended), or tokens
that overlap another segment of the request (flushing a segment number again replaces
that segment, as replay reads it). Requests started through this writer are known from
their ``start``; a flush naming one it does not know (a request in flight before it opened
the journal, being resumed; one started by a record written around the ``Journal``) looks
the journal itself up first: one replay, which finds every resumed request at once.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Tuple

from kvj.errors import InvalidArgument

Range = Tuple[int, int]


class InFlight:
    """Request id -> {segment number: token range} for every request known to be in flight."""

    def __init__(self, load: Callable[[], Dict[str, Dict[int, Range]]]):
        """``load`` returns the requests in flight in the journal as written so far (called
        when a flush names a request not known here)."""
        self._load = load
        self._live: Dict[str, Dict[int, Range]] = {}
        self._lock = threading.Lock()

    def started(self, request_id: str) -> None:
        """A start: a new incarnation of ``request_id``, with no segments yet."""
        with self._lock:
            self._live[request_id] = {}

    def ended(self, request_id: str) -> None:
        with self._lock:
            self._live.pop(request_id, None)

    def segment(self, request_id: str, seg: int, tokens: Range) -> None:
        """A segment record appended without ``claim`` (``Journal.append``): remembered, not checked."""
        with self._lock:
            if request_id in self._live:
                self._live[request_id][seg] = tokens

    def claim(self, request_id: str, seg: int, tokens: Range) -> None:
        """Check a flush of segment ``seg`` over ``tokens`` and remember it; ``InvalidArgument``
        says why one is refused."""
        with self._lock:
            if request_id not in self._live:
                for rid, segments in self._load().items():
                    self._live.setdefault(rid, segments)  # what this writer did itself wins
            segments = self._live.get(request_id)
            if segments is None:
                raise InvalidArgument(f"request {request_id} is not in flight (never started, or ended): record its "
                                      "start first; nothing was flushed")
            lo, hi = tokens
            for other, (a, b) in sorted(segments.items()):
                if other != seg and lo < b and a < hi:
                    raise InvalidArgument(f"request {request_id}: segment {seg} over tokens {lo}..{hi} overlaps its "
                                          f"segment {other} (tokens {a}..{b}); nothing was flushed")
            segments[seg] = (lo, hi)
