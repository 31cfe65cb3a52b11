"""What a writer knows of the requests in flight: their segment numbers and token ranges.

``Journal.flush`` asks ``InFlight.claim`` before anything is stored, so that a flush the
log could never make sense of is refused at the call and nothing is appended: a request
that is not in flight (never started, or ended), or tokens
that overlap another segment of the request (flushing a segment number again replaces
that segment, as replay reads it). Requests in flight when the journal was opened come from
the replay ``Journal.open`` makes; those started since, from their ``start``.
"""

from __future__ import annotations

import threading
from typing import Dict, Tuple

from kvj.errors import InvalidArgument

Range = Tuple[int, int]


class InFlight:
    """Request id -> {segment number: token range} for every request known to be in flight."""

    def __init__(self, live: Dict[str, Dict[int, Range]]):
        """``live``: the requests in flight in the journal when it was opened, with their segments."""
        self._live = live
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
