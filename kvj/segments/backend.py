"""Where segment bytes live: the ``StorageBackend`` interface and the local-directory backend.

The content-addressed store above (``kvj.segments.store``) decides keys, dedup and
verification; a backend only stores and returns bytes under keys it is given, durably.
``LocalDirBackend`` keeps one file per segment, written temp file -> fsync -> rename ->
fsync directory, and packs of many segments made durable together (``packs.py``); a key
resolves to either the same way (``man/kvj-segment.5``).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

from kvj.errors import SegmentCorrupt, SegmentMissing, UnsafePath
from kvj.fileio import (DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, FS, REAL_FS, Buffer, DurabilityError, PathLike,
                        discard_temp, list_dir, makedirs_durable, open_regular, rename_durable)
from kvj.names import KEY_RE
from kvj.segments.claims import Claims, claimed
from kvj.segments.packs import PackDir, PackWriter
from kvj.segments.uses import UseLog

SEGMENT_SUFFIX = ".kvjseg"
#: The store's collection lock (see ``LocalDirBackend.collection_lock``).
GC_LOCK = "gc.lock"
#: Told, under the collection lock, the keys about to be removed; returns those to keep.
Keep = Callable[[List[str]], Set[str]]
#: Collection unlinks this many files per hold of the collection lock, on this many threads.
UNLINK_BATCH = 64
UNLINK_THREADS = 8


def _same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


@dataclass(frozen=True)
class ObjectStat:
    """What a backend knows about a stored object besides its bytes."""

    size: int
    #: Unix time it was stored or last claimed by a dedup hit (what collection's grace period counts from).
    used: float


class Source(ABC):
    """A segment's stored bytes, read by offset: held in memory (:class:`BytesSource`) or read
    from a file chunk by chunk as the decoder needs them (``StorageBackend.open``), so a load
    neither copies the whole file into a buffer first nor waits for it before decoding."""

    name: str
    size: int

    @abstractmethod
    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; ``SegmentCorrupt`` if the file ends first."""

    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset``, in this thread's scratch buffer: valid until the thread's
        next read."""
        buf = _thread_buffer(n)
        self.read_into(offset, buf)
        return buf


class BytesSource(Source):
    """A whole segment file held in memory (reads are zero-copy slices)."""

    def __init__(self, data: Buffer, name: str = "<segment>"):
        self.view = memoryview(data).cast("B")
        self.name, self.size = name, len(self.view)

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > self.size:
            raise SegmentCorrupt(self.name, offset, "segment ends inside a chunk")
        out[:] = self.view[offset:offset + len(out)]

    def read(self, offset: int, n: int) -> memoryview:
        if offset + n > self.size:
            raise SegmentCorrupt(self.name, offset, "segment ends inside a chunk")
        return self.view[offset:offset + n]


_local = threading.local()


def _thread_buffer(n: int) -> memoryview:
    """This thread's reusable read buffer, at least ``n`` bytes (reused, so no page faults)."""
    import numpy as np  # here, not at the top: listing and stat-ing a store needs none

    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = np.empty(max(n, 1 << 20), np.uint8)
    return memoryview(buf)[:n]


class Upload(ABC):
    """One segment being written: ``write`` parts, then ``commit`` it under its key (or ``abort``).

    The key may be decided only at the end (it is the digest, computed while compressing).
    """

    @abstractmethod
    def write(self, part: Buffer) -> None: ...

    @abstractmethod
    def commit(self, key: str) -> int:
        """Make the object durable under ``key`` (replacing any old one atomically); its size."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written (best effort, never raises)."""


class ManyUpload(ABC):
    """Several segments written together: ``add`` each (its key and its bytes), then
    ``commit`` them all, durable when it returns (or ``abort``)."""

    @abstractmethod
    def add(self, key: str, parts: Iterable[Buffer]) -> None: ...

    @abstractmethod
    def commit(self) -> object:
        """Make every object added durable."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written (best effort, never raises)."""


ManyUpload.register(PackWriter)


class _EachOnItsOwn(ManyUpload):
    """``begin_many`` of a backend without packs: one upload per object, committed in turn."""

    def __init__(self, backend: "StorageBackend"):
        self.backend = backend
        self.uploads: List[tuple] = []

    def add(self, key: str, parts: Iterable[Buffer]) -> None:
        upload = self.backend.begin()
        self.uploads.append((upload, key))
        for part in parts:
            upload.write(part)

    def commit(self) -> None:
        for upload, key in self.uploads:
            upload.commit(key)

    def abort(self) -> None:
        for upload, _key in self.uploads:
            upload.abort()


class StorageBackend(ABC):
    """Where segment bytes live. Keys reaching a backend are already validated."""

    #: Where the store notes each segment's uses (None: this backend keeps no use log).
    uses: Optional[UseLog] = None

    @abstractmethod
    def begin(self) -> Upload:
        """Start writing a new object."""

    def begin_many(self) -> ManyUpload:
        """Start writing several objects to be made durable together (this default writes
        each as :meth:`begin` does; a file backend writes one pack)."""
        return _EachOnItsOwn(self)

    def exists_many(self, keys: Iterable[str]) -> Set[str]:
        """Which of ``keys`` are stored."""
        return {key for key in keys if self.exists(key)}

    def io_counts(self) -> Dict[str, int]:
        """What this backend has asked of the disk: ``file_syncs`` (fsync and fdatasync),
        ``dir_syncs`` and ``bytes_written`` (empty for a backend that does not count)."""
        return {}

    @abstractmethod
    def get(self, key: str) -> Buffer:
        """All bytes of ``key``; SegmentMissing when absent."""

    @contextmanager
    def open(self, key: str) -> Iterator[Source]:
        """``key``'s bytes to read by offset while the context lasts; SegmentMissing when absent.
        (This default reads them all with :meth:`get`; a file backend reads as asked.)"""
        yield BytesSource(self.get(key), self.describe(key))

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of ``key`` from ``offset``; SegmentMissing when absent."""

    @abstractmethod
    def stat(self, key: str) -> ObjectStat:
        """Size and last use of ``key``; SegmentMissing when absent."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str, older_than: Optional[float] = None) -> bool:
        """Remove ``key`` durably; True when it was removed (False when absent).

        With ``older_than`` (a Unix time) only if ``key`` was neither stored nor touched after
        it, atomically with respect to :meth:`touch` in any process: garbage collection uses
        this, so a segment that a writer's dedup has just claimed is never removed.
        """

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None,
                    keep: Optional[Keep] = None) -> List[str]:
        """``delete`` each of ``keys``; the ones removed, all durably gone when this returns.
        A backend may make the removals durable together (one directory sync, not one each).
        ``keep(keys)``, asked once the claims were checked, names keys to keep after all (a
        collector's journal records appended since its replay: man/kvj-segment.5, CLAIMS)."""
        keys = list(keys)
        spared = keep(keys) if keep is not None else set()
        return [key for key in keys if key not in spared and self.delete(key, older_than)]

    def claim(self, keys: Iterable[str]) -> None:
        """Claim ``keys`` until :meth:`release` (``kvj.segments.claims``; a backend without
        claims has no collector to keep them from)."""

    def release(self, keys: Iterable[str]) -> None:
        """Give back one claim on each of ``keys``."""

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    @abstractmethod
    def touch(self, key: str) -> bool:
        """Mark ``key`` as used now (a dedup hit restarts collection's grace period); False
        when it is gone. Atomic with respect to :meth:`delete` with ``older_than``."""

    @abstractmethod
    def quarantine(self, key: str) -> str:
        """Move ``key`` aside so that it no longer resolves; returns where it went."""

    def quarantined_copies(self, key: Optional[str] = None) -> List[str]:
        """Where copies of ``key`` (of every key, for None) were quarantined, oldest first (a
        backend that keeps no quarantine has none)."""
        return []

    def describe(self, key: str) -> str:
        """A human-readable location for error messages."""
        return key


def _read_into(fd: int, out: memoryview, offset: int, path: str) -> None:
    """Fill ``out`` from ``fd`` at ``offset``; a read error or an early end is ``SegmentCorrupt``."""
    got = 0
    while got < len(out):
        try:
            n = os.preadv(fd, [out[got:]], offset + got)
        except OSError as exc:
            raise SegmentCorrupt(path, offset + got, f"read failed: {exc.strerror or exc}") from None
        if n == 0:
            raise SegmentCorrupt(path, offset + got, f"file ended after {offset + got} bytes, "
                                 f"{offset + len(out)} expected (truncated while being read)")
        got += n


class _FileSource(Source):
    """A segment file, or a member of a pack from ``base``, read by offset (thread-safe:
    ``pread``); reads are errors, never SIGBUS."""

    def __init__(self, fd: int, size: int, path: str, base: int = 0):
        self.fd, self.size, self.name, self.base = fd, size, path, base

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset + len(out) > self.size:
            raise SegmentCorrupt(self.name, offset, "segment ends inside a chunk")
        _read_into(self.fd, out, self.base + offset, self.name)


class _CountedFS(FS):
    """A backend's file layer: ``inner``'s operations, counted (the benchmark's fsyncs per
    step and bytes written)."""

    def __init__(self, inner: FS):
        self.inner = inner
        self._lock = threading.Lock()
        self.counts = {"file_syncs": 0, "dir_syncs": 0, "bytes_written": 0}

    def _add(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def open(self, path: PathLike, flags: int, mode: int = DEFAULT_FILE_MODE) -> int:
        return self.inner.open(path, flags, mode)

    def write(self, fd: int, data: Buffer) -> None:
        self.inner.write(fd, data)
        self._add("bytes_written", len(memoryview(data).cast("B")))

    def writev(self, fd: int, parts: "list[Buffer]") -> None:
        for part in parts:
            self.write(fd, part)

    def fsync(self, fd: int) -> None:
        self.inner.fsync(fd)
        self._add("file_syncs")

    def fdatasync(self, fd: int) -> None:
        self.inner.fdatasync(fd)
        self._add("file_syncs")

    def ftruncate(self, fd: int, length: int) -> None:
        self.inner.ftruncate(fd, length)

    def close(self, fd: int) -> None:
        self.inner.close(fd)

    def rename(self, src: PathLike, dst: PathLike) -> None:
        self.inner.rename(src, dst)

    def unlink(self, path: PathLike) -> None:
        self.inner.unlink(path)

    def mkdir(self, path: PathLike, mode: int = DEFAULT_DIR_MODE) -> None:
        self.inner.mkdir(path, mode)

    def fsync_dir(self, path: PathLike) -> None:
        self.inner.fsync_dir(path)
        self._add("dir_syncs")


class _LocalUpload(Upload):
    """A temp file in ``root/tmp``; big writes are fdatasynced as they go, so the disk works
    while later chunks are still being compressed, and the final fsync has little left to do."""

    SYNC_EVERY = 8 << 20

    def __init__(self, backend: "LocalDirBackend"):
        self.backend = backend
        self.fs = backend.counted_fs
        self.size = 0
        self.unsynced = 0
        self.tmp, fd = backend.new_temp()
        self.fd: Optional[int] = fd

    def _failed(self, exc: OSError, what: str) -> DurabilityError:
        self.abort()
        return DurabilityError(exc.errno or 0, f"{what} segment temp file {self.tmp}: {exc.strerror or exc}")

    def write(self, part: Buffer) -> None:
        assert self.fd is not None
        try:
            self.fs.write(self.fd, part)
            self.size += len(part)
            self.unsynced += len(part)
            if self.unsynced >= self.SYNC_EVERY:
                self.fs.fdatasync(self.fd)
                self.unsynced = 0
        except OSError as exc:
            raise self._failed(exc, "writing") from exc

    def commit(self, key: str) -> int:
        assert self.fd is not None
        try:
            self.fs.fsync(self.fd)
        except OSError as exc:
            raise self._failed(exc, "fsyncing") from exc
        final = self.backend.path(key)
        directory = os.path.dirname(final)
        try:
            makedirs_durable(directory, self.fs)
            self.fs.rename(self.tmp, final)  # still locked: no cleaner takes it from under us
            self.fs.fsync_dir(directory)
        finally:
            fd, self.fd = self.fd, None
            self.fs.close(fd)
        return self.size

    def abort(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            discard_temp(self.fs, fd, self.tmp)


class LocalDirBackend(StorageBackend):
    """Segment files under ``root/objects/<k[:2]>/<key>.kvjseg`` and packs of them under
    ``root/packs/`` (``packs.py``); a key resolves to its loose file first, then to a pack.

    New files are written in ``root/tmp/<pid>.<random>.tmp`` (flocked by their writer while it
    writes), fsynced, renamed into place and the target directory fsynced. Quarantined files
    move to ``root/quarantine/<key>.<unix-ns>.kvjseg``. Opening a backend writes nothing
    (read-only commands stay read-only); directories are made by the first write, which also
    removes temp files that no live writer holds.
    """

    def __init__(self, root: Union[str, os.PathLike], fs: FS = REAL_FS):
        self.root = os.path.abspath(os.fspath(root))
        self.fs = fs
        #: Every operation of this backend goes through it (counted: ``io_counts``).
        self.counted_fs = _CountedFS(fs)
        self.objects = os.path.join(self.root, "objects")
        self.tmp_dir = os.path.join(self.root, "tmp")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.packs = PackDir(self)
        #: Not counted in ``io_counts``: those are the segments' own disk work.
        self.uses = UseLog(self.root, fs, self.collection_lock)
        self.claims = Claims(self.root)
        self._writing = False
        self._writing_lock = threading.Lock()

    def path(self, key: str) -> str:
        """Where ``key``'s loose file is (or would be)."""
        return os.path.join(self.objects, key[:2], key + SEGMENT_SUFFIX)

    def describe(self, key: str) -> str:
        if not os.path.lexists(self.path(key)):
            hit = self.packs.locate(key)
            if hit is not None:
                return f"{hit[0].path}@{hit[1].offset}"
        return self.path(key)

    def io_counts(self) -> Dict[str, int]:
        return dict(self.counted_fs.counts)

    def _start_writing(self) -> None:
        with self._writing_lock:
            if not self._writing:
                makedirs_durable(self.tmp_dir, self.counted_fs)
                self.clean_temps()
                self._writing = True

    def begin(self) -> Upload:
        self._start_writing()
        return _LocalUpload(self)

    def claim(self, keys: Iterable[str]) -> None:
        self._start_writing()  # the store's root, where the claims file lives
        self.claims.claim(keys)

    def release(self, keys: Iterable[str]) -> None:
        self.claims.release(keys)

    def close(self) -> None:
        """Drop every claim this backend still holds."""
        self.claims.close()

    def begin_many(self) -> ManyUpload:
        """One pack for all the segments added (``packs.PackWriter``)."""
        self._start_writing()
        return self.packs.begin()

    def new_temp(self) -> Tuple[str, int]:
        """A new temp file in ``tmp/``, open for writing and flocked; (its path, its descriptor)."""
        fs = self.counted_fs
        while True:
            tmp = os.path.join(self.tmp_dir, f"{os.getpid()}.{secrets.token_hex(6)}.tmp")
            fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            # The lock says "a live writer owns this file" (across PID namespaces too). A
            # cleaner that locked and unlinked the file before this lock was taken has taken
            # the name away: start over with a new one.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(tmp, fd):
                return tmp, fd
            fs.close(fd)

    def clean_temps(self) -> int:
        """Remove temp files that no writer holds (a torn pack among them); returns how many.

        A writer holds an flock on its temp file until it renames or removes it, and the kernel
        drops the lock when the writer dies, so "not locked" means "abandoned" whatever PID
        namespace the writer ran in (a pid in the name says nothing across containers).
        """
        removed = 0
        try:
            names = os.listdir(self.tmp_dir)
        except FileNotFoundError:
            return 0
        for name in names:
            if not name.endswith(".tmp"):
                continue
            path = os.path.join(self.tmp_dir, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)  # a live writer holds it
                continue
            try:
                if _same_file(path, fd):
                    self.counted_fs.unlink(path)
                    removed += 1
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        return removed

    def _missing(self, key: str) -> SegmentMissing:
        damaged = self.packs.damaged
        note = f"; {len(damaged)} damaged pack(s) whose members cannot be listed: " + \
            ", ".join(f"{p} ({why})" for p, why in sorted(damaged.items())) if damaged else ""
        return SegmentMissing(f"segment {key} not in store ({self.path(key)}){note}")

    @contextmanager
    def _open(self, key: str) -> Iterator[Tuple[int, int, int, str]]:
        """(descriptor, offset, length, path) of ``key``'s bytes: its loose file, else its pack."""
        path = self.path(key)
        try:
            # O_NONBLOCK kept: it means nothing to a regular file, and clearing it costs two syscalls
            fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            fd = None
        except UnsafePath as exc:  # a link, FIFO or device where a segment should be: a damaged segment
            raise SegmentCorrupt(path, None, str(exc)) from None
        if fd is not None:
            try:
                yield fd, 0, os.fstat(fd).st_size, path
            finally:
                os.close(fd)
            return
        try:
            with self.packs.open(key) as (pack_fd, member, path):
                yield pack_fd, member.offset, member.length, f"{path}@{member.offset}"
        except SegmentMissing:
            raise self._missing(key) from None

    @contextmanager
    def open(self, key: str) -> Iterator[Source]:
        """The file (or pack member), read chunk by chunk by whoever decodes it (``pread``)."""
        with self._open(key) as (fd, base, size, name):
            yield _FileSource(fd, size, name, base)

    def get(self, key: str) -> Buffer:
        """All bytes of the segment, read into memory.

        Not memory-mapped: through a map, a media error or a file truncated under the reader
        is a SIGBUS that kills the process; read, either is a ``SegmentCorrupt`` naming the file.
        """
        import numpy as np

        with self._open(key) as (fd, base, size, name):
            data = memoryview(np.empty(size, np.uint8)) if size else memoryview(b"")
            _read_into(fd, data, base, name)
            return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self._open(key) as (fd, base, size, name):
            length = max(0, min(length, size - offset))
            try:
                return os.pread(fd, length, base + offset)
            except OSError as exc:
                raise SegmentCorrupt(name, offset, f"read failed: {exc.strerror or exc}") from None

    def stat(self, key: str) -> ObjectStat:
        try:
            st = os.stat(self.path(key), follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            return ObjectStat(st.st_size, st.st_mtime)
        for _ in range(3):
            hit = self.packs.locate(key)
            if hit is None:
                break
            try:
                return ObjectStat(hit[1].length, os.stat(hit[0].path, follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                self.packs.forget(hit[0].name)
        raise self._missing(key)

    def _is_loose(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(self.path(key), follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def exists(self, key: str) -> bool:
        return self._is_loose(key) or self.packs.locate(key) is not None

    def exists_many(self, keys: Iterable[str]) -> Set[str]:
        keys = set(keys)
        loose = {key for key in keys if self._is_loose(key)}
        return loose | self.packs.holding(keys - loose)

    @contextmanager
    def collection_lock(self, exclusive: bool) -> Iterator[None]:
        """``flock`` on ``root/gc.lock``: shared for a dedup hit's touch, exclusive for a
        collector's age check and unlink, so neither can fall between the other's steps.
        Each use opens its own descriptor, so threads and stores in one process exclude
        each other as processes do."""
        fd = open_regular(os.path.join(self.root, GC_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def delete(self, key: str, older_than: Optional[float] = None) -> bool:
        return bool(self.delete_many([key], older_than))

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None,
                    keep: Optional[Keep] = None) -> List[str]:
        """Remove every copy of the keys (loose files unlinked, packed members named dead),
        then make it durable: each directory that lost a file fsynced once, each dead list
        fdatasynced once; packs left with no live member are unlinked and mostly dead ones
        repacked. A key counts as removed when no copy of it is left.

        Under the exclusive collection lock, a key some writer claims is kept, and then so is
        every key ``keep`` names (man/kvj-segment.5, CLAIMS): in that order, since a claim is
        released only once the journal record that references its key is in the log.

        Unlinks run on a few threads (an unlink that frees blocks takes ~1 ms on a busy disk and
        they overlap), ``UNLINK_BATCH`` keys per hold of the collection lock, so a writer's
        dedup touch waits for at most one batch.
        """
        keys = list(keys)
        loose: List[str] = []
        packed: Set[str] = set()
        kept: Set[str] = set()
        grew: Set[str] = set()
        with ThreadPoolExecutor(max_workers=max(1, min(UNLINK_THREADS, len(keys)))) as pool:
            for start in range(0, len(keys), UNLINK_BATCH):
                batch = keys[start:start + UNLINK_BATCH]
                with self.collection_lock(exclusive=True):
                    spared = claimed(self.root, batch)
                    if keep is not None:
                        spared |= keep([key for key in batch if key not in spared])
                    kept |= spared
                    batch = [key for key in batch if key not in spared]
                    fates = list(pool.map(lambda key: self._unlink(key, older_than), batch))
                    dead, young, packs = self.packs.mark_dead(batch, older_than)
                loose += [key for key, fate in zip(batch, fates) if fate == "removed"]
                kept |= {key for key, fate in zip(batch, fates) if fate == "kept"} | young
                packed |= dead
                grew |= packs
        for directory in sorted({os.path.dirname(self.path(key)) for key in loose}):
            self.counted_fs.fsync_dir(directory)
        self.packs.finish(grew)
        gone = set(loose) | packed
        return [key for key in dict.fromkeys(keys) if key in gone and key not in kept]

    def _unlink(self, key: str, older_than: Optional[float]) -> str:
        """Unlink one key's loose file unless it was used after ``older_than`` (the caller holds
        the collection lock): "removed", "kept" or "absent"."""
        path = self.path(key)
        try:
            if older_than is not None and os.stat(path, follow_symlinks=False).st_mtime > older_than:
                return "kept"
            self.counted_fs.unlink(path)
        except FileNotFoundError:
            return "absent"
        return "removed"

    def _loose_keys(self) -> Iterator[str]:
        try:
            fans = sorted(os.listdir(self.objects))
        except FileNotFoundError:
            return
        for fan in fans:
            if len(fan) != 2:
                continue
            try:
                names = sorted(os.listdir(os.path.join(self.objects, fan)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                key = name[:-len(SEGMENT_SUFFIX)]
                if name.endswith(SEGMENT_SUFFIX) and KEY_RE.fullmatch(key) and key[:2] == fan:
                    yield key

    def keys(self) -> Iterator[str]:
        """Every key once: the loose ones in order, then those only in packs, in order."""
        loose = set()
        for key in self._loose_keys():
            loose.add(key)
            yield key
        yield from sorted(self.packs.live_keys() - loose)

    def touch(self, key: str) -> bool:
        path = self.path(key)
        with self.collection_lock(exclusive=False):
            if os.path.lexists(path):
                try:
                    os.utime(path, follow_symlinks=False)
                    return True
                except FileNotFoundError:
                    pass
            return self.packs.touch(key)

    def quarantine(self, key: str) -> str:
        makedirs_durable(self.quarantine_dir, self.counted_fs)
        src = self.path(key)
        dst = os.path.join(self.quarantine_dir, f"{key}.{time.time_ns()}{SEGMENT_SUFFIX}")
        try:
            rename_durable(src, dst, self.counted_fs)
            return dst
        except FileNotFoundError:
            pass
        try:
            self.packs.quarantine(key, dst)  # a member: its bytes set aside, the others kept
        except SegmentMissing:
            raise SegmentMissing(f"segment {key} not in store ({src})") from None
        return dst

    def quarantined_copies(self, key: Optional[str] = None) -> List[str]:
        return [os.path.join(self.quarantine_dir, n) for n in sorted(list_dir(self.quarantine_dir))
                if n.startswith(key + "." if key else "") and n.endswith(SEGMENT_SUFFIX)]
