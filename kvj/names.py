"""Request ids and segment keys, validated before they become parts of paths (no traversal)."""

from __future__ import annotations

import re
from typing import Any

from kvj.errors import InvalidName

ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,255}")
KEY_RE = re.compile(r"[0-9a-f]{64}")


def check_request_id(request_id: Any) -> str:
    """Validate a request id: 1-256 safe characters, never a path component like '..'."""
    if not isinstance(request_id, str) or not ID_RE.fullmatch(request_id):
        raise InvalidName(f"invalid request id {request_id!r}: use 1-256 of [A-Za-z0-9._:@+=-], "
                          "the first a letter, digit or '_'")
    return request_id


def check_key(key: Any) -> str:
    """Validate a segment key: 64 lowercase hex digits (a BLAKE3-256 content address), never a path."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidName(f"invalid segment key {key!r}: expected 64 lowercase hex digits")
    return key
