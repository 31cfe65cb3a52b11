"""``Journal``: the public API for recording what is in flight.

Typed methods (``start``, ``flush``, ``end``, ``alloc``, ``checkpoint``, ...) append records
through the group-committing writer; ``sync`` waits until everything before it is durable.
Tensor data goes to the segment store first; its segment-flush record is appended only once
the segment is durable. What ``open`` repairs first, and where it goes on, is ``recovery``'s.
"""

from __future__ import annotations

import heapq
import operator
import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from kvj.errors import FormatError, JournalClosed, JournalFailed
from kvj.fileio import FS, REAL_FS, makedirs_durable
from kvj.journal.config import CommitPolicy, config_policy, default_store_path
from kvj.journal.inflight import InFlight
from kvj.journal.mirror import FAIL, check_policy, log
from kvj.journal.records import RecordType, encode
from kvj.journal.recovery import LOCK_NAME, DirLock, open_end
from kvj.journal.replay import check_journal, replay
from kvj.journal.writer import LogWriter
from kvj.trust import check_owner

if TYPE_CHECKING:  # the store pulls in torch; the journal alone does not need it
    import torch

    from kvj.segments.flusher import Flusher
    from kvj.segments.store import SegmentInfo, SegmentStore


def _mapped(value: Optional[Mapping[str, Any]], what: str) -> Dict[str, Any]:
    """A caller's map argument as a dict (None is empty); anything else is a ``FormatError``."""
    if type(value) is dict:
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise FormatError(f"{what} must be a map, not {type(value).__name__}")
    return dict(value)


def _listed(value: Optional[Sequence[int]], what: str) -> Optional[List[Any]]:
    """A caller's sequence argument as a list (None stays None); anything else is a ``FormatError``."""
    if value is None or type(value) is list:
        return value
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise FormatError(f"{what} must be a sequence, not {type(value).__name__}")
    return list(value)


def _integer(value: Any, what: str) -> int:
    """An integer argument (numpy and torch integers too); anything else is a ``FormatError``."""
    try:
        return operator.index(value)
    except TypeError:
        raise FormatError(f"{what} must be an integer, not {value!r}") from None


def segment_keys(rtype: int, payload: Mapping[str, Any]) -> List[str]:
    """The segment keys a record names (a segment flush's, a checkpoint's or a delta's)."""
    if rtype == RecordType.SEGMENT:
        return [payload["key"]]
    if rtype in (RecordType.CHECKPOINT, RecordType.DELTA):
        return [key for key in payload["keys"].values() if isinstance(key, str)]
    return []


class _Claims:
    """The store's claims on segments this journal's records name, each given back once its
    record is durable: until then a collector must not take the segment."""

    def __init__(self) -> None:
        self.journal: Optional["Journal"] = None
        self._due: List[Tuple[int, List[str]]] = []  # a heap of (LSN, keys)
        self._durable = 0
        self._lock = threading.Lock()

    def hold(self, lsn: int, keys: List[str]) -> None:
        """Give back one claim on each of ``keys`` once ``lsn`` is durable."""
        if not keys:
            return
        with self._lock:
            if lsn > self._durable:
                heapq.heappush(self._due, (lsn, keys))
                return
        self._release(keys)

    def durable(self, lsn: int) -> None:
        """Every LSN up to ``lsn`` is durable (the writer's committer thread says so)."""
        due: List[str] = []
        with self._lock:
            self._durable = lsn
            while self._due and self._due[0][0] <= lsn:
                due += heapq.heappop(self._due)[1]
        if due:
            self._release(due)

    def _release(self, keys: List[str]) -> None:
        store = self.journal._store if self.journal is not None else None
        if store is not None:
            store.release(keys)


class Journal:
    """A kvj journal opened for writing. Use ``Journal.open(path)`` as a context manager."""

    def __init__(self, path: str, writer: LogWriter, locks: List[DirLock], store: Any, fs: FS,
                 cut_tail: Optional[str], live: Dict[str, Dict[int, Tuple[int, int]]], claims: _Claims):
        self.path = path
        self.writer = writer
        self.fs = fs
        self.cut_tail = cut_tail  #: where a torn tail found at open was set aside, if any
        self._locks = locks  # the journal's writer lock, and its mirror's
        self._store_arg = store
        self._store: Optional["SegmentStore"] = None
        if store is not None and not isinstance(store, (str, os.PathLike)):  # a SegmentStore, given
            store.journaled = True  # its puts claim what they store; this journal gives the claims back
            self._store = store
        self._flusher: Optional["Flusher"] = None
        self._closed = False
        self._inflight = InFlight(live)
        self._claims = claims
        claims.journal = self

    @classmethod
    def open(cls, path: Union[str, "os.PathLike[str]"], *, store: Union[None, str, "SegmentStore"] = None,
             policy: Optional[CommitPolicy] = None, fs: FS = REAL_FS, create: bool = True,
             mirror: Union[None, str, "os.PathLike[str]"] = None, mirror_policy: str = FAIL) -> "Journal":
        """Open (creating if ``create``) the journal directory ``path`` for writing: take the writer
        lock (``JournalLocked`` names the holder), cut a torn tail (kept in ``torn/``), go on after
        the last group. Mid-log corruption is ``CorruptionError`` (run fsck); as root, a directory
        another user owns is ``UnsafePath`` unless ``KVJ_TRUST_OWNER=1``; a seed-era journal is
        ``LegacyJournal``. ``store`` and ``policy`` default to ``kvj.conf``'s. ``mirror``: a directory
        (ideally on another device) holding a second copy of the log, recorded for later opens; one
        that is gone or fails fails the writer, or under ``mirror_policy`` "degrade" is dropped."""
        path = os.path.abspath(os.fspath(path))
        check_policy(mirror_policy)
        check_owner(path)
        check_journal(path)  # a seed-era journal, or another file: refused, nothing written
        if not os.path.isdir(path):
            if not create:
                raise FormatError(f"no journal at {path}")
            makedirs_durable(path, fs)
        if store is None or isinstance(store, (str, os.PathLike)):  # refused now, not at the first flush
            check_owner(os.fspath(store) if store is not None else default_store_path(path))
        locks = [DirLock(path, LOCK_NAME, "writer").acquire()]
        try:
            policy = policy or config_policy(path) or CommitPolicy()
            # The one rule readers judge a journal by: a writer that went on where recovery stops
            # would acknowledge records recovery throws away (a torn tail is cut below).
            state = replay(path)
            (seq, lsn, aside, salt), chosen = open_end(path, fs, policy.file_size_limit, None if mirror is None
                                                       else os.fspath(mirror), mirror_policy, locks)
            claims = _Claims()
            writer = LogWriter(path, next_seq=seq, next_lsn=lsn, policy=policy, fs=fs, resume_salt=salt,
                               mirror=chosen, mirror_policy=mirror_policy, on_durable=claims.durable)
        except BaseException:
            for lock in locks:
                lock.release()
            raise
        live = {rid: {seg: ref.tokens for seg, ref in req.segments.items() if ref.tokens is not None}
                for rid, req in state.requests.items() if not req.ended}
        return cls(path, writer, locks, store, fs, aside, live, claims)

    @property
    def mirror(self) -> Optional[str]:
        """The mirror the writer keeps a copy of the log in, or None (none, or dropped: ``mirror_error``)."""
        return self.writer.mirror

    @property
    def mirror_error(self) -> Optional[OSError]:
        """Why the mirror was dropped under policy degrade; None while it is written."""
        return self.writer.mirror_error

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:  # the block's own exception is what the caller sees; a failing close() is noted on it
            self.close()
        except Exception as close_error:
            note = f"closing the journal failed too: {type(close_error).__name__}: {close_error}"
            if hasattr(exc, "add_note"):  # Python 3.11
                exc.add_note(note)
            else:
                log.warning("journal %s: %s", self.path, note)

    def start(self, request_id: str, prompt_hash: Optional[str] = None, tokens: Optional[Sequence[int]] = None,
              meta: Optional[Mapping[str, Any]] = None, durable: bool = False) -> Union[int, "Future[int]"]:
        """Record that a request started; returns its LSN, or a future of it while an earlier
        incarnation of this id still has flushes in flight (a request's records keep the calls' order)."""
        return self._request_record(request_id, RecordType.START, {
            "id": request_id, "prompt_hash": prompt_hash, "tokens": _listed(tokens, "tokens"),
            "meta": _mapped(meta, "meta")}, durable)

    def end(self, request_id: str, status: str = "ok", durable: bool = False) -> Union[int, "Future[int]"]:
        """Record that a request ended (its segments become collectable), after its flushes: while
        some are in flight, a future of its LSN returns at once (the caller never waits for them)."""
        return self._request_record(request_id, RecordType.END, {"id": request_id, "status": status}, durable)

    def handoff(self, request_id: str, to: str, durable: bool = False) -> Union[int, "Future[int]"]:
        """Record that a request ended here because engine ``to`` continues it (as ``end``)."""
        return self._request_record(request_id, RecordType.HANDOFF, {"id": request_id, "to": to}, durable)

    def tokens(self, request_id: str, at: int, tokens: Sequence[int]) -> Union[int, "Future[int]"]:
        """Record tokens a request generated, the first at position ``at`` of its tokens (as ``end``)."""
        return self._request_record(request_id, RecordType.TOKENS, {
            "id": request_id, "at": _integer(at, "at"), "tokens": _listed(tokens, "tokens")}, False)

    def _request_record(self, request_id: str, rtype: int, payload: Mapping[str, Any],
                        durable: bool) -> Union[int, "Future[int]"]:
        """Append a request's record after its records still waiting behind its flushes."""
        body = encode(rtype, payload)  # a bad argument raises here, before anything is queued
        self._inflight.track(rtype, payload)
        if not self._inflight.waiting:  # no record of any request waits (entries leave only once appended)
            return self.writer.append(rtype, body, durable)
        later = self._inflight.in_order(request_id, [], lambda: self.writer.append(rtype, body))
        if later is None:
            return self.writer.append(rtype, body, durable)
        if durable:
            self.writer.wait_durable(later.result())
            return later.result()
        return later

    def alloc(self, device: str, addr: int, size: int, tag: str = "", durable: bool = False) -> int:
        """Record a device memory allocation."""
        return self.append(RecordType.ALLOC, {"device": device, "addr": addr, "size": size, "tag": tag}, durable)

    def free(self, device: str, addr: int, durable: bool = False) -> int:
        """Record that a device allocation was freed."""
        return self.append(RecordType.FREE, {"device": device, "addr": addr}, durable)

    def checkpoint(self, step: int, keys: Mapping[str, str], meta: Optional[Mapping[str, Any]] = None,
                   durable: bool = False) -> int:
        """Record a full training checkpoint: tensor name -> segment key, all already durable."""
        return self.append(RecordType.CHECKPOINT, {"step": step, "keys": _mapped(keys, "keys"),
                                                   "meta": _mapped(meta, "meta")}, durable)

    def delta(self, step: int, base_step: int, keys: Mapping[str, str], meta: Optional[Mapping[str, Any]] = None,
              durable: bool = False) -> int:
        """Record a delta against the state at ``base_step``: tensor name -> segment key."""
        return self.append(RecordType.DELTA, {"step": step, "base_step": base_step, "keys": _mapped(keys, "keys"),
                                              "meta": _mapped(meta, "meta")}, durable)

    def epoch(self, epoch: int, recovered_lsn: int, manifest: Optional[str] = None, durable: bool = True,
              salvage: Optional[Mapping[str, Any]] = None) -> int:
        """Record a recovery epoch (before the server resumes); ``salvage``: what a salvage set aside and lost."""
        payload = {"epoch": epoch, "recovered_lsn": recovered_lsn, "time": time.time(), "manifest": manifest}
        if salvage is not None:
            payload["salvage"] = dict(salvage)
        return self.append(RecordType.EPOCH, payload, durable)

    def append(self, rtype: int, payload: Mapping[str, Any], durable: bool = False) -> int:
        """Append a record given as a plain payload, checked against its type's schema (``FormatError``
        at the call, nothing appended); claims on the segments it names go back once it is durable."""
        body = encode(rtype, payload)
        self._inflight.track(rtype, payload)
        lsn = self.writer.append(rtype, body, durable)
        self._claims.hold(lsn, segment_keys(rtype, payload))
        return lsn

    def append_many(self, records: Iterable[Tuple[int, Mapping[str, Any]]], durable: bool = False) -> List[int]:
        """Append (type, payload) records in order, as ``append`` does each, and return their LSNs;
        all are checked first (one bad record: ``FormatError``, none appended)."""
        records = list(records)
        encoded = [(rtype, encode(rtype, payload)) for rtype, payload in records]
        for rtype, payload in records:
            self._inflight.track(rtype, payload)
        lsns = self.writer.append_many(encoded, durable)
        for lsn, (rtype, payload) in zip(lsns, records):
            self._claims.hold(lsn, segment_keys(rtype, payload))
        return lsns

    @property
    def store(self) -> "SegmentStore":
        """The segment store: the one given at open, else ``config.default_store_path``'s."""
        if self._store is None:
            if self._closed:
                raise JournalClosed("journal is closed")
            from kvj.segments.store import SegmentStore
            arg = self._store_arg
            store = arg if isinstance(arg, SegmentStore) else SegmentStore(arg or default_store_path(self.path),
                                                                           fs=self.fs)
            store.journaled = True  # its puts claim what they store; this journal gives the claims back
            self._store = store
        return self._store

    def flush(self, request_id: str, segment: int, tensor: Optional["torch.Tensor"] = None, *,
              token_range: Tuple[int, int], layout: Optional[Mapping[str, Any]] = None,
              info: Optional["SegmentInfo"] = None) -> "Future[int]":
        """Flush one block of a request's KV: store it durably, then journal it; returns at once a
        future of the record's LSN. ``info`` instead of ``tensor`` journals a stored segment (the
        caller's claim on it goes back once the record is durable). A failed write or fsync of the
        segment is final: ``JournalFailed`` from then on. Refused at the call, nothing stored: a
        malformed argument (``FormatError``), a request not in flight or tokens overlapping another
        of its segments (``InvalidArgument``; the same segment number replaces that segment)."""
        if self._closed:
            raise JournalClosed("journal is closed")
        if not isinstance(token_range, (tuple, list)) or len(token_range) != 2:
            raise FormatError(f"bad token range {token_range!r}: expected (start, end)")
        start, end = _integer(token_range[0], "a token position"), _integer(token_range[1], "a token position")
        if info is None and tensor is None:
            raise FormatError("flush needs a tensor or the info of a stored segment")
        if info is not None:
            layout = info.layout
        else:
            from kvj.segments.segfile import canonical_layout

            layout = canonical_layout(_mapped(layout, "layout"))  # what the store will record
        # checked on the caller's thread: an input error never reaches the flush workers
        payload = {"id": request_id, "seg": _integer(segment, "segment"), "key": "0" * 64, "tokens": [start, end],
                   "layout": dict(layout or {}), "raw_size": 0, "stored_size": 0, "digest": "", "codec": ""}
        encode(RecordType.SEGMENT, payload)
        self._inflight.claim(request_id, payload["seg"], start, end)

        def record(seg_info: "SegmentInfo") -> int:
            return self.append(RecordType.SEGMENT, {
                **payload, "key": seg_info.key, "raw_size": seg_info.raw_size,
                "stored_size": seg_info.stored_size, "digest": seg_info.digest, "codec": seg_info.codec}, False)

        if info is not None:
            stored: "Future[SegmentInfo]" = Future()
            stored.set_result(info)
        else:
            from kvj.segments.flusher import Flusher

            if self._flusher is None:
                self._flusher = Flusher(self.store)
            try:
                stored = self._flusher.submit(tensor, payload["layout"])
            except OSError as exc:  # an earlier flush failed to reach the disk: final
                raise self._fail(exc, "a segment flush failed earlier") from exc

        def stored_info() -> "SegmentInfo":
            try:
                return stored.result()
            except OSError as exc:
                raise self._fail(exc, "a segment flush failed") from exc

        later = self._inflight.in_order(request_id, [stored], lambda: record(stored_info()))
        if later is None:
            later = Future()
            later.set_result(record(stored_info()))
        return later

    def _fail(self, error: OSError, what: str) -> JournalFailed:
        """A segment the journal needed could not be made durable: the journal fails as a whole."""
        self.writer.fail(error)
        return JournalFailed(f"{what}: {error}")

    def sync(self) -> int:
        """Wait for pending segment flushes, then until every record so far is durable (a failed
        flush is final: ``JournalFailed``)."""
        self._drain_flushes()
        return self.writer.sync()

    def _drain_flushes(self) -> None:
        """Wait for segment flushes and the records queued behind them; only a durability failure
        raises (a flush refused for its input failed on its own future)."""
        if self._flusher is not None:
            try:
                self._flusher.drain()
            except OSError as exc:
                raise self._fail(exc, "a segment flush failed") from exc
        self._inflight.drain()

    @property
    def durable_lsn(self) -> int:
        return self.writer.durable_lsn

    def close(self) -> None:
        """Drain flushes, make everything durable, stop the committer, release the locks."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._flusher is not None:
                self._flusher.close()
            self._drain_flushes()
        finally:
            try:
                self.writer.close()
            finally:
                try:
                    if self._store is not None and self._store is not self._store_arg:
                        self._store.close()  # the store (and its thread pool) this journal opened
                    elif self._store is not None:
                        self._store.unjournaled()  # the caller's: it claims nothing more for this journal
                finally:
                    for lock in self._locks:
                        lock.release()
