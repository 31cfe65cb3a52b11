"""Replay: fold a journal (snapshot plus log files, or a legacy JSON-lines file) into state.

By default replay recovers to the last consistent point: a torn tail ends the log and is
reported in ``state.tail``. ``strict=True`` fails on any damage. Damage in the middle of
the log is always an error (``CorruptionError`` with file and offset), never skipped. In
a mirrored journal, what one copy lacks or holds damaged is read from the other, and
``state.warnings`` says which copy was bad.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.journal.legacy import LegacyScan
from kvj.journal.reader import LOG_RE, Record, Scan, list_logs
from kvj.journal.snapshot import list_snapshots, load_latest
from kvj.journal.state import JournalState


def is_legacy(path: str) -> bool:
    """True when ``path`` is a JSON-lines journal (a file, or a directory without kvj logs)."""
    if os.path.isfile(path):
        return True
    if os.path.isdir(path):
        names = os.listdir(path)
        return not any(LOG_RE.match(n) for n in names) and any(n.endswith((".jsonl", ".ndjson")) for n in names)
    return False


def legacy_file(path: str) -> str:
    """The .jsonl file of a legacy journal: ``path`` itself, or the only one in that directory."""
    if os.path.isfile(path):
        return path
    files = sorted(n for n in os.listdir(path) if n.endswith((".jsonl", ".ndjson")))
    if len(files) != 1:
        raise FormatError(f"{path}: expected one .jsonl journal, found {len(files)}")
    return os.path.join(path, files[0])


class RecordStream:
    """Decoded records of a journal (kvj or legacy) after ``after_lsn``; ``tail`` is known once exhausted."""

    def __init__(self, path: str, *, after_lsn: int = 0, strict: bool = False):
        if not os.path.exists(path):
            raise FormatError(f"no journal at {path}")
        self.legacy = is_legacy(path)
        self._scan: Any = (LegacyScan(legacy_file(path), strict=strict) if self.legacy
                           else Scan(path, after_lsn=after_lsn, strict=strict))
        self.after_lsn = after_lsn

    @property
    def tail(self) -> Optional[Dict[str, Any]]:
        return self._scan.tail.to_dict() if self._scan.tail else None

    @property
    def copy_warnings(self) -> List[str]:
        """What one copy of a mirrored journal lacked or held damaged (read from the other)."""
        if self.legacy:
            return []
        return [f"{d.path}" + (f" at offset {d.offset}" if d.offset is not None else "") + f": {d.reason}"
                for d in self._scan.copies]

    def __iter__(self) -> Iterator[Record]:
        if self.legacy:
            for lsn, rtype, payload in self._scan:
                if lsn > self.after_lsn:
                    yield Record(lsn, rtype, payload, self._scan.path, 0)
            return
        yield from self._scan.records()


def replay(path: str, *, at_lsn: Optional[int] = None, strict: bool = False) -> JournalState:
    """Fold the journal at ``path`` into a ``JournalState``, up to ``at_lsn`` if given.

    ``path`` is a kvj journal directory, or a legacy JSON-lines journal (file or directory).
    """
    if not os.path.exists(path):
        raise FormatError(f"no journal at {path}")
    if is_legacy(path):
        return _replay_once(path, at_lsn, strict)
    for attempt in range(COMPACTION_RETRIES + 1):
        before = (list_snapshots(path), list_logs(path))
        try:
            state = _replay_once(path, at_lsn, strict)
        except (CorruptionError, FileNotFoundError):
            # A compactor may have written a newer snapshot and deleted the files this pass
            # was reading; then the journal is fine and a fresh pass sees it consistently.
            if attempt == COMPACTION_RETRIES or (list_snapshots(path), list_logs(path)) == before:
                raise
            continue
        # A compactor that replaced the snapshot during the pass may have deleted logs after
        # the old snapshot before this pass listed them; when only an empty newest log was
        # left, nothing failed, yet records were missed. Only an unchanged snapshot counts.
        if list_snapshots(path) == before[0]:
            return state
    raise KvjError(f"{path}: the journal kept changing under replay (back-to-back compactions); try again")


#: Fresh passes replay makes when files vanish under it (a concurrent compaction).
COMPACTION_RETRIES = 20


def _replay_once(path: str, at_lsn: Optional[int], strict: bool) -> JournalState:
    state = None if is_legacy(path) else load_latest(path)
    if state is None:
        state = JournalState()
    elif at_lsn is not None and at_lsn < state.snapshot_lsn:
        raise FormatError(f"LSN {at_lsn} precedes the snapshot at LSN {state.snapshot_lsn}: "
                          "history before it was compacted away")
    stream = RecordStream(path, after_lsn=state.snapshot_lsn, strict=strict)
    for rec in stream:
        if at_lsn is not None and rec.lsn > at_lsn:
            break
        state.apply(rec.rtype, rec.payload, rec.lsn)
    state.tail = stream.tail
    state.warnings += stream.copy_warnings
    return state
