"""Content-addressed segment store: durable puts, verified gets, behind a small backend.

A segment's key is the lowercase hex BLAKE3 tree digest defined in ``segfile.py`` (raw bytes,
dtype, shape and layout), so identical blocks are stored once and a key can only ever name the
bytes it was computed from. Keys are validated before they touch a path. The bytes live
behind :class:`StorageBackend`; :class:`LocalDirBackend` (the default) keeps one file per
segment, written temp file -> fsync -> rename -> fsync directory, and ``put_many`` writes
many into one pack made durable by one fdatasync and one directory fsync (``man/kvj-segment.5``).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from kvj.errors import (CorruptionError, FormatError, InvalidArgument, LayoutMismatch, SegmentCorrupt, SegmentMissing,
                        JournalClosed)
from kvj.fileio import FS, REAL_FS, Buffer, DurabilityError
from kvj.names import check_key
from kvj.segments import segfile as seg
from kvj.segments.backend import Keep, LocalDirBackend, ObjectStat, Source, StorageBackend, Upload
from kvj.segments.codecs import auto
from kvj.segments.codecs.base import Backpressure, Codec
from kvj.segments.layout import check_layout
from kvj.trust import check_owner
from kvj.segments.uses import MISS, USE

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


class SegmentStore:
    """Durable, deduplicated, verified tensor segments.

    ``threads`` sizes the pool that hashes, compresses and decompresses chunks in parallel.
    Puts note each key stored or claimed in the backend's use log (``kvj.segments.uses``);
    ``count_loads=True`` notes every ``get`` and ``verify`` there too, served or not: the
    last use that eviction under a byte budget orders by, and the hit rate ``kvj status``
    shows. A serving engine's store counts loads; checks (fsck, verify, restore) do not, so
    that reading stays read-only and a full check does not make every segment look used.
    """

    #: Segments up to this size are hashed before anything else (dedup without a write).
    HASH_FIRST_BYTES = 2 * seg.CHUNK_SIZE

    #: Reads refuse segments declaring more raw bytes than this (a hostile header cannot
    #: make a reader allocate without bound); raise it for larger tensors.
    DEFAULT_MAX_SEGMENT_BYTES = 8 << 30

    def __init__(self, root: Union[str, os.PathLike, None] = None, fs: FS = REAL_FS,
                 backend: Optional[StorageBackend] = None, threads: Optional[int] = None,
                 max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES, count_loads: bool = False):
        if backend is None:
            if root is None:
                raise InvalidArgument("SegmentStore needs a root directory or a backend")
            check_owner(root)  # as root, a store another user owns is refused (kvj.trust)
            backend = LocalDirBackend(root, fs)
        self.backend = backend
        self.max_segment_bytes = max_segment_bytes
        self.count_loads = count_loads
        self.pool = ThreadPoolExecutor(max_workers=threads or max(2, os.cpu_count() or 2),
                                       thread_name_prefix="kvj-chunk")
        self._locks = [threading.Lock() for _ in range(64)]
        self._failed: Optional[BaseException] = None
        self._closed = False
        #: Puts answered by a stored copy (nothing written).
        self.dedup_hits = 0
        self._auto = auto.AutoChoices()
        #: Whether puts claim what they store until a journal's record names it (``kvj.segments.claims``):
        #: set by the ``Journal`` that writes through this store, which gives the claims back.
        self.journaled = False
        #: Keys a ``put_many`` of this store is writing now -> set once that put is over.
        self._in_flight: Dict[str, threading.Event] = {}
        self._in_flight_lock = threading.Lock()

    def close(self) -> None:
        """Stop the pool and drop every claim still held."""
        self._closed = True
        self.pool.shutdown(wait=True)
        self.unjournaled()

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _key_lock(self, key: str) -> threading.Lock:
        return self._locks[int(key[:2], 16) % len(self._locks)]

    def key_for(self, tensor: "torch.Tensor", layout: Optional[Dict[str, Any]] = None) -> str:
        """The key ``put`` would give ``tensor`` (a CPU tensor) under ``layout``."""
        from kvj.segments import tensors

        raw = tensors.tensor_bytes(tensor)
        return seg.compute_digest(raw, tensors.dtype_name(tensor.dtype), tensor.shape,
                                  seg.canonical_layout(layout), self.pool).hex()

    def put(self, tensor: "torch.Tensor", *, layout: Optional[Dict[str, Any]] = None,
            codec: Union[str, Codec] = "auto", pressure: int = Backpressure.NORMAL) -> SegmentInfo:
        """Store a CPU tensor; durable when this returns.

        When the key already exists and its header and chunk CRCs check out, nothing is written
        (a stored block is never rewritten); a damaged copy is quarantined and written anew.
        After a failed write or fsync the store refuses further puts (fsync is never retried).
        """
        from kvj.segments import tensors

        if tensor.device.type != "cpu":
            raise InvalidArgument("SegmentStore.put takes CPU tensors; use Flusher for device tensors")
        return self.put_bytes(tensors.tensor_bytes(tensor), dtype=tensor.dtype, shape=tuple(tensor.shape),
                              layout=layout, codec=codec, pressure=pressure)

    def put_bytes(self, raw: memoryview, *, dtype: Union[str, "torch.dtype"], shape: Tuple[int, ...],
                  layout: Optional[Dict[str, Any]] = None, codec: Union[str, Codec] = "auto",
                  pressure: int = Backpressure.NORMAL,
                  timings: Optional[Dict[str, float]] = None) -> SegmentInfo:
        """``put`` for the C-order bytes of a tensor (the flusher's staging buffers) of ``dtype``
        (a torch dtype or its header name).

        ``timings``, when given, receives the seconds spent waiting for ``compression`` (and
        hashing) and the rest, ``io``: the flusher uses them to tell a CPU-bound queue (step
        the codec down) from a disk-bound one (keep compressing).
        """
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
        self._note([(USE, info.key, 0)])
        if timings is not None:
            total = time.perf_counter() - t0
            timings.update(compression=waited[0], io=max(0.0, total - waited[0]))
        return info

    def put_many(self, items: Sequence[Item], *, codec: Union[str, Codec] = "auto",
                 pressure: int = Backpressure.NORMAL,
                 timings: Optional[Dict[str, float]] = None) -> List[SegmentInfo]:
        """Store several tensors' bytes as segments made durable together; their infos, in order.

        Each item is (C-order bytes, dtype (torch or header name), shape, layout). Each member
        is encoded, keyed and checked exactly as by :meth:`put_bytes` (every item is hashed
        first); members already stored are dedup hits (claimed, not written again), a member
        repeated within ``items`` is written once, and the new ones go into one pack: one file,
        one fdatasync, one directory fsync (kvj-segment(5), PACKS). Durable when this returns;
        on an error none of the new members may be relied on. Items are encoded in parallel
        on the store's pool. ``timings`` as for :meth:`put_bytes`.
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
        mine, theirs = self._claim(new)
        waited = 0.0
        try:
            if mine:
                waited = self._write_pack(mine, found)
        finally:
            self._release(mine)
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
        self._note([(USE, key, 0) for key in found])
        if timings is not None:
            total = time.perf_counter() - t0
            timings.update(compression=waited, io=max(0.0, total - waited))
        return [found[key] for key in keys]

    @contextmanager
    def _claimed(self, keys: List[str]) -> Iterator[None]:
        """Claim ``keys`` (one claim each) before they are looked up or written (``kvj.segments.claims``):
        kept when the block succeeds, for the journal to release once the record naming each is
        durable; given back when it raises. A store no journal writes through claims nothing."""
        if not self.journaled:
            yield
            return
        self.backend.claim(keys)
        try:
            yield
        except BaseException:
            self.release(keys)
            raise

    def release(self, keys: Iterable[str]) -> None:
        """Give back one claim on each of ``keys`` (the journal does, once the record that
        references each is durable)."""
        self.backend.release(keys)

    def unjournaled(self) -> None:
        """The journal writing through this store closed: drop the claims still held (their
        records never came) and claim nothing from now on."""
        self.journaled = False
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def claim_existing(self, key: str) -> bool:
        """Claim a stored segment to journal it again by reference (``Journal.flush(info=...)``
        takes the claim over): False, with nothing claimed, when it is gone."""
        check_key(key)
        with self._claimed([key]):
            alive = self.backend.touch(key)  # under the shared collection lock: a collector's unlink is before or after
        if not alive:
            self.release([key])
        return alive

    def _claim(self, new: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, threading.Event]]:
        """Split ``new`` into the keys this call writes (claimed) and those a concurrent
        ``put_many`` of this store is writing already (with the event it sets when done), so
        that blocks shared by concurrent steps are written once."""
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

    def _release(self, mine: Dict[str, Any]) -> None:
        with self._in_flight_lock:
            for key in mine:
                self._in_flight.pop(key).set()

    def _write_pack(self, new: Dict[str, Any], found: Dict[str, "SegmentInfo"]) -> float:
        """Encode ``new`` (key -> job) in parallel and write it as one pack, durable on return;
        the seconds spent waiting for the encoding."""
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

    def _note(self, entries: List[Tuple[int, str, int]]) -> None:
        """Append ``entries`` (kind, key, count) to the backend's use log, if it keeps one."""
        uses = self.backend.uses
        if uses is not None:
            uses.record(entries)

    def note_use(self, key: str) -> None:
        """Note that ``key`` was used now (journaled again by reference): the byte budget evicts
        least recently used segments first."""
        self._note([(USE, key, 0)])

    def counted_load(self, key: str) -> ContextManager[None]:
        """With ``count_loads``, note a load of ``key`` (by get, verify, or a caller reading it
        with read_stored): served, or (when it raises what a missing
        or damaged segment, or one of another layout, raises) asked and not served."""
        return self._counting(key) if self.count_loads else nullcontext()

    @contextmanager
    def _counting(self, key: str) -> Iterator[None]:
        try:
            yield
        except (SegmentMissing, CorruptionError, FormatError, LayoutMismatch):
            self._note([(MISS, key, 1)])
            raise
        self._note([(USE, key, 1)])

    def io_counts(self) -> Dict[str, int]:
        """The backend's disk work so far: ``file_syncs``, ``dir_syncs``, ``bytes_written``."""
        return self.backend.io_counts()

    def _existing(self, key: str) -> Optional[SegmentInfo]:
        """The stored copy of ``key`` if it checks out, claimed against collection; else None.

        A damaged copy is quarantined. A copy that garbage collection removes at any point
        before the claim (``touch``) is simply gone: the caller writes the segment anew.
        Once claimed, the copy is young, and a collector's ``delete(older_than=...)`` keeps
        it (the two exclude each other across processes).
        """
        if not self.backend.exists(key):
            return None
        try:
            header = seg.check_stored(self.backend.get(key), self.backend.describe(key))
            if header.digest.hex() != key:
                raise SegmentCorrupt(self.backend.describe(key), None, "header digest does not match the key")
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
        """After a failed write or fsync nothing more is stored (fsync is never retried), nor after ``close``."""
        if self._closed:
            raise JournalClosed("the segment store is closed")
        if self._failed is not None:
            raise DurabilityError(self._failed.errno or 0, f"segment store failed earlier: {self._failed}")

    @contextmanager
    def _failing(self, upload: Optional[Upload] = None) -> Iterator[None]:
        """On an error, drop ``upload``; an I/O error also fails the store for good."""
        try:
            yield
        except BaseException as exc:
            if upload is not None:
                upload.abort()
            if isinstance(exc, OSError):
                self._failed = exc
            raise

    def _write(self, parts: Iterable[Buffer]) -> Upload:
        with self._failing():
            upload = self.backend.begin()
        with self._failing(upload):
            for part in parts:
                upload.write(part)
        return upload

    def _commit(self, upload: Upload, key: str) -> None:
        with self._failing(upload):
            upload.commit(key)

    def ingest_stored(self, key: str, data: Buffer) -> SegmentInfo:
        """Store a segment's stored bytes (as :meth:`read_stored` gave them on another node)
        under ``key``; durable when this returns.

        The bytes are verified in full first (header, every chunk CRC, the decoded digest
        against ``key``): a damaged or mislabelled copy raises ``SegmentCorrupt`` and nothing
        is written. A good copy already here is kept (and claimed), not rewritten.
        """
        check_key(key)
        self._check_alive()
        source = seg.as_source(data, f"ingested segment {key}")
        header = self._keyed_header(source, key)
        seg.check_raw_limit(header, source.name, self.max_segment_bytes)
        seg.verify(source, pool=self.pool, header=header)
        with self._claimed([key]), self._key_lock(key):
            info = self._existing(key)
            if info is None:
                self._commit(self._write([data]), key)
                info = SegmentInfo.from_header(header)
        self._note([(USE, key, 0)])
        return info

    def read_stored(self, key: str) -> Buffer:
        """A segment's stored bytes, as they are on disk (what a replica ships per key, and
        :meth:`ingest_stored` takes on another node). Nothing is checked here: use
        ``segfile.check_stored`` (cheap) before shipping them as good."""
        return self.backend.get(check_key(key))

    def stat(self, key: str) -> ObjectStat:
        """Stored size and last use (store or dedup claim) of a segment; SegmentMissing if absent."""
        return self.backend.stat(check_key(key))

    @staticmethod
    def _keyed_header(src: Source, key: str) -> seg.Header:
        """The header of segment ``key`` in ``src``, refused unless its digest is the key: the
        cheap check, made before any chunk is read."""
        header = seg.read_header(src)
        if header.digest.hex() != key:
            raise SegmentCorrupt(src.name, None, "header digest does not match the key")
        return header

    def _header(self, key: str) -> seg.Header:
        with self.backend.open(key) as src:  # one open; a small file is read once
            return self._keyed_header(seg.whole_if_small(src), key)

    def info(self, key: str) -> SegmentInfo:
        """Header-only look-up (the chunks are not read)."""
        return SegmentInfo.from_header(self._header(check_key(key)))

    def get(self, key: str, device: Union[str, "torch.device"] = "cpu",
            expect_layout: Optional[Dict[str, Any]] = None, out: Optional["torch.Tensor"] = None) -> "torch.Tensor":
        """Read, verify (every chunk CRC and the digest) and return the tensor on ``device``.

        ``expect_layout``, when given, must equal the segment's layout (LayoutMismatch
        otherwise). ``out`` is an optional uint8 CPU staging buffer (e.g. pinned) the data is
        decoded into; for a CUDA ``device`` this returns only once the copy from ``out`` is
        done, so the caller may reuse ``out`` at once. A bare ``"cuda"`` is the current device.
        """
        from kvj.segments import device as cuda
        from kvj.segments import tensors

        check_key(key)
        with self.counted_load(key):
            with self.backend.open(key) as opened:
                src = seg.whole_if_small(opened)
                header = self._keyed_header(src, key)
                if expect_layout is not None:
                    check_layout(header.layout, expect_layout, f"segment {src.name}")
                header, tensor = tensors.decode_into(src, out, pool=self.pool, max_raw=self.max_segment_bytes,
                                                     header=header)
        target = cuda.CUDA.resolve(device)
        if target.type == "cpu":
            return tensor
        if target.type != "cuda":
            return tensor.to(target)
        on_device, copied = cuda.CUDA.upload(tensor, target)
        cuda.CUDA.finish(copied, cuda.CUDA.side_stream(target, "h2d"))
        return on_device

    def verify(self, key: str) -> SegmentInfo:
        """Fully check a segment (chunks and digest); SegmentCorrupt on any mismatch.

        The header is checked against the key first; then the chunks are decoded and hashed
        one at a time (``segfile.verify``), so whatever size a header declares, a check takes
        a chunk's memory per thread of the pool, never the segment's raw size.
        """
        check_key(key)
        with self.counted_load(key):
            with self.backend.open(key) as opened:
                src = seg.whole_if_small(opened)
                header = self._keyed_header(src, key)
                seg.check_raw_limit(header, src.name, self.max_segment_bytes)
                seg.verify(src, pool=self.pool, header=header)
        return SegmentInfo.from_header(header)

    def exists(self, key: str) -> bool:
        return self.backend.exists(check_key(key))

    def keys(self) -> Iterator[str]:
        return self.backend.keys()

    def delete(self, key: str, older_than: Optional[float] = None) -> bool:
        """Remove a segment; with ``older_than``, only if no put stored or deduplicated it since
        (see ``StorageBackend.delete``). True when it was removed."""
        return self.backend.delete(check_key(key), older_than)

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None,
                    keep: Optional[Keep] = None) -> List[str]:
        """``delete`` each key (with ``older_than`` as there) that no writer claims and ``keep``
        does not name (``StorageBackend.delete_many``); the ones removed. The removals are made
        durable together, once per directory, which is what makes collection linear in cost per
        segment instead of a directory fsync per segment."""
        return self.backend.delete_many([check_key(key) for key in keys], older_than, keep)

    def quarantine(self, key: str) -> str:
        """Move a (damaged) segment aside; later gets see it as missing."""
        return self.backend.quarantine(check_key(key))

    def quarantined_copies(self, key: Optional[str] = None) -> List[str]:
        """Where damaged copies of ``key`` (of every key, for None) were quarantined (by a
        repair or a healing put)."""
        return self.backend.quarantined_copies(check_key(key) if key is not None else None)
