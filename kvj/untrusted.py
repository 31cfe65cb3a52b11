"""Reading and showing what kvj does not control: JSON documents found on disk or in a replica
(``kvj.conf``, ``manifest.json``, ``lock.json``), bounded in size, nesting and numbers, and
text from them escaped before it reaches a terminal."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Union

from kvj.errors import FormatError
from kvj.fileio import PathLike, read_bounded

#: Deeper than any document kvj writes (a manifest is five levels deep).
MAX_DEPTH = 32
#: Larger than any integer kvj writes (LSNs, sizes, generations, times all fit).
MAX_INT = (1 << 63) - 1


def _constant(name: str) -> Any:
    raise FormatError(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise FormatError(f"{text[:40]} does not fit a 64-bit float")
    return value


def _int(text: str) -> int:
    value = int(text) if len(text) <= 20 else None
    if value is None or not -MAX_INT - 1 <= value <= MAX_INT:
        raise FormatError(f"{text[:40]}{'...' if len(text) > 40 else ''} does not fit 64 bits")
    return value


def _depth(doc: Any, limit: int) -> int:
    """How deeply ``doc`` nests, iteratively (the check itself cannot overflow the stack)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def load_json(data: Union[bytes, str], what: str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse the JSON document ``what`` (named in errors); ``FormatError`` when it is over
    ``max_bytes``, not UTF-8 JSON, nested deeper than ``max_depth``, or holds NaN, Infinity,
    an overflowing float or an integer beyond 64 bits."""
    if len(data) > max_bytes:
        raise FormatError(f"{what} is {len(data)} bytes, more than the {max_bytes} it may be")
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        doc = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except RecursionError:
        raise FormatError(f"{what} is nested more than {max_depth} levels deep") from None
    except FormatError as exc:
        raise FormatError(f"{what}: {exc}") from None
    except ValueError as exc:  # UnicodeDecodeError and json.JSONDecodeError included
        raise FormatError(f"{what} is not JSON: {exc}") from None
    if _depth(doc, max_depth) > max_depth:
        raise FormatError(f"{what} is nested more than {max_depth} levels deep")
    return doc


def read_json(path: PathLike, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON document in the small file ``path`` (``read_bounded``, then ``load_json``)."""
    return load_json(read_bounded(path, max_bytes), os.fspath(path), max_bytes=max_bytes, max_depth=max_depth)


_KINDS = {int: "an integer", float: "a time", str: "a string", bool: "true or false", list: "a list",
          dict: "an object"}


def json_field(doc: Any, key: Any, kind: type, what: str = "", hi: int = MAX_INT) -> Any:
    """``doc[key]`` of a parsed untrusted document, ``FormatError`` unless it is ``kind``: an
    ``int`` in 0..``hi`` (never a bool), a ``float`` (any finite number, as a float), a ``str``,
    ``bool``, ``list`` or ``dict``. ``what`` names it in the error (default: ``key``)."""
    value = doc[key]
    if kind is int:
        ok = type(value) is int and 0 <= value <= hi
    elif kind is float:
        ok = type(value) in (int, float) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = f"an integer in 0..{hi}" if kind is int else _KINDS[kind]
        raise FormatError(f"{what or key} {printable(value, 40)} is not {expected}")
    return value


def printable(text: object, limit: int = 200) -> str:
    """``text`` safe for a terminal on one line: unprintable characters escaped as Python
    writes them, at most ``limit`` characters (then ``...``)."""
    text = str(text)
    shown = text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[:limit] + "..."
