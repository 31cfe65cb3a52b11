"""Where segment bytes live: the ``StorageBackend`` interface and the local-directory backend.

The content-addressed store above (``kvj.segments.store``) decides keys, dedup and
verification; a backend only stores and returns bytes under keys it is given, durably.
``LocalDirBackend`` keeps one file per segment, written temp file -> fsync -> rename ->
fsync directory (``man/kvj-segment.5``).
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
from typing import Iterable, Iterator, List, Optional, Set, Union

from kvj.errors import SegmentCorrupt, SegmentMissing, UnsafePath
from kvj.fileio import (FS, REAL_FS, Buffer, DurabilityError, list_dir, makedirs_durable, open_regular,
                        rename_durable)
from kvj.names import KEY_RE

SEGMENT_SUFFIX = ".kvjseg"
#: The store's collection lock (see ``LocalDirBackend._collection_lock``).
GC_LOCK = "gc.lock"
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


class StorageBackend(ABC):
    """Where segment bytes live. Keys reaching a backend are already validated."""

    @abstractmethod
    def begin(self) -> Upload:
        """Start writing a new object."""

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

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None) -> List[str]:
        """``delete`` each of ``keys``; the ones removed, all durably gone when this returns.
        A backend may make the removals durable together (one directory sync, not one each)."""
        return [key for key in keys if self.delete(key, older_than)]

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
    """A segment file read by offset (thread-safe: ``pread``); reads are errors, never SIGBUS."""

    def __init__(self, fd: int, size: int, path: str):
        self.fd, self.size, self.name = fd, size, path

    def read_into(self, offset: int, out: memoryview) -> None:
        _read_into(self.fd, out, offset, self.name)


class _LocalUpload(Upload):
    """A temp file in ``root/tmp``; big writes are fdatasynced as they go, so the disk works
    while later chunks are still being compressed, and the final fsync has little left to do."""

    SYNC_EVERY = 8 << 20

    def __init__(self, backend: "LocalDirBackend"):
        self.backend = backend
        self.fs = backend.fs
        self.size = 0
        self.unsynced = 0
        while True:
            self.tmp = os.path.join(backend.tmp_dir, f"{os.getpid()}.{secrets.token_hex(6)}.tmp")
            self.fd: Optional[int] = self.fs.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            # The lock says "a live writer owns this file" (across PID namespaces too). A
            # cleaner that locked and unlinked the file before this lock was taken has taken
            # the name away: start over with a new one.
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            if _same_file(self.tmp, self.fd):
                return
            self.fs.close(self.fd)

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
            try:
                self.fs.close(fd)
            except OSError:
                pass
            try:
                self.fs.unlink(self.tmp)
            except OSError:
                pass


class LocalDirBackend(StorageBackend):
    """One file per segment under ``root/objects/<k[:2]>/<key>.kvjseg``.

    New files are written in ``root/tmp/<pid>.<random>.tmp`` (flocked by their writer while it
    writes), fsynced, renamed into place and the target directory fsynced. Quarantined files
    move to ``root/quarantine/<key>.<unix-ns>.kvjseg``. Opening a backend writes nothing
    (read-only commands stay read-only); directories are made by the first write, which also
    removes temp files that no live writer holds.
    """

    def __init__(self, root: Union[str, os.PathLike], fs: FS = REAL_FS):
        self.root = os.path.abspath(os.fspath(root))
        self.fs = fs
        self.objects = os.path.join(self.root, "objects")
        self.tmp_dir = os.path.join(self.root, "tmp")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self._writing = False
        self._writing_lock = threading.Lock()

    def path(self, key: str) -> str:
        return os.path.join(self.objects, key[:2], key + SEGMENT_SUFFIX)

    def describe(self, key: str) -> str:
        return self.path(key)

    def begin(self) -> Upload:
        with self._writing_lock:
            if not self._writing:
                makedirs_durable(self.tmp_dir, self.fs)
                self.clean_temps()
                self._writing = True
        return _LocalUpload(self)

    def clean_temps(self) -> int:
        """Remove temp files that no writer holds; returns how many.

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
                    self.fs.unlink(path)
                    removed += 1
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        return removed

    def _missing(self, key: str) -> SegmentMissing:
        return SegmentMissing(f"segment {key} not in store ({self.path(key)})")

    @contextmanager
    def _open(self, key: str) -> Iterator[int]:
        try:
            fd = open_regular(self.path(key))
        except FileNotFoundError:
            raise self._missing(key) from None
        except UnsafePath as exc:  # a link, FIFO or device where a segment should be: a damaged segment
            raise SegmentCorrupt(self.path(key), None, str(exc)) from None
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def open(self, key: str) -> Iterator[Source]:
        """The file, read chunk by chunk by whoever decodes it (one descriptor, ``pread``)."""
        with self._open(key) as fd:
            yield _FileSource(fd, os.fstat(fd).st_size, self.path(key))

    def get(self, key: str) -> Buffer:
        """All bytes of the file, read into memory.

        Not memory-mapped: through a map, a media error or a file truncated under the reader
        is a SIGBUS that kills the process; read, either is a ``SegmentCorrupt`` naming the file.
        """
        import numpy as np

        with self._open(key) as fd:
            size = os.fstat(fd).st_size
            data = memoryview(np.empty(size, np.uint8)) if size else memoryview(b"")
            _read_into(fd, data, 0, self.path(key))
            return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self._open(key) as fd:
            try:
                return os.pread(fd, length, offset)
            except OSError as exc:
                raise SegmentCorrupt(self.path(key), offset, f"read failed: {exc.strerror or exc}") from None

    def stat(self, key: str) -> ObjectStat:
        try:
            st = os.stat(self.path(key), follow_symlinks=False)
        except FileNotFoundError:
            raise self._missing(key) from None
        return ObjectStat(st.st_size, st.st_mtime)

    def exists(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(self.path(key), follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    @contextmanager
    def _collection_lock(self, exclusive: bool) -> Iterator[None]:
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

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None) -> List[str]:
        """Unlink the keys, then fsync each directory that lost a file once.

        Unlinks run on a few threads (an unlink that frees blocks takes ~1 ms on a busy disk and
        they overlap), ``UNLINK_BATCH`` keys per hold of the collection lock, so a writer's
        dedup touch waits for at most one batch.
        """
        keys = list(keys)
        gone: List[bool] = []
        with ThreadPoolExecutor(max_workers=max(1, min(UNLINK_THREADS, len(keys)))) as pool:
            for start in range(0, len(keys), UNLINK_BATCH):
                batch = keys[start:start + UNLINK_BATCH]
                with self._collection_lock(exclusive=True):
                    gone += pool.map(lambda key: self._unlink(key, older_than), batch)
        removed = [key for key, ok in zip(keys, gone) if ok]
        for directory in sorted({os.path.dirname(self.path(key)) for key in removed}):
            self.fs.fsync_dir(directory)
        return removed

    def _unlink(self, key: str, older_than: Optional[float]) -> bool:
        """Unlink one key's file, unless it was used after ``older_than``; the caller holds the
        collection lock."""
        path = self.path(key)
        try:
            if older_than is not None and os.stat(path, follow_symlinks=False).st_mtime > older_than:
                return False
            self.fs.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def keys(self) -> Iterator[str]:
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

    def touch(self, key: str) -> bool:
        path = self.path(key)
        if not os.path.lexists(path):
            return False
        with self._collection_lock(exclusive=False):
            try:
                os.utime(path, follow_symlinks=False)
            except FileNotFoundError:
                return False
        return True

    def quarantine(self, key: str) -> str:
        makedirs_durable(self.quarantine_dir, self.fs)
        src = self.path(key)
        dst = os.path.join(self.quarantine_dir, f"{key}.{time.time_ns()}{SEGMENT_SUFFIX}")
        try:
            rename_durable(src, dst, self.fs)
        except FileNotFoundError:
            raise SegmentMissing(f"segment {key} not in store ({src})") from None
        return dst

    def quarantined_copies(self, key: Optional[str] = None) -> List[str]:
        return [os.path.join(self.quarantine_dir, n) for n in sorted(list_dir(self.quarantine_dir))
                if n.startswith(key + "." if key else "") and n.endswith(SEGMENT_SUFFIX)]
