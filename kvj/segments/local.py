"""The directory a segment store keeps its bytes in: loose segment files, packs, and their collection.

The store decides keys, dedup and checks; this keeps bytes under the keys it is given, durably
(``man/kvj-segment.5``, STORE LAYOUT, CLAIMS, PACKS).
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

from kvj.errors import SegmentCorrupt, SegmentMissing, UnsafePath
from kvj.fileio import (FS, REAL_FS, Buffer, CountedFS, list_dir, makedirs_durable, open_regular,
                        rename_durable)
from kvj.names import KEY_RE
from kvj.segments.claims import Claims, claimed
from kvj.segments.packs import PackDir, PackWriter
from kvj.segments.source import FileSource, Source, pread_into
from kvj.segments.tempfiles import TempFile, clean_temps
from kvj.segments.uses import UseLog

SEGMENT_SUFFIX = ".kvjseg"
#: The store's collection lock (see ``LocalDirBackend.collection_lock``).
GC_LOCK = "gc.lock"
#: Told, under the collection lock, the keys about to be removed; returns those to keep.
Keep = Callable[[List[str]], Set[str]]
#: Collection unlinks this many files per hold of the collection lock, on this many threads.
UNLINK_BATCH = 64
UNLINK_THREADS = 8
#: A loose segment's writes are fdatasynced every this many bytes (overlapping compression).
SYNC_EVERY = 8 << 20


@dataclass(frozen=True)
class ObjectStat:
    """A stored segment's size and last use: Unix time it was stored or last claimed (collection's grace)."""

    size: int
    used: float


class LocalDirBackend:
    """Segment files at ``root/objects/<k[:2]>/<key>.kvjseg`` and packs in ``root/packs/``: a key
    resolves to its loose file first, then to a pack. Opening one writes nothing."""

    def __init__(self, root: Union[str, os.PathLike], fs: FS = REAL_FS):
        self.root = os.path.abspath(os.fspath(root))
        self.fs = fs
        #: Every operation of this backend goes through it (counted: ``io_counts``).
        self.counted_fs = CountedFS(fs)
        self.objects = os.path.join(self.root, "objects")
        self.tmp_dir = os.path.join(self.root, "tmp")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.packs = PackDir(self.root, self.tmp_dir, self.counted_fs, self.collection_lock)
        #: Not counted in ``io_counts``: those are the segments' own disk work.
        self.uses = UseLog(self.root, fs, self.collection_lock)
        self.claims = Claims(self.root)
        self._writing = False
        self._writing_lock = threading.Lock()

    def path(self, key: str) -> str:
        """Where ``key``'s loose file is (or would be)."""
        return os.path.join(self.objects, key[:2], key + SEGMENT_SUFFIX)

    def describe(self, key: str) -> str:
        """Where ``key``'s bytes are, for messages: its file, or its pack and offset."""
        if not os.path.lexists(self.path(key)):
            hit = self.packs.locate(key)
            if hit is not None:
                return f"{hit[0].path}@{hit[1].offset}"
        return self.path(key)

    def io_counts(self) -> Dict[str, int]:
        return dict(self.counted_fs.counts)

    def start_writing(self) -> None:
        """Before the first write: make ``tmp/`` (and the root) and clean abandoned temp files."""
        with self._writing_lock:
            if not self._writing:
                makedirs_durable(self.tmp_dir, self.counted_fs)
                clean_temps(self.tmp_dir, self.counted_fs)
                self._writing = True

    def begin(self) -> TempFile:
        """A temp file for one segment, to :meth:`commit` under its key (decided at the end)."""
        self.start_writing()
        return TempFile(self.tmp_dir, self.counted_fs, "segment", SYNC_EVERY)

    def commit(self, tmp: TempFile, key: str) -> None:
        """fsync ``tmp``, rename it to ``key``'s object path and fsync that directory."""
        tmp.sync(data_only=False)
        tmp.publish(self.path(key))

    def begin_many(self) -> PackWriter:
        """One pack for several segments made durable together."""
        self.start_writing()
        return self.packs.begin()

    def _missing(self, key: str) -> SegmentMissing:
        damaged = self.packs.damaged
        note = f"; {len(damaged)} damaged pack(s) whose members cannot be listed: " + \
            ", ".join(f"{p} ({why})" for p, why in sorted(damaged.items())) if damaged else ""
        return SegmentMissing(f"segment {key} not in store ({self.path(key)}){note}")

    @contextmanager
    def _open(self, key: str) -> Iterator[Tuple[int, int, int, str]]:
        """(descriptor, offset, length, name) of ``key``'s bytes: its loose file, else its pack."""
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
        """``key``'s bytes, read chunk by chunk by whoever decodes them; SegmentMissing when absent."""
        with self._open(key) as (fd, base, size, name):
            yield FileSource(fd, size, name, base)

    def get(self, key: str) -> Buffer:
        """All of ``key``'s bytes, read into memory; SegmentMissing when absent."""
        import numpy as np

        with self._open(key) as (fd, base, size, name):
            data = memoryview(np.empty(size, np.uint8)) if size else memoryview(b"")
            pread_into(fd, data, base, name)
            return data

    def stat(self, key: str) -> ObjectStat:
        """Size and last use of ``key``; SegmentMissing when absent."""
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
        """Which of ``keys`` are stored."""
        keys = set(keys)
        loose = {key for key in keys if self._is_loose(key)}
        return loose | self.packs.holding(keys - loose)

    def keys(self) -> Iterator[str]:
        """Every key once: the loose ones in order, then those only in packs, in order."""
        loose = set()
        try:
            fans = sorted(os.listdir(self.objects))
        except FileNotFoundError:
            fans = []
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
                    loose.add(key)
                    yield key
        yield from sorted(self.packs.live_keys() - loose)

    @contextmanager
    def collection_lock(self, exclusive: bool) -> Iterator[None]:
        """``flock`` on ``root/gc.lock``: shared for a dedup hit's touch, exclusive for a collector's
        age check and unlink, so neither falls between the other's steps (each use opens its own
        descriptor: threads and stores of one process exclude each other as processes do)."""
        fd = open_regular(os.path.join(self.root, GC_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def touch(self, key: str) -> bool:
        """Claim ``key`` against collection: mark it used now (under the shared collection lock);
        False when it is gone."""
        path = self.path(key)
        with self.collection_lock(exclusive=False):
            if os.path.lexists(path):
                try:
                    os.utime(path, follow_symlinks=False)
                    return True
                except FileNotFoundError:
                    pass
            return self.packs.touch(key)

    def delete_many(self, keys: Iterable[str], older_than: Optional[float] = None,
                    keep: Optional[Keep] = None) -> List[str]:
        """Remove every copy of the keys, durably (each directory and dead list synced once); those gone.

        Under the exclusive collection lock a key some writer claims is kept, then every key
        ``keep`` names (CLAIMS), and with ``older_than`` every copy used since. Unlinks overlap on
        a few threads, ``UNLINK_BATCH`` keys per hold of the lock (a dedup touch waits one batch at most).
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
        """Unlink one key's loose file unless used after ``older_than`` (the caller holds the
        collection lock): "removed", "kept" or "absent"."""
        path = self.path(key)
        try:
            if older_than is not None and os.stat(path, follow_symlinks=False).st_mtime > older_than:
                return "kept"
            self.counted_fs.unlink(path)
        except FileNotFoundError:
            return "absent"
        return "removed"

    def quarantine(self, key: str) -> str:
        """Move ``key`` aside so that it no longer resolves (a packed copy: copied out, named dead); where it went."""
        makedirs_durable(self.quarantine_dir, self.counted_fs)
        src = self.path(key)
        dst = os.path.join(self.quarantine_dir, f"{key}.{time.time_ns()}{SEGMENT_SUFFIX}")
        try:
            rename_durable(src, dst, self.counted_fs)
            return dst
        except FileNotFoundError:
            pass
        try:
            self.packs.quarantine(key, dst)
        except SegmentMissing:
            raise SegmentMissing(f"segment {key} not in store ({src})") from None
        return dst

    def quarantined_copies(self, key: Optional[str] = None) -> List[str]:
        """Where copies of ``key`` (of every key, for None) were quarantined, oldest first."""
        return [os.path.join(self.quarantine_dir, n) for n in sorted(list_dir(self.quarantine_dir))
                if n.startswith(key + "." if key else "") and n.endswith(SEGMENT_SUFFIX)]
