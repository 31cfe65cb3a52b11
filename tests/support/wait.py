"""Waiting for a condition, never for a fixed time: tests must pass on a loaded machine."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate: Callable[[], object], what: str = "the condition", timeout: float = 60.0,
             interval: float = 0.01) -> None:
    """Poll ``predicate`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(interval)


def wait_progressing(predicate: Callable[[], object], progress: Callable[[], object], what: str = "the condition",
                     stall: float = 120.0, interval: float = 0.05) -> None:
    """Poll ``predicate`` until it is true, for as long as ``progress()`` keeps changing: fail
    naming ``what`` only after ``stall`` seconds without a change (a slow machine is waited
    for; a stuck one is reported)."""
    last, since = progress(), time.monotonic()
    while not predicate():
        now = progress()
        if now != last:
            last, since = now, time.monotonic()
        assert time.monotonic() - since < stall, f"no progress for {stall:.0f} s waiting for {what} (at {last!r})"
        time.sleep(interval)
