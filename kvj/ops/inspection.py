"""Looking at a journal record by record: sizes, commit groups, filters, descriptions, statistics.

What ``kvj inspect`` shows, as plain data (the CLI only renders it). A record's time is
its commit group's (journal format version 2); for a record of kvj 0.1.0, whose groups
carry no time, it is known exactly only when its payload has one (recovery epochs), and
otherwise lies within the window in which its log file was written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from kvj.journal.framing import RECORD_HEADER_SIZE
from kvj.journal.reader import Scan, decode
from kvj.journal.records import NAMES, RecordType
from kvj.journal.replay import Record, check_journal, hold
from kvj.journal.snapshot import load_latest

TimeWindow = Tuple[Optional[float], Optional[float]]


@dataclass(frozen=True)
class Entry:
    """A decoded record, its framed size on disk and the commit group it arrived in."""

    record: Record
    size: int  # header + payload bytes
    group: int  # ordinal of its commit group in this pass


def type_name(rtype: int) -> str:
    try:
        return NAMES[RecordType(rtype)]
    except ValueError:
        return f"type{rtype}"


class Entries:
    """Every record after ``after_lsn`` (the snapshot's LSN by default) with size and group,
    read, as replay reads, from the files held open when the walk begins (``replay.hold``):
    a compaction meanwhile changes nothing. ``after_lsn`` is known once the walk began."""

    def __init__(self, path: str, *, after_lsn: Optional[int] = None, strict: bool = False):
        check_journal(path)
        self.path = path
        self.after_lsn = after_lsn
        self.strict = strict
        self.tail: Optional[Dict[str, Any]] = None
        self.logs: List[str] = []

    def __iter__(self) -> Iterator[Entry]:
        files, _ = hold(self.path)
        with files:
            if self.after_lsn is None:
                snap = load_latest(self.path, files)
                self.after_lsn = snap.snapshot_lsn if snap else 0
            scan = Scan(self.path, after_lsn=self.after_lsn, strict=self.strict, files=files)
            self.logs = scan.logs
            group = 0
            end_of_prev: Tuple[str, int] = ("", -1)
            for raw in scan:
                if (raw.path, raw.offset) != end_of_prev:
                    group += 1  # a group header sits between this record and the previous one
                size = RECORD_HEADER_SIZE + len(raw.payload)
                end_of_prev = (raw.path, raw.offset + size)
                yield Entry(decode(raw), size, group)
            self.tail = scan.tail.to_dict() if scan.tail else None


def file_windows(logs: Iterable[str]) -> Dict[str, TimeWindow]:
    """When each log file was written: after the previous file's last write, up to its own."""
    windows: Dict[str, TimeWindow] = {}
    previous: Optional[float] = None
    for path in logs:
        try:
            mtime: Optional[float] = os.stat(path).st_mtime
        except OSError:
            mtime = None
        windows[path] = (previous, mtime)
        previous = mtime if mtime is not None else previous
    return windows


def record_time(rec: Record, windows: Dict[str, TimeWindow]) -> TimeWindow:
    """(earliest, latest) time ``rec`` can have been written; None where unknown."""
    if rec.time is not None:
        return rec.time, rec.time
    t = rec.payload.get("time")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return float(t), float(t)
    return windows.get(rec.path, (None, None))


@dataclass
class Filter:
    """Which records to show. Empty sets and None bounds match everything."""

    requests: Set[str] = field(default_factory=set)
    types: Set[int] = field(default_factory=set)
    lsn_from: Optional[int] = None
    lsn_to: Optional[int] = None
    since: Optional[float] = None
    until: Optional[float] = None

    def __call__(self, rec: Record, when: TimeWindow = (None, None)) -> bool:
        if self.lsn_from is not None and rec.lsn < self.lsn_from:
            return False
        if self.lsn_to is not None and rec.lsn > self.lsn_to:
            return False
        if self.types and rec.rtype not in self.types:
            return False
        if self.requests and rec.payload.get("id") not in self.requests:
            return False
        lo, hi = when
        if self.since is not None and hi is not None and hi < self.since:
            return False
        if self.until is not None and lo is not None and lo > self.until:
            return False
        return True


def record_json(rec: Record) -> Dict[str, Any]:
    """A record as one flat JSON object: lsn, type, file, offset, then its payload fields."""
    return {"lsn": rec.lsn, "type": type_name(rec.rtype), "time": rec.time, "file": os.path.basename(rec.path),
            "offset": rec.offset, **rec.payload}


def human_size(n: float) -> str:
    """Bytes in binary units (1.5 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


#: Hex digits of a segment key that every listing shows (kvj inspect --segment and kvj dump take such a prefix).
SHORT_KEY = 12


def short_key(key: str) -> str:
    """A segment key as listings show it: its first ``SHORT_KEY`` hex digits."""
    return key[:SHORT_KEY]


def _start(p: Dict[str, Any]) -> str:
    tokens = f" tokens={len(p['tokens'])}" if p.get("tokens") is not None else ""
    meta = f" meta={p['meta']}" if p.get("meta") else ""
    prompt = p.get("prompt_hash")
    if isinstance(prompt, str) and len(prompt) > 16:
        prompt = prompt[:12] + "…"  # a full digest is noise on a line; --json has it whole
    return f"id={p['id']} prompt_hash={prompt}{tokens}{meta}"


def _segment(p: Dict[str, Any]) -> str:
    ratio = p["raw_size"] / p["stored_size"] if p["stored_size"] else 0.0
    tokens = p["tokens"] or [None, None]
    return (f"id={p['id']} seg={p['seg']} tokens={tokens[0]}..{tokens[1]} key={short_key(p['key'])} "
            f"{human_size(p['raw_size'])}->{human_size(p['stored_size'])} ({ratio:.2f}x {p['codec']})")


#: Record type -> its line's fields, from the payload.
_LINES: Dict[RecordType, Callable[[Dict[str, Any]], str]] = {
    RecordType.START: _start,
    RecordType.SEGMENT: _segment,
    RecordType.END: lambda p: f"id={p['id']} status={p['status']}",
    RecordType.ALLOC: lambda p: f"{p['device']} addr={p['addr']:#x} size={human_size(p['size'])} tag={p['tag']}",
    RecordType.FREE: lambda p: f"{p['device']} addr={p['addr']:#x}",
    RecordType.CHECKPOINT: lambda p: f"step={p['step']} tensors={len(p['keys'])}",
    RecordType.DELTA: lambda p: f"step={p['step']} base={p['base_step']} tensors={len(p['keys'])}",
    RecordType.EPOCH: lambda p: f"epoch={p['epoch']} recovered_lsn={p['recovered_lsn']} manifest={p.get('manifest')}",
    RecordType.TOKENS: lambda p: f"id={p['id']} at={p['at']} tokens={len(p['tokens'])}",
    RecordType.HANDOFF: lambda p: f"id={p['id']} moved to {p['to']}",
}


def describe(rec: Record) -> str:
    """One line in the spirit of pg_waldump: the fields that matter for this type."""
    line = _LINES.get(rec.rtype)
    return line(rec.payload) if line else f"unknown record type {rec.rtype}: {sorted(rec.payload)}"


@dataclass
class Stats:
    """Counts and bytes by type, commit groups, compression, largest requests (``--stats``)."""

    records: int = 0
    bytes: int = 0
    groups: int = 0
    max_group: int = 0
    first_lsn: Optional[int] = None
    last_lsn: Optional[int] = None
    by_type: Dict[str, Dict[str, int]] = field(default_factory=dict)
    raw_bytes: int = 0
    stored_bytes: int = 0
    by_codec: Dict[str, Dict[str, int]] = field(default_factory=dict)
    requests: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    _group: int = 0
    _in_group: int = 0

    def add(self, entry: Entry) -> None:
        rec = entry.record
        self.records += 1
        self.bytes += entry.size
        if self.first_lsn is None:
            self.first_lsn = rec.lsn
        self.last_lsn = rec.lsn
        if entry.group != self._group:
            self._group, self._in_group = entry.group, 0
            self.groups += 1
        self._in_group += 1
        self.max_group = max(self.max_group, self._in_group)
        kind = self.by_type.setdefault(type_name(rec.rtype), {"count": 0, "bytes": 0})
        kind["count"] += 1
        kind["bytes"] += entry.size
        p = rec.payload
        if rec.rtype == RecordType.START:
            self._request(p["id"])["started"] = True
        elif rec.rtype == RecordType.SEGMENT:
            self.raw_bytes += p["raw_size"]
            self.stored_bytes += p["stored_size"]
            codec = self.by_codec.setdefault(p.get("codec") or "?", {"segments": 0, "raw": 0, "stored": 0})
            codec["segments"] += 1
            codec["raw"] += p["raw_size"]
            codec["stored"] += p["stored_size"]
            req = self._request(p["id"])
            req["segments"] += 1
            req["raw"] += p["raw_size"]
            req["stored"] += p["stored_size"]
            if p.get("tokens"):
                req["tokens"] = max(req["tokens"], p["tokens"][1])
        elif rec.rtype == RecordType.END:
            self._request(p["id"])["ended"] = True
        elif rec.rtype == RecordType.HANDOFF:
            self._request(p["id"]).update(ended=True, moved_to=p["to"])

    def _request(self, rid: str) -> Dict[str, Any]:
        return self.requests.setdefault(rid, {"id": rid, "segments": 0, "raw": 0, "stored": 0, "tokens": 0,
                                              "started": False, "ended": False})

    def largest(self, n: int = 5) -> List[Dict[str, Any]]:
        return sorted(self.requests.values(), key=lambda r: (-r["stored"], r["id"]))[:n]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "records": self.records, "bytes": self.bytes, "first_lsn": self.first_lsn, "last_lsn": self.last_lsn,
            "by_type": self.by_type, "commit_groups": self.groups,
            "records_per_commit": round(self.records / self.groups, 2) if self.groups else 0.0,
            "largest_commit": self.max_group,
            "segments": {"raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes,
                         "ratio": round(self.raw_bytes / self.stored_bytes, 3) if self.stored_bytes else None,
                         "by_codec": self.by_codec},
            "requests": len(self.requests), "largest_requests": self.largest(),
            "moved": {r["id"]: r["moved_to"] for r in self.requests.values() if r.get("moved_to")},
        }


def engine_stats(stats: List[Stats]) -> Dict[str, Any]:
    """An engine's totals over its rank journals' ``Stats``: records, bytes, commit groups, types
    and segment bytes summed; requests counted once (every rank journals each of them)."""
    by_type: Dict[str, Dict[str, int]] = {}
    for acc in stats:
        for name, row in acc.by_type.items():
            total = by_type.setdefault(name, {"count": 0, "bytes": 0})
            total["count"] += row["count"]
            total["bytes"] += row["bytes"]
    raw, stored = sum(acc.raw_bytes for acc in stats), sum(acc.stored_bytes for acc in stats)
    return {"records": sum(acc.records for acc in stats), "bytes": sum(acc.bytes for acc in stats),
            "commit_groups": sum(acc.groups for acc in stats), "by_type": by_type,
            "segments": {"raw_bytes": raw, "stored_bytes": stored, "ratio": round(raw / stored, 3) if stored else None},
            "requests": len({rid for acc in stats for rid in acc.requests})}
