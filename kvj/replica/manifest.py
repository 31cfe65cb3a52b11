"""The replica manifest (``manifest.json``): which objects make up the replicated journal.

Restore and verify read only what the manifest names; an object it does not name is not
part of the replica. It is replaced by compare-and-swap on its ETag, so a replicator that
lost its lease (the manifest then carries a newer generation) can never commit.

    {"format": "kvj-replica", "version": 1, "generation": G, "updated": T, "last_lsn": L,
     "snapshot": {"lsn", "object", "size", "blake3"} | null,
     "logs": [{"seq", "base_lsn", "salt", "size", "last_lsn", "sealed",
               "parts": [{"object", "start", "end", "blake3"}]}],
     "history": [[T, L], ...],          # when each LSN became replicated (for --at TIME)
     "garbage": {"object": T}}          # no longer needed since T; deleted after the grace
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import blake3

from kvj.errors import CorruptionError, FormatError
from kvj.replica.remote import Remote

MANIFEST_OBJECT = "manifest.json"
FORMAT = "kvj-replica"
VERSION = 1
HISTORY_LIMIT = 1000


def digest(data: Any) -> str:
    """Hex BLAKE3 of an object's bytes, as the manifest records it."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO if len(data) > (1 << 22) else 1).hexdigest()


def part_object(seq: int, start: int, end: int, generation: int) -> str:
    return f"logs/{seq:016d}/{start:016d}-{end:016d}.g{generation}.part"


def snapshot_object(lsn: int, generation: int) -> str:
    return f"snapshots/{lsn:016d}.g{generation}.snap"


def segment_object(key: str) -> str:
    return f"segments/{key[:2]}/{key}.kvjseg"


def segment_key(path: str) -> Optional[str]:
    """The key of a ``segments/`` object path, or None for anything else."""
    name = path.rsplit("/", 1)[-1]
    if path.startswith("segments/") and name.endswith(".kvjseg"):
        return name[:-len(".kvjseg")]
    return None


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
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise CorruptionError(where, None, f"manifest is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise FormatError(f"{where} is not a kvj replica manifest")
        if doc.get("version") != VERSION:
            raise FormatError(f"{where}: replica manifest version {doc.get('version')} is not supported")
        try:
            snap = doc["snapshot"]
            return cls(generation=int(doc["generation"]), updated=float(doc["updated"]),
                       last_lsn=int(doc["last_lsn"]),
                       snapshot=SnapshotEntry(int(snap["lsn"]), str(snap["object"]), int(snap["size"]),
                                              str(snap["blake3"])) if snap else None,
                       logs=[LogEntry(int(e["seq"]), int(e["base_lsn"]), int(e["salt"]), int(e["size"]),
                                      int(e["last_lsn"]), bool(e["sealed"]),
                                      [Part(str(p["object"]), int(p["start"]), int(p["end"]), str(p["blake3"]))
                                       for p in e["parts"]]) for e in doc["logs"]],
                       history=[[float(t), int(lsn)] for t, lsn in doc["history"]],
                       garbage={str(k): float(v) for k, v in doc["garbage"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptionError(where, None, f"malformed replica manifest: {exc!r}") from None

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
    found = remote.get(MANIFEST_OBJECT)
    if found is None:
        return None, None
    data, etag = found
    return Manifest.from_json(data, f"{remote.url}/{MANIFEST_OBJECT}"), etag


def commit(remote: Remote, manifest: Manifest, etag: Optional[str]) -> Optional[str]:
    """Compare-and-swap the manifest; its new ETag (LostRace if it changed since ``etag``)."""
    return remote.put_if_match(MANIFEST_OBJECT, manifest.to_json(), etag)
