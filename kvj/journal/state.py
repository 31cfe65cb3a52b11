"""Replay state: what the journal says is true as of some LSN.

``JournalState.apply`` folds one record into the state. Replay, snapshots, recovery,
inspect and fsck all share this one fold, so they cannot disagree about what a
journal means.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import msgspec

from kvj.journal.records import NAMES, RecordType


#: The record types as plain ints, and their names: ``apply`` runs once per record, and an
#: ``IntEnum`` member's lookup and comparison cost more than an int's.
_START, _SEGMENT, _END, _ALLOC, _FREE, _CHECKPOINT, _DELTA, _EPOCH, _TOKENS, _HANDOFF, _REPLY = (
    int(t) for t in (RecordType.START, RecordType.SEGMENT, RecordType.END, RecordType.ALLOC, RecordType.FREE,
                     RecordType.CHECKPOINT, RecordType.DELTA, RecordType.EPOCH, RecordType.TOKENS,
                     RecordType.HANDOFF, RecordType.REPLY))
_NAMES: Dict[int, str] = {int(t): name for t, name in NAMES.items()}
#: Segment layouts whose blocks stay a prefix cache once their request ended (``JournalState.cache``):
#: the vLLM connector's KV blocks (``kvj.segments.kvblock.FORMAT``), named by a chain key of their tokens.
CACHED_FORMATS = frozenset({"kvj-kv-block/2"})


class _Fields:
    """A payload map read by field name, as ``apply`` reads a record's struct: the map is the
    object's attribute dict (no copy, looked up in C); the fields a map may leave out (an
    epoch's salvage, a reply's optional ones) default as in the struct."""

    salvage = None
    finish_reason = stop_reason = to = None  # a reply record's fields left at their defaults
    cached_tokens = 0

    def __init__(self, payload: Dict[str, Any]):
        self.__dict__ = payload


class SegmentRef(msgspec.Struct, gc=False):
    """A durable segment of a request: which tokens it covers and where its bytes are. (A
    struct: replay builds one per segment record, in C; it holds no cycle, so the collector
    need not track it.)"""

    seg: int
    key: Optional[str]
    tokens: Optional[Tuple[int, int]]
    layout: Dict[str, Any]
    raw_size: int
    stored_size: int
    digest: Optional[str]
    codec: str
    lsn: int
    ptr: Optional[int] = None  # always None: a snapshot field kvj 0.1.0 kept for seed-era journals

    def to_dict(self) -> Dict[str, Any]:
        return {"seg": self.seg, "key": self.key, "tokens": list(self.tokens) if self.tokens else None,
                "layout": self.layout, "raw_size": self.raw_size, "stored_size": self.stored_size,
                "digest": self.digest, "codec": self.codec, "lsn": self.lsn, "ptr": self.ptr}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SegmentRef":
        tokens = tuple(d["tokens"]) if d.get("tokens") is not None else None
        return cls(d["seg"], d.get("key"), tokens, d.get("layout") or {}, d.get("raw_size", 0),
                   d.get("stored_size", 0), d.get("digest"), d.get("codec", ""), d["lsn"], d.get("ptr"))


@dataclass(slots=True)
class RequestState:
    """One request: its prompt, the tokens it generated, its durable segments and whether it ended."""

    id: str
    prompt_hash: Optional[str]
    tokens: Optional[List[int]]
    meta: Dict[str, Any]
    start_lsn: int
    segments: Dict[int, SegmentRef] = field(default_factory=dict)
    #: tokens after the start record's, from its tokens records (the ones the request generated)
    output: List[int] = field(default_factory=list)
    ended: bool = False
    status: Optional[str] = None
    end_lsn: Optional[int] = None
    moved_to: Optional[str] = None  #: the engine a handoff record moved it to (it ended here, status "handoff")
    #: a served reply's end (a reply record, kvj serve's reply journal): status, count, finish_reason,
    #: stop_reason, cached_tokens, at, to; None while it runs
    reply: Optional[Dict[str, Any]] = None

    @property
    def resume_position(self) -> int:
        """Tokens covered from position 0 by durable segments, without a gap."""
        pos = 0
        for start, end in sorted(s.tokens for s in self.segments.values() if s.tokens):
            if start > pos:
                break
            pos = max(pos, end)
        return pos

    def to_dict(self) -> Dict[str, Any]:
        return {"id": self.id, "prompt_hash": self.prompt_hash, "tokens": self.tokens, "meta": self.meta,
                "start_lsn": self.start_lsn, "ended": self.ended, "status": self.status,
                "end_lsn": self.end_lsn, "resume_position": self.resume_position,
                "segments": [self.segments[k].to_dict() for k in sorted(self.segments)],
                **({"output": self.output} if self.output else {}),
                **({"moved_to": self.moved_to} if self.moved_to else {}),
                **({"reply": self.reply} if self.reply is not None else {})}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RequestState":
        req = cls(d["id"], d.get("prompt_hash"), d.get("tokens"), d.get("meta") or {}, d["start_lsn"],
                  ended=d.get("ended", False), status=d.get("status"), end_lsn=d.get("end_lsn"),
                  output=list(d.get("output") or []), moved_to=d.get("moved_to"), reply=d.get("reply"))
        for s in d.get("segments", []):
            ref = SegmentRef.from_dict(s)
            req.segments[ref.seg] = ref
        return req


@dataclass(slots=True)
class Allocation:
    addr: int
    size: int
    tag: str
    lsn: int


@dataclass
class JournalState:
    """The folded journal. ``apply`` is the only place record semantics live."""

    requests: Dict[str, RequestState] = field(default_factory=dict)
    allocations: Dict[str, Dict[int, Allocation]] = field(default_factory=dict)
    checkpoint: Optional[Dict[str, Any]] = None  # {"step", "keys", "meta", "lsn"}
    deltas: List[Dict[str, Any]] = field(default_factory=list)  # after the checkpoint, in order
    epochs: List[Dict[str, Any]] = field(default_factory=list)
    counts: Dict[str, int] = field(default_factory=dict)  # records applied, by type name
    ended_compacted: int = 0  # ended requests dropped by compaction
    first_lsn: Optional[int] = None
    last_lsn: int = 0
    snapshot_lsn: int = 0
    warnings: List[str] = field(default_factory=list)
    tail: Optional[Dict[str, Any]] = None  # torn tail found by replay: path, offset, length
    #: chain key -> KV block segment (``CACHED_FORMATS``) of a request that ended: a prefix cache
    #: that survives restarts, kept under the store's byte budget (``kvj.ops.evict``), not an orphan
    cache: Dict[str, SegmentRef] = field(default_factory=dict)

    def in_flight(self) -> List[RequestState]:
        return [r for r in self.requests.values() if not r.ended]

    def ended(self) -> List[RequestState]:
        return [r for r in self.requests.values() if r.ended]

    def _warn(self, lsn: int, message: str) -> None:
        if len(self.warnings) < 1000:
            self.warnings.append(f"LSN {lsn}: {message}")

    def apply(self, rtype: int, p: Any, lsn: int) -> None:
        """Fold one decoded, validated record into the state: its payload as a map
        (``records.decode_payload``) or, replay's one-decode form, its type's struct
        (``records.decode_fields``); both are read through the struct's field names."""
        if type(p) is dict:
            p = _Fields(p)
        if self.first_lsn is None:
            self.first_lsn = lsn
        self.last_lsn = lsn
        name = _NAMES.get(rtype) or f"type{rtype}"
        counts = self.counts
        counts[name] = counts.get(name, 0) + 1
        if rtype == _SEGMENT:
            req = self.requests.get(p.id)
            if req is None or req.ended:
                self._warn(lsn, f"segment {p.seg} for a request that is not in flight: {p.id}")
                return
            tokens = p.tokens  # a tuple as decoded into the struct; a list in a map
            key, digest = p.key, p.digest
            # one string object where the digest is the key (kvj writes it so) and one per codec
            # name: a request in flight holds a ref per block, and replay's memory is mostly these
            req.segments[p.seg] = SegmentRef(p.seg, key, tokens if type(tokens) is not list else tuple(tokens),
                                             p.layout, p.raw_size, p.stored_size, key if digest == key else digest,
                                             sys.intern(p.codec), lsn)
        elif rtype == _START:
            requests = self.requests
            if p.id in requests and not requests[p.id].ended:
                self._warn(lsn, f"request {p.id} started again; the earlier start is replaced")
            requests[p.id] = RequestState(p.id, p.prompt_hash, p.tokens, p.meta, lsn)
        elif rtype == _END:
            req = self.requests.get(p.id)
            if req is None:
                self._warn(lsn, f"end of a request that never started: {p.id}")
                return
            if not req.ended:
                self._cache(req)
            req.ended, req.status, req.end_lsn = True, p.status, lsn
        elif rtype == _HANDOFF:
            req = self.requests.get(p.id)
            if req is None or req.ended:
                self._warn(lsn, f"handoff of a request that is not in flight: {p.id}")
                return
            self._cache(req)
            req.ended, req.status, req.end_lsn, req.moved_to = True, "handoff", lsn, p.to
        elif rtype == _REPLY:
            req = self.requests.get(p.id)
            if req is None or req.ended:
                self._warn(lsn, f"reply record of a request that is not in flight: {p.id}")
                return
            req.reply = {"status": p.status, "count": p.count, "at": p.at, "finish_reason": p.finish_reason,
                         "stop_reason": p.stop_reason, "cached_tokens": p.cached_tokens, "to": p.to}
        elif rtype == _ALLOC:
            device = self.allocations.setdefault(p.device, {})
            if p.addr in device:
                self._warn(lsn, f"allocation at {p.device}:{p.addr:#x} replaces a live one")
            device[p.addr] = Allocation(p.addr, p.size, p.tag, lsn)
        elif rtype == _FREE:
            if self.allocations.get(p.device, {}).pop(p.addr, None) is None:
                self._warn(lsn, f"free of unknown allocation {p.device}:{p.addr:#x}")
        elif rtype == _CHECKPOINT:
            self.checkpoint = {"step": p.step, "keys": p.keys, "meta": p.meta, "lsn": lsn}
            self.deltas = []
        elif rtype == _DELTA:
            self.deltas.append({"step": p.step, "base_step": p.base_step, "keys": p.keys, "meta": p.meta, "lsn": lsn})
        elif rtype == _EPOCH:
            self.epochs.append({"epoch": p.epoch, "recovered_lsn": p.recovered_lsn, "time": p.time,
                                "manifest": p.manifest, "lsn": lsn,
                                **({"salvage": p.salvage} if p.salvage is not None else {})})
        elif rtype == _TOKENS:
            req = self.requests.get(p.id)
            if req is None or req.ended:
                self._warn(lsn, f"tokens for a request that is not in flight: {p.id}")
                return
            known = len(req.tokens or []) + len(req.output)
            if p.at != known:
                self._warn(lsn, f"tokens of request {p.id} at {p.at}, after {known} known: not used")
                return
            req.output.extend(p.tokens)
        else:
            self._warn(lsn, f"skipped record of unknown type {rtype} (written by a newer kvj?)")

    def _cache(self, req: RequestState) -> None:
        """Keep an ending request's KV blocks as the prefix cache (``cache``), by chain key."""
        for ref in req.segments.values():
            layout = ref.layout
            if ref.key and layout.get("format") in CACHED_FORMATS and type(layout.get("chain")) is str:
                self.cache[layout["chain"]] = ref

    def cached_keys(self) -> Dict[str, str]:
        """Segment keys of the prefix cache (``cache``), mapped to what they hold: kept by compaction's
        collection, evicted least recently used first under the store's byte budget."""
        return {ref.key: f"cached KV block {chain[:16]}" for chain, ref in self.cache.items() if ref.key}

    def training_step(self) -> Optional[int]:
        """The newest training step the journal holds (checkpoint or delta), if any."""
        steps = ([self.checkpoint["step"]] if self.checkpoint else []) + [d["step"] for d in self.deltas]
        return max(steps) if steps else None

    def moved(self) -> List[RequestState]:
        """Requests a HANDOFF record ended here: another engine continues them from their blocks."""
        return [r for r in self.requests.values() if r.moved_to is not None]

    def referenced_keys(self) -> Dict[str, str]:
        """Segment keys the live state needs, mapped to a description of who needs them: those of
        requests in flight and of requests moved to another engine (which loads their blocks from
        this store, or from its replica restored, until compaction drops the moved requests)."""
        keys: Dict[str, str] = {}
        for req in self.in_flight() + self.moved():
            for ref in req.segments.values():
                if ref.key:
                    keys[ref.key] = f"request {req.id} segment {ref.seg}" + (
                        f" (moved to {req.moved_to})" if req.moved_to is not None else "")
        for entry in ([self.checkpoint] if self.checkpoint else []) + self.deltas:
            for name, key in entry["keys"].items():
                if isinstance(key, str):
                    keys[key] = f"training step {entry['step']} {name}"
        return keys

    def to_dict(self, include_ended: bool = True) -> Dict[str, Any]:
        """A plain dict (msgpack- and JSON-safe) of the whole state."""
        return {
            "first_lsn": self.first_lsn, "last_lsn": self.last_lsn, "snapshot_lsn": self.snapshot_lsn,
            "requests": [r.to_dict() for r in self.requests.values() if include_ended or not r.ended],
            "ended_compacted": self.ended_compacted + (0 if include_ended else len(self.ended())),
            "allocations": {dev: [{"addr": a.addr, "size": a.size, "tag": a.tag, "lsn": a.lsn}
                                  for a in sorted(allocs.values(), key=lambda a: a.addr)]
                            for dev, allocs in sorted(self.allocations.items())},
            "checkpoint": self.checkpoint, "deltas": self.deltas, "epochs": self.epochs,
            "counts": self.counts, "warnings": self.warnings, "tail": self.tail,
            **({"cache": {chain: ref.to_dict() for chain, ref in self.cache.items()}} if self.cache else {}),
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "JournalState":
        state = cls(first_lsn=d.get("first_lsn"), last_lsn=d.get("last_lsn", 0),
                    snapshot_lsn=d.get("snapshot_lsn", 0), ended_compacted=d.get("ended_compacted", 0),
                    checkpoint=d.get("checkpoint"), deltas=list(d.get("deltas", [])),
                    epochs=list(d.get("epochs", [])), counts=dict(d.get("counts", {})),
                    warnings=list(d.get("warnings", [])))
        for r in d.get("requests", []):
            req = RequestState.from_dict(r)
            state.requests[req.id] = req
        state.cache = {chain: SegmentRef.from_dict(ref) for chain, ref in (d.get("cache") or {}).items()}
        for dev, allocs in d.get("allocations", {}).items():
            state.allocations[dev] = {a["addr"]: Allocation(a["addr"], a["size"], a["tag"], a["lsn"])
                                      for a in allocs}
        return state
