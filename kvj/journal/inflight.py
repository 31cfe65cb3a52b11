"""What a writer knows of the requests in flight: each one's segments and their token ranges, so
that ``Journal.flush`` refuses at the call a flush the log could never make sense of, and its
records waiting behind its segment flushes, so that a request's records reach the log in the
order of the calls while the caller never waits for segment I/O.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from kvj.errors import InvalidArgument
from kvj.journal.records import RecordType


class InFlight:
    """Request id -> {segment number: token range} for every request in flight (those of the
    replay ``Journal.open`` made, and those started since), and their records still waiting."""

    def __init__(self, live: Dict[str, Dict[int, Tuple[int, int]]]):
        self._live = live
        self._lock = threading.Lock()
        self._order = threading.Lock()
        #: Per request id, the last of its records still waiting to be appended (see ``in_order``).
        self.waiting: Dict[str, "Future[int]"] = {}
        self._deferred: "set[Future[int]]" = set()

    def track(self, rtype: int, payload: Mapping[str, Any]) -> None:
        """Keep the requests current with a checked record about to be appended: a start is a new
        incarnation without segments; a segment appended without ``claim`` is remembered, not checked."""
        if rtype == RecordType.START:
            with self._lock:
                self._live[payload["id"]] = {}
        elif rtype in (RecordType.END, RecordType.HANDOFF):
            with self._lock:
                self._live.pop(payload["id"], None)
        elif rtype == RecordType.SEGMENT:
            with self._lock:
                if payload["id"] in self._live:
                    self._live[payload["id"]][payload["seg"]] = tuple(payload["tokens"])  # type: ignore[assignment]

    def claim(self, request_id: str, seg: int, lo: int, hi: int) -> None:
        """Check a flush of segment ``seg`` over tokens [lo, hi) and remember it; ``InvalidArgument``
        says why one is refused (flushing a segment number again replaces that segment)."""
        with self._lock:
            segments = self._live.get(request_id)
            if segments is None:
                raise InvalidArgument(f"request {request_id} is not in flight (never started, or ended): record its "
                                      "start first; nothing was flushed")
            for other, (a, b) in sorted(segments.items()):
                if other != seg and lo < b and a < hi:
                    raise InvalidArgument(f"request {request_id}: segment {seg} over tokens {lo}..{hi} overlaps its "
                                          f"segment {other} (tokens {a}..{b}); nothing was flushed")
            segments[seg] = (lo, hi)

    def in_order(self, request_id: str, ready: List["Future[Any]"],
                 append: Callable[[], int]) -> Optional["Future[int]"]:
        """Append a record of ``request_id`` after its earlier records and once ``ready`` are done:
        None when nothing is pending (the caller appends at once), else a future of its LSN;
        ``append`` then runs on the thread that completes the last of them."""
        with self._order:
            before = self.waiting.get(request_id)
            deps = [f for f in ready + ([before] if before is not None else []) if not f.done()]
            if not deps and all(f.exception() is None for f in ready):
                return None
            result: "Future[int]" = Future()
            self.waiting[request_id] = result
            self._deferred.add(result)
            left = [len(deps)]

        def fire() -> None:
            try:
                result.set_result(append())
            except BaseException as exc:
                result.set_exception(exc)
            finally:
                with self._order:
                    if self.waiting.get(request_id) is result:
                        del self.waiting[request_id]
                    self._deferred.discard(result)

        def one_done(_f: "Future[Any]") -> None:
            with self._order:
                left[0] -= 1
                go = left[0] == 0
            if go:
                fire()

        if not deps:
            fire()
        for dep in deps:
            dep.add_done_callback(one_done)
        return result

    def drain(self) -> None:
        """Wait until every record waiting behind a flush is appended (or failed)."""
        while True:
            with self._order:
                deferred = list(self._deferred)
            if not deferred:
                return
            wait(deferred)
