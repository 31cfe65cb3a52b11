"""The replica manifest (``manifest.json``): which objects make up the replicated journal.

Restore and verify read only what it names; it is replaced by compare-and-swap on its ETag,
and carries the lease generation, so a replicator that lost its lease can never commit.

    {"format": "kvj-replica", "version": 1, "generation": G, "updated": T, "last_lsn": L,
     "snapshot": {"lsn", "object", "size", "blake3"} | null,
     "logs": [{"seq", "base_lsn", "salt", "size", "last_lsn", "sealed",
               "parts": [{"object", "start", "end", "blake3"}]}],
     "history": [[T, L], ...],          # when each LSN became replicated (for --at TIME)
     "garbage": {"object": T}}          # no longer needed since T; deleted after the grace
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import blake3

from kvj.errors import CorruptionError, FormatError
from kvj.replica.remote import Remote
from kvj.untrusted import json_field, load_json, printable

MANIFEST_OBJECT = "manifest.json"
FORMAT = "kvj-replica"
VERSION = 1
HISTORY_LIMIT = 1000
#: Far more than a manifest of thousands of log files takes; a larger one is refused unread.
MAX_MANIFEST_BYTES = 64 << 20
#: S3's limit for one upload: every object kvj writes is a single PUT, so none is larger.
MAX_OBJECT_BYTES = 5 << 30

_PART_RE = re.compile(r"logs/([0-9]{16,19})/([0-9]{16,19})-([0-9]{16,19})\.g([0-9]{1,19})\.part")
_SNAP_RE = re.compile(r"snapshots/([0-9]{16,19})\.g([0-9]{1,19})\.snap")
_SEG_RE = re.compile(r"segments/([0-9a-f]{2})/([0-9a-f]{64})\.kvjseg")


def digest(data: Any) -> str:
    """Hex BLAKE3 of an object's bytes, as the manifest records it."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO if len(data) > (1 << 22) else 1).hexdigest()


def part_object(seq: int, start: int, end: int, generation: int) -> str:
    return f"logs/{seq:016d}/{start:016d}-{end:016d}.g{generation}.part"


def snapshot_object(lsn: int, generation: int) -> str:
    return f"snapshots/{lsn:016d}.g{generation}.snap"


def segment_object(key: str) -> str:
    return f"segments/{key[:2]}/{key}.kvjseg"


def parse_part(name: str) -> Optional[Tuple[int, int, int, int]]:
    """(seq, start, end, generation) of a log part's object name, or None for any other name."""
    m = _PART_RE.fullmatch(name)
    if m is None:
        return None
    seq, start, end, generation = (int(g) for g in m.groups())
    return (seq, start, end, generation) if name == part_object(seq, start, end, generation) else None


def snapshot_lsn(name: str) -> Optional[int]:
    """The LSN of a snapshot object's name, or None for any other name."""
    m = _SNAP_RE.fullmatch(name)
    return int(m[1]) if m is not None and name == snapshot_object(int(m[1]), int(m[2])) else None


def segment_key(path: str) -> Optional[str]:
    """The key of a segment object's path, or None for any other path (one kvj did not write)."""
    m = _SEG_RE.fullmatch(path)
    return m[2] if m is not None and m[1] == m[2][:2] else None


def is_object_name(name: str) -> bool:
    """Whether kvj writes objects so named: anything else in a manifest (``..``, an absolute
    path, a NUL) is refused before it reaches the object store."""
    return parse_part(name) is not None or snapshot_lsn(name) is not None or segment_key(name) is not None


@dataclass
class Part:
    object: str
    start: int
    end: int
    blake3: str


@dataclass
class LogEntry:
    seq: int
    base_lsn: int
    salt: int
    size: int
    last_lsn: int
    sealed: bool
    parts: List[Part] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.seq:016d}.log"


@dataclass
class SnapshotEntry:
    lsn: int
    object: str
    size: int
    blake3: str


@dataclass
class Manifest:
    generation: int = 0
    updated: float = 0.0
    last_lsn: int = 0
    snapshot: Optional[SnapshotEntry] = None
    logs: List[LogEntry] = field(default_factory=list)
    history: List[List[float]] = field(default_factory=list)
    garbage: Dict[str, float] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, **asdict(self)}
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        """Parse and check a manifest from a replica: every field of its type and range, every
        object name one kvj writes; ``CorruptionError`` or ``FormatError`` else."""
        try:
            doc = load_json(data, "manifest", max_bytes=MAX_MANIFEST_BYTES)
        except FormatError as exc:
            raise CorruptionError(where, None, str(exc)) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise FormatError(f"{where} is not a kvj replica manifest")
        if doc.get("version") != VERSION:
            raise FormatError(f"{where}: replica manifest version {printable(doc.get('version'))} is not supported")
        try:
            return cls._parse(doc)
        except KeyError as exc:
            raise CorruptionError(where, None, f"malformed replica manifest: no field {printable(exc)}") from None
        except (TypeError, FormatError) as exc:
            raise CorruptionError(where, None, f"malformed replica manifest: {printable(exc)}") from None

    @classmethod
    def _parse(cls, doc: Dict[str, Any]) -> "Manifest":
        snap, snapshot = doc["snapshot"], None
        if snap is not None:
            snapshot = SnapshotEntry(json_field(snap, "lsn", int, "snapshot lsn"),
                                     json_field(snap, "object", str, "snapshot object"),
                                     json_field(snap, "size", int, "snapshot size", MAX_OBJECT_BYTES),
                                     json_field(snap, "blake3", str, "snapshot blake3"))
            if snapshot_lsn(snapshot.object) != snapshot.lsn:
                raise FormatError(f"'{printable(snapshot.object)}' is not the name of a snapshot at LSN {snapshot.lsn}")
        logs = []
        for e in json_field(doc, "logs", list):
            entry = LogEntry(json_field(e, "seq", int), json_field(e, "base_lsn", int),
                             json_field(e, "salt", int, hi=0xFFFFFFFF), json_field(e, "size", int),
                             json_field(e, "last_lsn", int), json_field(e, "sealed", bool))
            for p in json_field(e, "parts", list):
                part = Part(json_field(p, "object", str, "part object"), json_field(p, "start", int, "part start"),
                            json_field(p, "end", int, "part end"), json_field(p, "blake3", str, "part blake3"))
                named = parse_part(part.object)
                if named is None or named[:3] != (entry.seq, part.start, part.end):
                    raise FormatError(f"log {entry.name}: '{printable(part.object)}' is not the name of its part "
                                      f"{part.start}-{part.end}")
                if part.end - part.start > MAX_OBJECT_BYTES:
                    raise FormatError(f"log {entry.name}: part {part.object} declares {part.end - part.start} bytes, "
                                      f"more than one upload can hold ({MAX_OBJECT_BYTES})")
                entry.parts.append(part)
            logs.append(entry)
        history = []
        for pair in json_field(doc, "history", list):
            if not isinstance(pair, list) or len(pair) != 2:
                raise FormatError(f"history entry {printable(pair, 40)} is not [time, LSN]")
            history.append([json_field(pair, 0, float, "history time"), json_field(pair, 1, int, "history LSN")])
        garbage = json_field(doc, "garbage", dict)
        for name in garbage:
            if not is_object_name(name):
                raise FormatError(f"garbage entry '{printable(name)}' is not the name of an object kvj writes")
        return cls(generation=json_field(doc, "generation", int), updated=json_field(doc, "updated", float),
                   last_lsn=json_field(doc, "last_lsn", int), snapshot=snapshot, logs=logs, history=history,
                   garbage={name: json_field(garbage, name, float, "garbage time") for name in garbage})

    def objects(self) -> Dict[str, str]:
        """Every log part and snapshot object the manifest needs -> its BLAKE3."""
        needed = {p.object: p.blake3 for e in self.logs for p in e.parts}
        if self.snapshot is not None:
            needed[self.snapshot.object] = self.snapshot.blake3
        return needed

    def check(self, where: str) -> None:
        """Continuity: parts tile each log from byte 0, logs follow each other and the snapshot."""
        expected: Optional[int] = None
        for i, entry in enumerate(self.logs):
            pos = 0
            for part in entry.parts:
                if part.start != pos or part.end <= part.start:
                    raise CorruptionError(where, None, f"log {entry.name}: part {part.object} does not "
                                          f"continue at byte {pos}")
                pos = part.end
            if pos != entry.size:
                raise CorruptionError(where, None, f"log {entry.name}: parts cover {pos} of {entry.size} bytes")
            if i < len(self.logs) - 1 and not entry.sealed:
                raise CorruptionError(where, None, f"log {entry.name} is followed by another but not sealed")
            if expected is None:
                floor = self.snapshot.lsn if self.snapshot else 0
                if entry.base_lsn > floor + 1:
                    raise CorruptionError(where, None, f"log {entry.name} starts at LSN {entry.base_lsn}, but "
                                          f"LSNs after {floor} are needed (missing log)")
            elif entry.base_lsn != expected:
                raise CorruptionError(where, None, f"log {entry.name} begins at LSN {entry.base_lsn}, "
                                      f"expected {expected} (missing or extra log)")
            expected = entry.last_lsn + 1
        end = (expected - 1) if expected is not None else (self.snapshot.lsn if self.snapshot else 0)
        if end != self.last_lsn:
            raise CorruptionError(where, None, f"manifest says LSN {self.last_lsn}, its logs end at {end}")

    def lsn_at(self, when: float) -> int:
        """The last LSN that was replicated at time ``when`` (Unix seconds)."""
        best: Optional[int] = None
        for t, lsn in self.history:
            if t <= when:
                best = int(lsn)
        if best is None:
            raise FormatError("nothing was replicated at that time (or its history was trimmed): the oldest "
                              f"recorded round is {self.history[0][0] if self.history else 'none'}")
        return best


def load(remote: Remote) -> Tuple[Optional[Manifest], Optional[str]]:
    """The replica's manifest and its ETag, or (None, None) for an empty replica."""
    found = remote.get(MANIFEST_OBJECT, MAX_MANIFEST_BYTES)
    if found is None:
        return None, None
    return Manifest.from_json(found.data, f"{remote.url}/{MANIFEST_OBJECT}"), found.etag


def commit(remote: Remote, manifest: Manifest, etag: Optional[str], unacked: Optional[bytes] = None) -> Optional[str]:
    """Compare-and-swap the manifest; its new ETag (``LostRace`` if it changed since ``etag``;
    ``unacked``: see ``Remote.put_if_match``)."""
    return remote.put_if_match(MANIFEST_OBJECT, manifest.to_json(), etag, unacked)
