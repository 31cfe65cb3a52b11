"""``Journal``: the public API for recording what is in flight.

Typed methods (``start``, ``flush``, ``end``, ``alloc``, ``free``, ``checkpoint``,
``delta``) append records through the group-committing writer; ``sync`` waits until
everything before it is durable. Tensor data goes to the segment store first; its
segment-flush record is appended only once the segment is durable. Where an opened journal
goes on, and the repairs made first (torn tails, the mirror's copies), is ``recovery``'s.
"""

from __future__ import annotations

import errno
import heapq
import operator
import os
import time
import threading
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from kvj.errors import FormatError, JournalClosed, JournalFailed
from kvj.fileio import FS, REAL_FS, DurabilityError, makedirs_durable
from kvj.journal.config import STORE_DIR, config_policy, config_store
from kvj.journal.inflight import InFlight
from kvj.journal.locks import LOCK_NAME, DirLock
from kvj.journal.mirror import DEGRADE, FAIL, check_policy, log, mirror_of, resolve
from kvj.journal.records import RecordType, encode
from kvj.journal.replay import check_journal, replay
from kvj.journal.recovery import MirrorDown, find_end, mirror_side
from kvj.journal.policy import CommitPolicy
from kvj.journal.writer import LogWriter
from kvj.trust import check_owner

if TYPE_CHECKING:  # the store pulls in torch; the journal alone does not need it
    import torch

    from kvj.segments.flusher import Flusher
    from kvj.segments.store import SegmentInfo, SegmentStore


def default_store_path(journal_path: str) -> str:
    """The journal's segment store when none is given: the one its ``kvj.conf`` names
    (``kvj init --store``), else ``segments/`` inside it."""
    return config_store(journal_path) or os.path.join(journal_path, STORE_DIR)


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


def _token_range(token_range: Tuple[int, int]) -> Tuple[int, int]:
    if not isinstance(token_range, (tuple, list)) or len(token_range) != 2:
        raise FormatError(f"bad token range {token_range!r}: expected (start, end)")
    return _integer(token_range[0], "a token position"), _integer(token_range[1], "a token position")


def segment_keys(rtype: int, payload: Mapping[str, Any]) -> List[str]:
    """The segment keys a record names (a segment flush's, a checkpoint's or a delta's)."""
    if rtype == RecordType.SEGMENT:
        return [payload["key"]]
    if rtype in (RecordType.CHECKPOINT, RecordType.DELTA):
        return [key for key in payload["keys"].values() if isinstance(key, str)]
    return []


class _Claims:
    """The store's claims (``kvj.segments.claims``) on segments this journal's records name, each
    given back once its record is durable: until then a collector must not take the segment."""

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
                 cut_tail: Optional[str], in_flight: Dict[str, Dict[int, Tuple[int, int]]], claims: "_Claims"):
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
        self._order = threading.Lock()
        #: Per request id, the last of its records still waiting to be appended (see ``_in_order``).
        self._waiting: Dict[str, "Future[int]"] = {}
        self._deferred: "set[Future[int]]" = set()
        #: the requests in flight and their segments' tokens, so that ``flush`` refuses at the call
        self._inflight = InFlight(in_flight)
        self._claims = claims
        claims.journal = self

    @classmethod
    def open(cls, path: Union[str, "os.PathLike[str]"], *, store: Union[None, str, "SegmentStore"] = None,
             policy: Optional[CommitPolicy] = None, fs: FS = REAL_FS, create: bool = True,
             mirror: Union[None, str, "os.PathLike[str]"] = None, mirror_policy: str = FAIL) -> "Journal":
        """Open (creating if ``create``) the journal directory ``path`` for writing.

        Takes the writer lock (a second writer gets ``JournalLocked`` naming the holder's
        pid), cuts a torn tail left by a crash (the bytes are kept in ``torn/``), and
        continues the newest log file when its tail is clean (else starts a new one).
        Mid-log corruption raises ``CorruptionError``: run fsck. Run as root, a journal or store
        directory another user owns (or others may write) is ``UnsafePath`` unless
        ``KVJ_TRUST_OWNER=1`` (``kvj.trust``). A seed-era JSON-lines journal is ``LegacyJournal``
        (``kvj migrate`` makes a kvj journal of it), any other file ``FormatError``.

        ``store`` and ``policy`` default to what the journal's ``kvj.conf`` records (``kvj
        init --store``, ``--max-delay``, ...; see ``kvj.journal.config``), else to
        ``segments/`` inside the journal and ``CommitPolicy()``; given here, they win over
        the file. A ``kvj.conf`` that is not a valid configuration is ``FormatError``.

        ``mirror``: a directory (ideally on another device) that keeps a second copy of the
        log, written and fdatasynced with every group before it is acknowledged; the journal
        records it, so later opens use it without being told. A journal's recorded mirror
        that is gone, or that fails while writing, fails the writer under ``mirror_policy``
        "fail" (the default); under "degrade" it is a logged warning and the journal's own
        copy is written alone (``mirror_error`` says why).
        """
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
            chosen: Optional[str] = None
            try:
                with mirror_side(os.fspath(mirror) if mirror is not None else mirror_of(path)):
                    chosen = resolve(path, None if mirror is None else os.fspath(mirror), mirror_policy, fs)
                    if chosen is not None:
                        locks.append(DirLock(chosen, LOCK_NAME, "writer").acquire())
                seq, lsn, aside, salt = find_end(path, fs, policy.file_size_limit, chosen)
            except MirrorDown as down:
                if mirror_policy != DEGRADE:
                    raise DurabilityError(down.error.errno or errno.EIO, str(down)) from down.error
                log.warning("journal %s: %s; writing the primary copy only (mirror policy degrade)", path, down)
                for lock in locks[1:]:
                    lock.release()
                del locks[1:]
                chosen = None
                seq, lsn, aside, salt = find_end(path, fs, policy.file_size_limit)
            claims = _Claims()
            writer = LogWriter(path, next_seq=seq, next_lsn=lsn, policy=policy, fs=fs, resume_salt=salt,
                               mirror=chosen, mirror_policy=mirror_policy, on_durable=claims.durable)
        except BaseException:
            for lock in locks:
                lock.release()
            raise
        in_flight = {rid: {seg: ref.tokens for seg, ref in req.segments.items() if ref.tokens is not None}
                     for rid, req in state.requests.items() if not req.ended}
        return cls(path, writer, locks, store, fs, aside, in_flight, claims)

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

    # -- records -------------------------------------------------------------------------

    def start(self, request_id: str, prompt_hash: Optional[str] = None, tokens: Optional[Sequence[int]] = None,
              meta: Optional[Mapping[str, Any]] = None, durable: bool = False) -> Union[int, "Future[int]"]:
        """Record that a request started; returns its LSN.

        A request's records reach the log in the order of the calls: while an earlier
        incarnation of this id still has flushes in flight, the record follows them and a
        future of its LSN is returned at once (see ``end``).
        """
        return self._request_record(request_id, RecordType.START, {
            "id": request_id, "prompt_hash": prompt_hash, "tokens": _listed(tokens, "tokens"),
            "meta": _mapped(meta, "meta")}, durable)

    def end(self, request_id: str, status: str = "ok", durable: bool = False) -> Union[int, "Future[int]"]:
        """Record that a request ended (its segments become collectable); returns its LSN.

        The end follows the request's flushes in the log. While some are still in flight it
        is appended when they are, and a future of its LSN is returned at once, so the
        serving loop never waits for segment I/O; ``sync()`` and ``durable=True`` wait for it.
        """
        return self._request_record(request_id, RecordType.END, {"id": request_id, "status": status}, durable)

    def handoff(self, request_id: str, to: str, durable: bool = False) -> Union[int, "Future[int]"]:
        """Record that a request ended here because engine ``to`` continues it (after its
        flushes, as ``end``); recovery of this journal never resumes it."""
        return self._request_record(request_id, RecordType.HANDOFF, {"id": request_id, "to": to}, durable)

    def tokens(self, request_id: str, at: int, tokens: Sequence[int]) -> Union[int, "Future[int]"]:
        """Record tokens a request generated, the first at position ``at`` of its tokens (the
        start record's come first); returns its LSN, or a future of it as ``end`` does."""
        return self._request_record(request_id, RecordType.TOKENS, {
            "id": request_id, "at": _integer(at, "at"), "tokens": _listed(tokens, "tokens")}, False)

    def _request_record(self, request_id: str, rtype: int, payload: Mapping[str, Any],
                        durable: bool) -> Union[int, "Future[int]"]:
        body = encode(rtype, payload)  # a bad argument raises here, before anything is queued
        self._track(rtype, payload)
        if not self._waiting:  # no record of any request waits (entries leave only once appended)
            return self.writer.append(rtype, body, durable)
        later = self._in_order(request_id, [], lambda: self.writer.append(rtype, body))
        if later is None:
            return self.writer.append(rtype, body, durable)
        if durable:
            lsn = later.result()
            self.writer.wait_durable(lsn)
            return lsn
        return later

    def alloc(self, device: str, addr: int, size: int, tag: str = "", durable: bool = False) -> int:
        """Record a device memory allocation."""
        return self._append(RecordType.ALLOC, {"device": device, "addr": addr, "size": size, "tag": tag}, durable)

    def free(self, device: str, addr: int, durable: bool = False) -> int:
        """Record that a device allocation was freed."""
        return self._append(RecordType.FREE, {"device": device, "addr": addr}, durable)

    def checkpoint(self, step: int, keys: Mapping[str, str], meta: Optional[Mapping[str, Any]] = None,
                   durable: bool = False) -> int:
        """Record a full training checkpoint: tensor name -> segment key, all already durable."""
        return self._append(RecordType.CHECKPOINT, {"step": step, "keys": _mapped(keys, "keys"),
                                                    "meta": _mapped(meta, "meta")}, durable)

    def delta(self, step: int, base_step: int, keys: Mapping[str, str], meta: Optional[Mapping[str, Any]] = None,
              durable: bool = False) -> int:
        """Record a delta against the state at ``base_step``: tensor name -> segment key."""
        return self._append(RecordType.DELTA, {"step": step, "base_step": base_step, "keys": _mapped(keys, "keys"),
                                               "meta": _mapped(meta, "meta")}, durable)

    def epoch(self, epoch: int, recovered_lsn: int, manifest: Optional[str] = None, durable: bool = True,
              salvage: Optional[Mapping[str, Any]] = None) -> int:
        """Record a recovery epoch (written by recovery before the server resumes); ``salvage``
        records a salvaging recovery's decision (what it set aside and lost)."""
        payload = {"epoch": epoch, "recovered_lsn": recovered_lsn, "time": time.time(), "manifest": manifest}
        if salvage is not None:
            payload["salvage"] = dict(salvage)
        return self._append(RecordType.EPOCH, payload, durable)

    def append(self, rtype: int, payload: Mapping[str, Any], durable: bool = False) -> int:
        """Append a record given as a plain payload, validated against its type's schema
        (``FormatError`` at the call, nothing appended)."""
        return self._append(rtype, payload, durable)

    def append_many(self, records: Iterable[Tuple[int, Mapping[str, Any]]], durable: bool = False) -> List[int]:
        """Append (type, payload) records in order, as ``append`` does each, and return their LSNs.
        All are checked first: one bad record raises ``FormatError`` and none is appended."""
        records = list(records)
        encoded = [(rtype, encode(rtype, payload)) for rtype, payload in records]
        for rtype, payload in records:
            self._track(rtype, payload)
        lsns = self.writer.append_many(encoded, durable)
        for lsn, (rtype, payload) in zip(lsns, records):
            self._claims.hold(lsn, segment_keys(rtype, payload))
        return lsns

    def _track(self, rtype: int, payload: Mapping[str, Any]) -> None:
        """Keep ``InFlight`` current with a request record about to be appended (already checked)."""
        if rtype == RecordType.START:
            self._inflight.started(payload["id"])
        elif rtype in (RecordType.END, RecordType.HANDOFF):
            self._inflight.ended(payload["id"])
        elif rtype == RecordType.SEGMENT:
            self._inflight.segment(payload["id"], payload["seg"], tuple(payload["tokens"]))  # type: ignore[arg-type]

    def _append(self, rtype: int, payload: Mapping[str, Any], durable: bool) -> int:
        """Check ``payload`` against the schema (``FormatError`` at the call, nothing appended), then
        append; the claims on the segments it names are given back once it is durable."""
        body = encode(rtype, payload)
        self._track(rtype, payload)
        lsn = self.writer.append(rtype, body, durable)
        self._claims.hold(lsn, segment_keys(rtype, payload))
        return lsn

    # -- segments ------------------------------------------------------------------------

    @property
    def store(self) -> "SegmentStore":
        """The segment store: the one given at open, else the one ``kvj.conf`` names, else
        ``segments/`` inside the journal."""
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
        """Flush one block of a request's KV: store it durably, then journal it.

        Returns at once with a future of the segment-flush record's LSN; the record is
        appended only after the segment is durable. Pass ``info`` instead of ``tensor``
        to journal a segment already in the store. A failed write or fsync of the segment
        is final: its future, and every later ``flush``, ``sync`` and ``close``, raise
        ``JournalFailed`` (chained from the ``OSError``).

        Refused at the call, nothing stored or appended: a negative ``segment`` or a bad
        token range (``FormatError``, as every malformed argument); a request that is not in
        flight (never started, or ended) and a token range overlapping another segment of
        the request (``InvalidArgument``; flushing a segment number again replaces that
        segment). A request in flight before the journal was opened (one being resumed) is
        known from the replay ``open`` makes.

        With ``info``, the caller holds a claim on its segment (a put returned it, or
        ``SegmentStore.claim_existing``): the journal gives it back once the record is durable.
        """
        if self._closed:
            raise JournalClosed("journal is closed")
        start, end = _token_range(token_range)
        if info is None and tensor is None:
            raise FormatError("flush needs a tensor or the info of a stored segment")
        if info is not None:
            layout = info.layout
        else:
            from kvj.segments.segfile import canonical_layout

            layout = canonical_layout(_mapped(layout, "layout"))  # what the store will record
        # The caller's part of the record is checked here, in the caller's thread: an input error
        # raises now and never reaches the flush workers. The store fills in the rest.
        payload = {"id": request_id, "seg": _integer(segment, "segment"), "key": "0" * 64, "tokens": [start, end],
                   "layout": dict(layout or {}), "raw_size": 0, "stored_size": 0, "digest": "", "codec": ""}
        encode(RecordType.SEGMENT, payload)
        self._inflight.claim(request_id, payload["seg"], (start, end))

        def record(seg_info: "SegmentInfo") -> int:
            return self._append(RecordType.SEGMENT, {
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
            """The stored segment's info; a failed write or fsync of it is final: ``JournalFailed``."""
            try:
                return stored.result()
            except OSError as exc:
                raise self._fail(exc, "a segment flush failed") from exc

        later = self._in_order(request_id, [stored], lambda: record(stored_info()))
        if later is None:
            done: "Future[int]" = Future()
            done.set_result(record(stored_info()))
            return done
        return later

    def _in_order(self, request_id: str, ready: List["Future[Any]"],
                  append: Callable[[], int]) -> Optional["Future[int]"]:
        """Append a record of ``request_id`` after its earlier records and once ``ready`` are done.

        Returns None when nothing is pending (the caller appends at once), else a future of
        the record's LSN; ``append`` then runs on the thread that completes the last of them.
        """
        with self._order:
            before = self._waiting.get(request_id)
            deps = [f for f in ready + ([before] if before is not None else []) if not f.done()]
            if not deps and all(f.exception() is None for f in ready):
                return None
            result: "Future[int]" = Future()
            self._waiting[request_id] = result
            self._deferred.add(result)
            left = [len(deps)]

        def fire() -> None:
            try:
                result.set_result(append())
            except BaseException as exc:
                result.set_exception(exc)
            finally:
                with self._order:
                    if self._waiting.get(request_id) is result:
                        del self._waiting[request_id]
                    self._deferred.discard(result)

        def one_done(_f: "Future[Any]") -> None:
            with self._order:
                left[0] -= 1
                go = left[0] == 0
            if go:
                fire()

        if not deps:
            fire()
        for dep in deps:
            dep.add_done_callback(one_done)
        return result

    # -- durability ----------------------------------------------------------------------

    def _fail(self, error: OSError, what: str) -> JournalFailed:
        """A segment the journal needed could not be made durable: the journal fails as a whole
        (the writer stops; every later call raises), as after a failed fsync of its own log."""
        self.writer.fail(error)
        return JournalFailed(f"{what}: {error}")

    def sync(self) -> int:
        """Wait for pending segment flushes, then until every record so far is durable.

        A failed segment flush is final too: ``sync`` (and ``close``) raise ``JournalFailed``
        from then on, since a flush the caller asked for can never become durable.
        """
        self._drain_flushes()
        return self.writer.sync()

    def _drain_flushes(self) -> None:
        """Wait for segment flushes and the records queued behind them to be appended.

        Only a durability failure (a write or fsync of a segment that failed) is final and
        raises ``JournalFailed``; a flush refused for its input failed on its own future.
        """
        if self._flusher is not None:
            try:
                self._flusher.drain()
            except OSError as exc:
                raise self._fail(exc, "a segment flush failed") from exc
        while True:
            with self._order:
                deferred = list(self._deferred)
            if not deferred:
                return
            wait(deferred)

    @property
    def durable_lsn(self) -> int:
        return self.writer.durable_lsn

    def close(self) -> None:
        """Drain flushes, make everything durable, stop the committer, release the lock."""
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
