"""Reader for the JSON-lines journal of the well-known KVJournal write-up, for migration.

One JSON object per line, fsynced per line::

    {"op": "start", "id": ..., "prompt_hash": ...}
    {"op": "seg_flush", "id": ..., "seg": ..., "ptr": ..., "size": ...}
    {"op": "end", "id": ...}

Line numbers serve as LSNs. An incomplete or unparsable last line is a torn tail; a bad
line before the last one is corruption.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.fileio import open_read
from kvj.journal.reader import TornTail
from kvj.journal.records import RecordType
from kvj.names import check_request_id

MAX_LINE = 1 << 20


def convert_legacy(obj: Any) -> Tuple[int, Dict[str, Any]]:
    """Map one legacy object to (record type, kvj payload); ``FormatError`` if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise FormatError("not an object with an 'op' field")
    op = obj["op"]
    rid = check_request_id(obj.get("id"))
    if op == "start":
        ph = obj.get("prompt_hash")
        return RecordType.START, {"id": rid, "prompt_hash": None if ph is None else str(ph),
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
        return RecordType.END, {"id": rid, "status": str(obj.get("status", "ok"))}
    raise FormatError(f"unknown op {op!r}")


class LegacyScan:
    """One pass over a JSON-lines journal; ``tail`` is set when the last line is torn."""

    def __init__(self, path: str, *, strict: bool = False):
        self.path, self.strict = path, strict
        self.tail: Optional[TornTail] = None
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
            is_last = nl == -1 or data[nl + 1:].strip(b"\0 \n\r\t") == b""
            try:
                if len(line) > MAX_LINE:
                    raise FormatError(f"line longer than {MAX_LINE} bytes")
                if nl == -1:
                    raise FormatError("line has no newline (torn write)")
                text = line.decode("utf-8").strip()
                if not text:
                    offset = end + 1
                    continue
                rtype, payload = convert_legacy(json.loads(text))
            except (ValueError, RecursionError, KvjError) as exc:  # deep nesting: RecursionError
                if is_last and not self.strict:
                    self.tail = TornTail(self.path, offset, len(data) - offset)
                    return
                raise CorruptionError(self.path, offset, f"line {lineno}: {exc}") from None
            self.last_lsn = lineno
            yield lineno, int(rtype), payload
            offset = end + 1
