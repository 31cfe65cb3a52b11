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
