"""The content-addressed segment store: durable, deduplicated puts and verified gets.

A segment's key is its digest (``segfile``), so identical blocks are stored once and a key only
ever names the bytes it was computed from. Keys are validated before they touch a path; the
bytes live in a :class:`~kvj.segments.local.LocalDirBackend`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from kvj.errors import InvalidArgument, JournalClosed, SegmentCorrupt, SegmentMissing, FormatError
from kvj.fileio import FS, REAL_FS, Buffer, DurabilityError
from kvj.names import check_key
from kvj.segments import segfile as seg
from kvj.segments.codecs import auto
from kvj.segments.codecs.base import Backpressure, Codec
from kvj.segments.layout import check_layout
from kvj.segments.local import Keep, LocalDirBackend, ObjectStat
from kvj.segments.source import as_source, whole_if_small
from kvj.segments.tempfiles import TempFile
from kvj.segments.uses import USE
from kvj.trust import check_owner

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

    ``threads`` sizes the pool that hashes, compresses and decompresses chunks in parallel. Puts
    note each key stored or claimed in the use log (``uses``); with ``count_loads`` (a serving
    engine's store) every ``get`` and ``verify`` is noted too, the last use eviction orders by
    and the hit rate ``kvj status`` shows. Checks (fsck, verify, restore) leave it off, so that
    reading stays read-only.
    """

    #: Segments up to this size are hashed before anything else (dedup without a write).
    HASH_FIRST_BYTES = 2 * seg.CHUNK_SIZE

    #: Reads refuse segments declaring more raw bytes than this (a hostile header cannot make a
    #: reader allocate without bound); raise it for larger tensors.
    DEFAULT_MAX_SEGMENT_BYTES = 8 << 30

    def __init__(self, root: Union[str, os.PathLike], fs: FS = REAL_FS, threads: Optional[int] = None,
                 max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES, count_loads: bool = False):
        check_owner(root)  # as root, a store another user owns is refused (kvj.trust)
        self.backend = LocalDirBackend(root, fs)
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
        #: Whether puts claim what they store until a journal's record names it (``claims``): set by
        #: the ``Journal`` that writes through this store, which gives the claims back.
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

    # -- puts ---------------------------------------------------------------------------

    def put(self, tensor: "torch.Tensor", *, layout: Optional[Dict[str, Any]] = None,
            codec: Union[str, Codec] = "auto", pressure: int = Backpressure.NORMAL) -> SegmentInfo:
        """Store a CPU tensor; durable when this returns.

        A key already stored whose header and chunk CRCs check out is not written again (a
        damaged copy is quarantined and written anew). After a failed write or fsync the store
        refuses further puts (fsync is never retried).
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
        """``put`` for the C-order bytes of a tensor of ``dtype`` (torch or header name).

        ``timings`` receives the seconds spent waiting for ``compression`` (and hashing) and the
        rest, ``io``: the flusher tells a CPU-bound queue from a disk-bound one by them.
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
        self.note_use(info.key)
        if timings is not None:
            total = time.perf_counter() - t0
            timings.update(compression=waited[0], io=max(0.0, total - waited[0]))
        return info

    def put_many(self, items: Sequence[Item], *, codec: Union[str, Codec] = "auto",
                 pressure: int = Backpressure.NORMAL,
                 timings: Optional[Dict[str, float]] = None) -> List[SegmentInfo]:
        """Store several tensors' bytes as segments made durable together; their infos, in order.

        Each item (bytes, dtype, shape, layout) is keyed and checked as by :meth:`put_bytes`;
        stored ones are dedup hits (claimed, not written again), a repeated one is written once,
        and the new ones go into one pack: one fdatasync, one directory fsync (PACKS). Durable
        when this returns; on an error none of the new members may be relied on.
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
        """Split ``new`` into the keys this call writes and those a concurrent ``put_many`` of this
        store is writing already (with the event it sets when done): shared blocks are written once."""
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
        """Encode ``new`` (key -> job) in parallel into one pack, durable on return; the seconds
        spent waiting for the encoding."""
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
        """The stored copy of ``key`` if its header and CRCs check out, claimed against collection; else None.

        A damaged copy is quarantined; one collected before the claim (``touch``) is simply gone:
        the caller writes it anew. Once claimed it is young, and collection keeps it.
        """
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
        """Store a segment's stored bytes (:meth:`read_stored` of another node) under ``key``; durable on return.

        They are verified in full first (header, every chunk CRC, digest against ``key``): a
        damaged or mislabelled copy raises ``SegmentCorrupt`` and nothing is written. A good
        copy already here is kept (and claimed), not rewritten.
        """
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

    # -- claims (man/kvj-segment.5, CLAIMS) -----------------------------------------------

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
        self.backend.close()

    def claim_existing(self, key: str) -> bool:
        """Claim a stored segment to journal it again by reference (``Journal.flush(info=...)``
        takes the claim over): False, with nothing claimed, when it is gone."""
        check_key(key)
        with self._claimed([key]):
            alive = self.backend.touch(key)  # under the shared collection lock: a collector's unlink is before or after
        if not alive:
            self.release([key])
        return alive

    # -- uses (the use log: eviction's last use, the hit rate) --------------------------

    def note_use(self, key: str) -> None:
        """Note that ``key`` was used now (stored, or journaled again by reference): eviction
        removes the least recently used segments first."""
        self.backend.uses.record([(USE, key, 0)])

    def counted_load(self, key: str) -> ContextManager[None]:
        """With ``count_loads``, note a load of ``key`` (by get, verify, or a reader of read_stored):
        served, or asked and not served when it raises what a missing or damaged segment raises."""
        return self.backend.uses.counting(key) if self.count_loads else nullcontext()

    def io_counts(self) -> Dict[str, int]:
        """The backend's disk work so far: ``file_syncs``, ``dir_syncs``, ``bytes_written``."""
        return self.backend.io_counts()

    # -- reads ----------------------------------------------------------------------------

    def read_stored(self, key: str) -> Buffer:
        """A segment's stored bytes as they are on disk (what a replica ships), unchecked:
        ``segfile.check_stored`` them before shipping them as good."""
        return self.backend.get(check_key(key))

    def stat(self, key: str) -> ObjectStat:
        """Stored size and last use (store or dedup claim) of a segment; SegmentMissing if absent."""
        return self.backend.stat(check_key(key))

    def info(self, key: str) -> SegmentInfo:
        """Header-only look-up (the chunks are not read)."""
        with self.backend.open(check_key(key)) as src:  # one open; a small file is read once
            return SegmentInfo.from_header(seg.read_header(whole_if_small(src), key=key))

    def get(self, key: str, device: Union[str, "torch.device"] = "cpu",
            expect_layout: Optional[Dict[str, Any]] = None, out: Optional["torch.Tensor"] = None) -> "torch.Tensor":
        """Read, verify (every chunk CRC and the digest) and return the tensor on ``device``.

        ``expect_layout``, when given, must equal the segment's layout (LayoutMismatch). ``out``
        is an optional uint8 CPU staging buffer (e.g. pinned) to decode into; for a CUDA
        ``device`` this returns once the copy from ``out`` is done, so the caller may reuse it.
        A bare ``"cuda"`` is the current device.
        """
        from kvj.segments import device as cuda
        from kvj.segments import tensors

        check_key(key)
        with self.counted_load(key):
            with self.backend.open(key) as opened:
                src = whole_if_small(opened)
                header = seg.read_header(src, key=key)
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
        """Fully check a stored segment (``segfile.verify``: every chunk and the digest, a chunk's
        memory per thread whatever its header declares); SegmentCorrupt on any mismatch."""
        check_key(key)
        with self.counted_load(key):
            with self.backend.open(key) as opened:
                src = whole_if_small(opened)
                header = seg.read_header(src, key=key)
                seg.check_raw_limit(header, src.name, self.max_segment_bytes)
                seg.verify(src, pool=self.pool, header=header)
        return SegmentInfo.from_header(header)

    def exists(self, key: str) -> bool:
        return self.backend.exists(check_key(key))

    def keys(self) -> Iterator[str]:
        return self.backend.keys()

    # -- removal --------------------------------------------------------------------------

    def delete(self, key: str, older_than: Optional[float] = None) -> bool:
        """Remove a segment; with ``older_than`` only if no put stored or claimed it since. True if removed."""
        return self.backend.delete(check_key(key), older_than)

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None,
                    keep: Optional[Keep] = None) -> List[str]:
        """``delete`` each key (``older_than`` as there) no writer claims and ``keep`` does not name
        (``LocalDirBackend.delete_many``), made durable together; the ones removed."""
        return self.backend.delete_many([check_key(key) for key in keys], older_than, keep)

    def quarantine(self, key: str) -> str:
        """Move a (damaged) segment aside; later gets see it as missing."""
        return self.backend.quarantine(check_key(key))

    def quarantined_copies(self, key: Optional[str] = None) -> List[str]:
        """Where damaged copies of ``key`` (of every key, for None) were quarantined."""
        return self.backend.quarantined_copies(check_key(key) if key is not None else None)
