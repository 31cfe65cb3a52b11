"""The seed-era JSON-lines journal (of the well-known KVJournal write-up), read only to migrate it
(``kvj migrate``: ``LegacyScan``; ``kvj record ndjson``: ``convert_legacy``); everywhere else
kvj recognises one (``is_seed``) and refuses it, pointing at ``kvj migrate``.

One JSON object per line (``start``, ``seg_flush``, ``end``), fsynced per line; line numbers
serve as LSNs. A last line without its newline, or zeros to the end of the file, is a torn
tail; any complete line that is not a valid record is corruption. NaN, Infinity and numbers
too large for a float are refused, never turned into strings.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, KvjError, LegacyJournal
from kvj.fileio import open_read
from kvj.journal.reader import TornTail
from kvj.journal.records import RecordType
from kvj.names import check_request_id

MAX_LINE = 1 << 20
#: File names a seed-era journal has.
SEED_SUFFIXES = (".jsonl", ".ndjson")


def _text(obj: Dict[str, Any], name: str, default: Optional[str]) -> Optional[str]:
    """A text field: a string, or an integer written as one (a hash); anything else, a float
    above all (1e309 reads as inf), is ``FormatError``."""
    value = obj.get(name, default)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise FormatError(f"{name!r} must be a string, not {value!r}")


def _no_constant(name: str) -> Any:
    raise FormatError(f"{name} is not JSON")


def convert_legacy(obj: Any) -> Tuple[int, Dict[str, Any]]:
    """Map one legacy object to (record type, kvj payload); ``FormatError`` if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise FormatError("not an object with an 'op' field")
    op = obj["op"]
    rid = check_request_id(obj.get("id"))
    if op == "start":
        return RecordType.START, {"id": rid, "prompt_hash": _text(obj, "prompt_hash", None),
                                  "tokens": None, "meta": {"legacy": True}}
    if op == "seg_flush":
        seg, ptr, size = obj.get("seg"), obj.get("ptr"), obj.get("size")
        for name, value in (("seg", seg), ("ptr", ptr), ("size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise FormatError(f"seg_flush field {name!r} must be a non-negative integer")
        return RecordType.SEGMENT, {"id": rid, "seg": seg, "key": None, "tokens": None, "layout": {},
                                    "raw_size": size, "stored_size": size, "digest": None, "codec": "raw",
                                    "ptr": ptr}
    if op == "end":
        return RecordType.END, {"id": rid, "status": _text(obj, "status", "ok")}
    raise FormatError(f"unknown op {op!r}")


class LegacyScan:
    """One pass over a JSON-lines journal; ``tail`` is set when the last line is torn (no
    newline), ``tail_reason`` says what it held."""

    def __init__(self, path: str, *, strict: bool = False):
        self.path, self.strict = path, strict
        self.tail: Optional[TornTail] = None
        self.tail_reason: Optional[str] = None
        self.last_lsn = 0

    def __iter__(self) -> Iterator[Tuple[int, int, Dict[str, Any]]]:
        with open_read(self.path) as f:
            data = f.read()
        offset = 0
        lineno = 0
        while offset < len(data):
            nl = data.find(b"\n", offset)
            end = len(data) if nl == -1 else nl
            line = data[offset:end]
            lineno += 1
            # A line written whole ends with its newline; zeros to the end of the file are space
            # a crash left unwritten, with or without a newline among them.
            torn = nl == -1 or (not line.strip(b"\0") and not data[offset:].strip(b"\0 \n\r\t"))
            try:
                if len(line) > MAX_LINE:
                    raise FormatError(f"line longer than {MAX_LINE} bytes")
                text = line.decode("utf-8").strip()
                if not text and not torn:
                    offset = end + 1
                    continue
                rtype, payload = convert_legacy(json.loads(text, parse_constant=_no_constant))
                if torn:  # the record reads whole, but its write never finished
                    raise FormatError("the record reads whole, but its write was cut short")
            except (ValueError, RecursionError, KvjError) as exc:  # deep nesting: RecursionError
                if torn and not self.strict:
                    self.tail = TornTail(self.path, offset, len(data) - offset)
                    self.tail_reason = str(exc)
                    return
                raise CorruptionError(self.path, offset, f"line {lineno}: {exc}") from None
            self.last_lsn = lineno
            yield lineno, int(rtype), payload
            offset = end + 1


def is_seed(path: str) -> bool:
    """Whether file ``path`` starts with a seed-era record (its first non-blank line, whole):
    how a seed-era journal is told from another file without reading all of it."""
    try:
        with open_read(path) as f:
            head = f.read(MAX_LINE + 1).lstrip(b" \t\r\n")
    except KvjError:  # a link, FIFO or device (UnsafePath): no seed-era journal kvj would read
        return False
    line, newline, _rest = head.partition(b"\n")
    if not newline:
        return False
    try:
        convert_legacy(json.loads(line.decode("utf-8"), parse_constant=_no_constant))
    except (ValueError, RecursionError, KvjError):
        return False
    return True


def refused(path: str) -> LegacyJournal:
    """The one refusal of seed-era journal ``path`` outside ``kvj migrate``."""
    return LegacyJournal(f"{path} is a seed-era JSON-lines journal, which kvj reads only to migrate it: "
                         f"kvj migrate {path} -j NEWDIR (nothing was changed)")
