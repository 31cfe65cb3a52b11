"""Parsers of option values: durations, sizes, times, ranges, KEY=VALUE pairs, strict JSON."""

from __future__ import annotations

import json
import math
import re
import time
from datetime import datetime
from typing import Any, Optional, Tuple

import typer

from kvj.errors import FormatError


def _no_constant(name: str) -> Any:
    raise FormatError(f"{name} is not a JSON value")


def loads_strict(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity (not JSON; what kvj prints must stay JSON);
    anything it cannot read, absurd nesting included, is ``FormatError``."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise FormatError("JSON nested too deeply") from None
    except ValueError as exc:
        raise FormatError(f"not JSON: {exc}") from None


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_BARE_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")


#: The one rule every command's time arguments follow (each man page states it).
DURATION_RULE = ("a DURATION is a number with its unit: ms, s, m, h, d or w (90s, 15m, 1h, 7d); a bare number "
                 "is refused, except 0")
TIME_RULE = ("a TIME is ISO 8601 (2026-11-29T15:00, local time unless it names a zone), @ and Unix seconds "
             "(@1796134025, as date -d takes them), or a DURATION ago (10m); a bare number is refused")


def parse_duration(text: str, option: Optional[str] = None) -> float:
    """Seconds from ``90s``, ``15m``, ``1h``, ``2d`` (``DURATION_RULE``: the unit is required,
    so that ``7`` is never read as seven seconds when seven days were meant; ``0`` is zero)."""
    text = text.strip()
    if text == "0":
        return 0.0
    m = _DURATION.match(text)
    if not m:
        why = "has no unit" if _BARE_NUMBER.match(text) else "is not a duration"
        raise typer.BadParameter(f"{text!r} {why}: {DURATION_RULE}", param_hint=option)
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds):
        raise typer.BadParameter(f"{text!r} is too long a duration", param_hint=option)
    return seconds


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(|B|K|KB|KiB|M|MB|MiB|G|GB|GiB|T|TB|TiB)$", re.I)


def parse_size(text: str, option: Optional[str] = None) -> int:
    """Bytes from ``65536``, ``64KiB``, ``64MiB``, ``1G``, ``2T`` (K, M, G, T are binary, as ls -h)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size (use e.g. 64MiB, 512K, 1G)", param_hint=option)
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])


def parse_time(text: str, option: Optional[str] = None, now: Optional[float] = None) -> float:
    """A point in time as Unix seconds (``TIME_RULE``): ISO 8601 (``2026-11-29T15:00``),
    ``@`` and Unix seconds (``@1796134025``), or a duration ago (``10m``). A bare number is
    refused: it could mean seconds ago or Unix seconds, and each reading was once some
    command's."""
    text = text.strip()
    unix = re.fullmatch(r"@(-?\d+(?:\.\d+)?)", text)
    if unix:
        return float(unix.group(1))
    if _BARE_NUMBER.match(text):
        raise typer.BadParameter(f"{text!r} is a bare number: {TIME_RULE}", param_hint=option)
    try:
        return datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError, OSError):
        pass
    try:
        return (time.time() if now is None else now) - parse_duration(text, option)
    except typer.BadParameter:
        raise typer.BadParameter(f"{text!r} is not a time: {TIME_RULE}", param_hint=option) from None


def parse_range(text: str, what: str = "range") -> Tuple[int, int]:
    """``A:B`` (end exclusive) as two non-negative ints."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or int(m.group(1)) > int(m.group(2)):
        raise typer.BadParameter(f"{text!r} is not a {what} START:END with START <= END")
    return int(m.group(1)), int(m.group(2))


def parse_pairs(items: Optional[list], what: str, typed: bool = True) -> dict:
    """``key=value`` options into a dict; with ``typed``, values that parse as JSON keep their type."""
    result: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=what)
        try:
            result[key] = loads_strict(value) if typed else value
        except FormatError:  # not JSON (or NaN, nested absurdly): the text itself
            result[key] = value
    return result
