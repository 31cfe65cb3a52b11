"""How segments get into the store: each one hashed, claimed, found stored (dedup) or written durably.

A key already stored whose header and chunk CRCs check out is not written again (a damaged copy
is quarantined and written anew); several at once go into one pack (PACKS). Puts claim what they
store while a journal writes through the store (CLAIMS). After a failed write or fsync nothing
more is stored: fsync is never retried.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from kvj.errors import FormatError, InvalidArgument, JournalClosed, SegmentCorrupt, SegmentMissing
from kvj.fileio import Buffer, DurabilityError
from kvj.names import check_key
from kvj.segments import segfile as seg
from kvj.segments.codecs import auto
from kvj.segments.codecs.base import Backpressure, Codec
from kvj.segments.local import LocalDirBackend
from kvj.segments.source import as_source
from kvj.segments.tempfiles import TempFile
from kvj.segments.uses import USE

if TYPE_CHECKING:  # torch is imported where tensors are made, so header-only users start without it
    import torch

#: One segment for ``put_many``: (C-order bytes, dtype or its header name, shape, layout).
Item = Tuple[Buffer, Union[str, "torch.dtype"], Sequence[int], Optional[Dict[str, Any]]]


@dataclass(frozen=True)
class SegmentInfo:
    """What a segment holds, from its header; ``to_dict()`` is what a journal record carries."""

    key: str
    dtype: str
    shape: Tuple[int, ...]
    codec: str
    raw_size: int
    stored_size: int
    digest: str
    layout: Optional[Dict[str, Any]]

    @classmethod
    def from_header(cls, header: seg.Header) -> "SegmentInfo":
        return cls(key=header.digest.hex(), dtype=header.dtype, shape=tuple(header.shape),
                   codec=header.codec, raw_size=header.raw_size, stored_size=header.stored_size,
                   digest=header.digest.hex(), layout=header.layout)

    def to_dict(self) -> Dict[str, Any]:
        """Plain msgpack/JSON-safe fields (shape as a list)."""
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "codec": self.codec,
                "raw_size": self.raw_size, "stored_size": self.stored_size, "digest": self.digest,
                "layout": self.layout}


def _dtype_name(dtype: Union[str, "torch.dtype"]) -> str:
    """The header name of ``dtype``; torch is imported only for a torch dtype."""
    if isinstance(dtype, str):
        return seg.element(dtype).name
    from kvj.segments import tensors

    return tensors.dtype_name(dtype)


def _timed_parts(parts: Iterator[Buffer], waited: List[float]) -> Iterator[Buffer]:
    """Pass ``parts`` through, adding the time spent waiting for each to ``waited[0]``."""
    while True:
        t = time.perf_counter()
        try:
            part = next(parts)
        except StopIteration:
            return
        finally:
            waited[0] += time.perf_counter() - t
        yield part


class SegmentPuts:
    """The write half of a ``SegmentStore``: puts, the claims they take, and the store's failed state."""

    #: Segments up to this size are hashed before anything else (dedup without a write).
    HASH_FIRST_BYTES = 2 * seg.CHUNK_SIZE

    def __init__(self, backend: LocalDirBackend, pool: ThreadPoolExecutor, max_segment_bytes: int):
        self.backend, self.pool, self.max_segment_bytes = backend, pool, max_segment_bytes
        self._locks = [threading.Lock() for _ in range(64)]
        self._failed: Optional[BaseException] = None
        self._closed = False
        #: Puts answered by a stored copy (nothing written).
        self.dedup_hits = 0
        self._auto = auto.AutoChoices()
        #: Whether puts claim what they store until a journal's record names it (``claims``): set by
        #: the ``Journal`` that writes through this store, which gives the claims back.
        self.journaled = False
        #: Keys a ``put_many`` of this store is writing now -> set once that put is over.
        self._in_flight: Dict[str, threading.Event] = {}
        self._in_flight_lock = threading.Lock()

    def _key_lock(self, key: str) -> threading.Lock:
        return self._locks[int(key[:2], 16) % len(self._locks)]

    def put(self, tensor: "torch.Tensor", *, layout: Optional[Dict[str, Any]] = None,
            codec: Union[str, Codec] = "auto", pressure: int = Backpressure.NORMAL) -> SegmentInfo:
        """Store a CPU tensor, durable on return; a stored copy that checks out is not written again."""
        from kvj.segments import tensors

        if tensor.device.type != "cpu":
            raise InvalidArgument("SegmentStore.put takes CPU tensors; use Flusher for device tensors")
        return self.put_bytes(tensors.tensor_bytes(tensor), dtype=tensor.dtype, shape=tuple(tensor.shape),
                              layout=layout, codec=codec, pressure=pressure)

    def put_bytes(self, raw: memoryview, *, dtype: Union[str, "torch.dtype"], shape: Tuple[int, ...],
                  layout: Optional[Dict[str, Any]] = None, codec: Union[str, Codec] = "auto",
                  pressure: int = Backpressure.NORMAL,
                  timings: Optional[Dict[str, float]] = None) -> SegmentInfo:
        """``put`` for a tensor's C-order bytes; ``timings`` gets the seconds of ``compression`` and ``io``
        (the flusher tells a CPU-bound queue from a disk-bound one by them)."""
        self._check_alive()
        layout = seg.canonical_layout(layout)
        name = _dtype_name(dtype)
        shape = tuple(int(d) for d in shape)
        pipeline = auto.choose(raw, seg.element(name), shape, codec=codec, pressure=pressure, memo=self._auto)
        waited = [0.0]
        t0 = time.perf_counter()
        if len(raw) <= self.HASH_FIRST_BYTES:
            # Small (a KV block): hash first, so a duplicate costs no compression and no write.
            key = seg.compute_digest(raw, name, shape, layout, self.pool).hex()
            with self._claimed([key]), self._key_lock(key):
                info = self._existing(key)
                if info is None:
                    enc = seg.encode(raw, dtype=name, shape=shape, layout=layout, digest=bytes.fromhex(key),
                                     pipeline=pipeline, pool=self.pool)
                    self._commit(self._write(_timed_parts(enc.parts(), waited)), key)
                    info = SegmentInfo.from_header(enc.header)
        else:
            # Large: hash while compressing and writing; the key is known at the end.
            enc = seg.encode(raw, dtype=name, shape=shape, layout=layout, digest=None,
                             pipeline=pipeline, pool=self.pool)
            upload = self._write(_timed_parts(enc.parts(), waited))
            key = enc.header.digest.hex()
            try:
                with self._claimed([key]), self._key_lock(key):
                    info = self._existing(key)
                    if info is None:
                        self._commit(upload, key)
                        info = SegmentInfo.from_header(enc.header)
            finally:
                upload.abort()  # none left to drop once committed
        self.note_use(info.key)
        if timings is not None:
            total = time.perf_counter() - t0
            timings.update(compression=waited[0], io=max(0.0, total - waited[0]))
        return info

    def put_many(self, items: Sequence[Item], *, codec: Union[str, Codec] = "auto",
                 pressure: int = Backpressure.NORMAL,
                 timings: Optional[Dict[str, float]] = None) -> List[SegmentInfo]:
        """Store several tensors' bytes, made durable together in one pack (PACKS); their infos, in order.

        Items are keyed and deduplicated as by :meth:`put_bytes`; on an error none of the new ones may be relied on.
        """
        self._check_alive()
        t0 = time.perf_counter()
        jobs = []
        for raw, dtype, shape, layout in items:
            raw = memoryview(raw).cast("B")
            name, shape = _dtype_name(dtype), tuple(int(d) for d in shape)
            pipeline = auto.choose(raw, seg.element(name), shape, codec=codec, pressure=pressure, memo=self._auto)
            jobs.append((raw, name, shape, seg.canonical_layout(layout), pipeline))
        keys = list(self.pool.map(lambda job: seg.compute_digest(job[0], job[1], job[2], job[3]).hex(), jobs))
        with self._claimed(keys):
            return self._put_claimed(keys, jobs, pressure, timings, t0)

    def _put_claimed(self, keys: List[str], jobs: List[Any], pressure: int, timings: Optional[Dict[str, float]],
                     t0: float) -> List[SegmentInfo]:
        """``put_many`` once every key is claimed: dedup hits, then one pack of the new members."""
        found: Dict[str, SegmentInfo] = {}
        for key in sorted(self.backend.exists_many(keys)):
            with self._key_lock(key):
                info = self._existing(key)
            if info is not None:
                found[key] = info
        new = {key: job for key, job in zip(keys, jobs) if key not in found}
        mine, theirs = self._take_in_flight(new)
        waited = 0.0
        try:
            if mine:
                waited = self._write_pack(mine, found)
        finally:
            self._end_in_flight(mine)
        for key, done in theirs.items():  # written by a concurrent put_many: a dedup hit once it is durable
            done.wait()
            with self._key_lock(key):
                info = self._existing(key)
            if info is None:  # that put failed: store this one on its own (its claim given back)
                raw, name, shape, layout, pipeline = new[key]
                info = self.put_bytes(raw, dtype=name, shape=shape, layout=layout, codec=pipeline.codec,
                                      pressure=pressure)
                self.release([key])
            found[key] = info
        self.backend.uses.record([(USE, key, 0) for key in found])
        if timings is not None:
            total = time.perf_counter() - t0
            timings.update(compression=waited, io=max(0.0, total - waited))
        return [found[key] for key in keys]

    def _take_in_flight(self, new: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, threading.Event]]:
        """Split ``new`` into the keys this call writes and those a concurrent ``put_many`` writes already
        (with the event it sets when done): blocks shared by concurrent steps are written once."""
        mine: Dict[str, Any] = {}
        theirs: Dict[str, threading.Event] = {}
        with self._in_flight_lock:
            for key, job in new.items():
                if key in self._in_flight:
                    theirs[key] = self._in_flight[key]
                else:
                    self._in_flight[key] = threading.Event()
                    mine[key] = job
        return mine, theirs

    def _end_in_flight(self, mine: Dict[str, Any]) -> None:
        with self._in_flight_lock:
            for key in mine:
                self._in_flight.pop(key).set()

    def _write_pack(self, new: Dict[str, Any], found: Dict[str, SegmentInfo]) -> float:
        """Encode ``new`` in parallel into one pack, durable on return; the seconds waited for encoding."""
        waited = 0.0
        with self._failing():
            upload = self.backend.begin_many()
        futures = [self.pool.submit(self._encode_whole, job, key) for key, job in new.items()]
        try:
            with self._failing(upload):
                for key, fut in zip(new, futures):
                    t = time.perf_counter()
                    parts, header = fut.result()
                    waited += time.perf_counter() - t
                    upload.add(key, parts)
                    found[key] = SegmentInfo.from_header(header)
                upload.commit()
        finally:
            for fut in futures:
                fut.cancel()
            wait(futures)  # none still reads a caller's buffer once this returns
        return waited

    @staticmethod
    def _encode_whole(job: Tuple[memoryview, str, Tuple[int, ...], Any, Any],
                      key: str) -> Tuple[List[Buffer], seg.Header]:
        """One segment's file bytes and header (a pool task: its chunks are encoded in turn)."""
        raw, name, shape, layout, pipeline = job
        enc = seg.encode(raw, dtype=name, shape=shape, layout=layout, digest=bytes.fromhex(key), pipeline=pipeline)
        parts = list(enc.parts())
        assert enc.header is not None
        return parts, enc.header

    def _existing(self, key: str) -> Optional[SegmentInfo]:
        """The stored copy of ``key`` if its header and CRCs check out, claimed against collection
        (``touch``: then young, and kept); else None (a damaged copy is quarantined)."""
        if not self.backend.exists(key):
            return None
        try:
            header = seg.check_stored(self.backend.get(key), self.backend.describe(key), key)
        except SegmentMissing:
            return None
        except (SegmentCorrupt, FormatError):
            try:
                self.backend.quarantine(key)
            except SegmentMissing:
                pass
            return None
        if not self.backend.touch(key):
            return None
        self.dedup_hits += 1
        return SegmentInfo.from_header(header)

    def _check_alive(self) -> None:
        """Nothing more is stored after a failed write or fsync (never retried), nor after ``close``."""
        if self._closed:
            raise JournalClosed("the segment store is closed")
        if self._failed is not None:
            raise DurabilityError(self._failed.errno or 0, f"segment store failed earlier: {self._failed}")

    @contextmanager
    def _failing(self, upload: Any = None) -> Iterator[None]:
        """On an error, drop ``upload``; an I/O error also fails the store for good."""
        try:
            yield
        except BaseException as exc:
            if upload is not None:
                upload.abort()
            if isinstance(exc, OSError):
                self._failed = exc
            raise

    def _write(self, parts: Iterable[Buffer]) -> TempFile:
        with self._failing():
            upload = self.backend.begin()
        with self._failing(upload):
            for part in parts:
                upload.write(part)
        return upload

    def _commit(self, upload: TempFile, key: str) -> None:
        with self._failing(upload):
            self.backend.commit(upload, key)

    def ingest_stored(self, key: str, data: Buffer) -> SegmentInfo:
        """Store another node's :meth:`read_stored` bytes under ``key``, durable on return, once verified
        in full (a damaged or mislabelled copy is ``SegmentCorrupt``, nothing written)."""
        check_key(key)
        self._check_alive()
        source = as_source(data, f"ingested segment {key}")
        header = seg.read_header(source, key=key)
        seg.check_raw_limit(header, source.name, self.max_segment_bytes)
        seg.verify(source, pool=self.pool, header=header)
        with self._claimed([key]), self._key_lock(key):
            info = self._existing(key)
            if info is None:
                self._commit(self._write([data]), key)
                info = SegmentInfo.from_header(header)
        self.note_use(key)
        return info

    @contextmanager
    def _claimed(self, keys: List[str]) -> Iterator[None]:
        """Claim ``keys`` before they are looked up or written: kept when the block succeeds (the journal
        releases them), given back when it raises. A store no journal writes through claims nothing."""
        if not self.journaled:
            yield
            return
        self.backend.start_writing()  # the store's root, where the claims file lives
        self.backend.claims.claim(keys)
        try:
            yield
        except BaseException:
            self.release(keys)
            raise

    def release(self, keys: Iterable[str]) -> None:
        """Give back one claim on each of ``keys`` (once the record that names each is durable)."""
        self.backend.claims.release(keys)

    def unjournaled(self) -> None:
        """The journal writing through this store closed: drop the claims still held, claim nothing more."""
        self.journaled = False
        self.backend.claims.close()

    def claim_existing(self, key: str) -> bool:
        """Claim a stored segment to journal it again by reference (``Journal.flush(info=...)`` takes the
        claim over); False, nothing claimed, when it is gone."""
        check_key(key)
        with self._claimed([key]):
            alive = self.backend.touch(key)  # under the shared collection lock: a collector's unlink is before or after
        if not alive:
            self.release([key])
        return alive

    def note_use(self, key: str) -> None:
        """Note that ``key`` was used now (eviction removes the least recently used first)."""
        self.backend.uses.record([(USE, key, 0)])
