"""The ``packs/`` directory of a local store: many segments per file, made durable by one fdatasync.

A packed member is found, read, claimed, collected and quarantined by key like a loose segment
(PACKS). A pack is renamed into ``packs/`` only once durable. The index (key -> packs holding it
live) is read from tails and dead lists, refreshed on a miss; removal appends to dead lists
under the exclusive collection lock; ``touch`` sets a pack's mtime under the shared one.
"""

from __future__ import annotations

import os
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from kvj.errors import SegmentCorrupt, SegmentMissing, UnsafePath
from kvj.fileio import FS, Buffer, atomic_write, list_dir, open_regular
from kvj.segments import packfile
from kvj.segments.packfile import Member
from kvj.segments.source import pread_into
from kvj.segments.tempfiles import TempFile


@dataclass
class _Pack:
    """One pack as the index knows it: its members by key and which of them are dead."""

    name: str
    path: str
    members: Dict[str, Member]
    dead: Set[str] = field(default_factory=set)

    def live(self) -> List[Member]:
        return sorted((m for k, m in self.members.items() if k not in self.dead), key=lambda m: m.offset)

    def crowded(self, share: float) -> bool:
        """Whether its dead members hold at least ``share`` of its member bytes (and some live)."""
        dead = sum(self.members[k].length for k in self.dead if k in self.members)
        return bool(self.live()) and dead >= share * sum(m.length for m in self.members.values())


def _pread(fd: int, length: int, offset: int, path: str) -> bytearray:
    """Exactly ``length`` bytes at ``offset``; ``SegmentCorrupt`` when the file ends first."""
    out = bytearray(length)
    pread_into(fd, memoryview(out), offset, path)
    return out


class PackWriter:
    """One pack being written: ``add`` members (whole segment files), then ``commit`` or ``abort``."""

    def __init__(self, packs: "PackDir"):
        self.packs = packs
        self.tmp = TempFile(packs.tmp_dir, packs.fs, "pack")
        self.members: List[Member] = []
        self.keys: Set[str] = set()
        self.tmp.write(packfile.preamble())

    def add(self, key: str, parts: Iterable[Buffer]) -> None:
        """Append one member; a key already in this pack is not written twice."""
        if key in self.keys:
            return
        start = self.tmp.size
        for part in parts:
            self.tmp.write(part)
        self.members.append(Member(key, start, self.tmp.size - start))
        self.keys.add(key)

    def commit(self) -> Optional[str]:
        """Index, trailer, one fdatasync, rename into ``packs/``, one directory fsync; the pack's
        path (None, and nothing written, without members)."""
        if not self.members:
            self.abort()
            return None
        self.tmp.write(packfile.tail(self.members, self.tmp.size))
        self.tmp.sync(data_only=True)
        packs = self.packs
        while True:
            name = secrets.token_hex(8)
            if not os.path.lexists(packs.path(name)):
                break
        self.tmp.publish(packs.path(name))
        packs.added(_Pack(name, packs.path(name), {m.key: m for m in self.members}))
        return packs.path(name)

    def abort(self) -> None:
        self.tmp.abort()


class PackDir:
    """The index, writes, dead lists and repacks of ``root/packs/``; ``lock`` is the collection lock."""

    #: A pack is repacked once its dead members hold at least this share of its member bytes.
    REPACK_DEAD_SHARE = 0.5

    def __init__(self, root: str, tmp_dir: str, fs: FS, lock: Callable[[bool], ContextManager[None]]):
        self.dir, self.tmp_dir, self.fs, self.lock = os.path.join(root, "packs"), tmp_dir, fs, lock
        self._lock = threading.Lock()
        self._packs: Dict[str, _Pack] = {}
        self._holders: Dict[str, List[str]] = {}  # key -> names of the packs where it is live
        self._listed = False
        #: Packs whose tail or index does not check out: path -> why (their members are unknown).
        self.damaged: Dict[str, str] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name + packfile.SUFFIX)

    def dead_path(self, name: str) -> str:
        return os.path.join(self.dir, name + packfile.DEAD_SUFFIX)

    def begin(self) -> PackWriter:
        return PackWriter(self)

    # -- the index (callers of the underscored methods hold self._lock) ----------------------

    def _names(self, suffix: str = packfile.SUFFIX) -> Set[str]:
        stems = (entry[:-len(suffix)] for entry in list_dir(self.dir) if entry.endswith(suffix))
        return {stem for stem in stems if packfile.NAME_RE.fullmatch(stem)}

    def _read_dead(self, name: str) -> Set[str]:
        try:
            fd = open_regular(self.dead_path(name))
        except (FileNotFoundError, UnsafePath):  # none, or not a file kvj wrote: it names nothing
            return set()
        try:
            return packfile.parse_dead(_pread(fd, os.fstat(fd).st_size, 0, self.dead_path(name)))
        finally:
            os.close(fd)

    def _load(self, name: str) -> Optional[_Pack]:
        """A pack from its tail and dead list; None when it is gone or damaged (noted)."""
        path = self.path(name)
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            return None
        except UnsafePath as exc:
            self.damaged[path] = str(exc)
            return None
        try:
            size = os.fstat(fd).st_size
            off, count, crc = packfile.index_location(
                _pread(fd, packfile.TRAILER.size, size - packfile.TRAILER.size, path)
                if size >= packfile.TRAILER.size else b"", size, path)
            members = packfile.parse_index(_pread(fd, packfile.PREAMBLE.size, 0, path),
                                           _pread(fd, count * packfile.ENTRY.size, off, path), off, count, crc, path)
        except SegmentCorrupt as exc:
            self.damaged[path] = exc.reason
            return None
        finally:
            os.close(fd)
        self.damaged.pop(path, None)
        return _Pack(name, path, {m.key: m for m in members}, self._read_dead(name))

    def _index(self, pack: _Pack) -> None:
        for key in pack.members:
            if key not in pack.dead:
                holders = self._holders.setdefault(key, [])
                if pack.name not in holders:
                    holders.append(pack.name)

    def _unindex(self, pack: _Pack, keys: Iterable[str]) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders and pack.name in holders:
                holders.remove(pack.name)
                if not holders:
                    del self._holders[key]

    def _forget(self, name: str) -> None:
        pack = self._packs.pop(name, None)
        if pack is not None:
            self._unindex(pack, pack.members)

    def _mark_dead(self, pack: _Pack, dead: Set[str]) -> None:
        new = dead - pack.dead
        pack.dead |= new
        self._unindex(pack, new)

    def _refresh(self, dead_lists: bool) -> None:
        """Catch up with the directory (packs written or removed since) and, with ``dead_lists``,
        with members other processes removed."""
        names = self._names()
        for name in set(self._packs) - names:
            self._forget(name)
        for path in [p for p in self.damaged if os.path.basename(p)[:-len(packfile.SUFFIX)] not in names]:
            del self.damaged[path]
        for name in names - set(self._packs):
            pack = self._load(name)
            if pack is not None:
                self._packs[name] = pack
                self._index(pack)
        if dead_lists:
            for pack in self._packs.values():
                self._mark_dead(pack, self._read_dead(pack.name))
        self._listed = True

    def _lookup(self, key: str) -> Optional[Tuple[_Pack, Member]]:
        for name in self._holders.get(key, ()):
            pack = self._packs[name]
            return pack, pack.members[key]
        return None

    def added(self, pack: _Pack) -> None:
        """Index a pack this process has just made durable."""
        with self._lock:
            if self._listed:
                self._packs[pack.name] = pack
                self._index(pack)

    def locate(self, key: str) -> Optional[Tuple[_Pack, Member]]:
        """A pack holding ``key`` live as far as the index knows (refreshed on a miss)."""
        with self._lock:
            if not self._listed:
                self._refresh(dead_lists=True)
            hit = self._lookup(key)
            if hit is None:
                self._refresh(dead_lists=False)
                hit = self._lookup(key)
            return hit

    def forget(self, name: str) -> None:
        """A pack found gone: drop it from the index."""
        with self._lock:
            self._forget(name)

    def holding(self, keys: Iterable[str]) -> Set[str]:
        """Which of ``keys`` some pack holds live (one refresh at most, for all of them)."""
        keys = list(keys)
        with self._lock:
            if not self._listed:
                self._refresh(dead_lists=True)
            if any(key not in self._holders for key in keys):
                self._refresh(dead_lists=False)
            return {key for key in keys if key in self._holders}

    def live_keys(self) -> Set[str]:
        """Every key a pack holds live, the directory and every dead list read anew."""
        with self._lock:
            self._refresh(dead_lists=True)
            return set(self._holders)

    # -- members ------------------------------------------------------------------------

    @contextmanager
    def open(self, key: str) -> Iterator[Tuple[int, Member, str]]:
        """(descriptor of its pack, the member, the pack's path); SegmentMissing when no pack
        holds ``key``. A pack removed under a stale index is looked for again."""
        for _ in range(3):
            hit = self.locate(key)
            if hit is None:
                break
            pack, member = hit
            try:
                fd = open_regular(pack.path)
            except FileNotFoundError:
                self.forget(pack.name)  # repacked or collected since the index was read
                continue
            except UnsafePath as exc:
                raise SegmentCorrupt(pack.path, None, str(exc)) from None
            try:
                yield fd, member, pack.path
            finally:
                os.close(fd)
            return
        raise SegmentMissing(f"segment {key} not in any pack")

    def touch(self, key: str) -> bool:
        """Claim ``key``'s packed copy (the caller holds the shared collection lock): True once
        a pack holding it live on disk has a new modification time."""
        for _ in range(3):
            hit = self.locate(key)
            if hit is None:
                return False
            pack, _member = hit
            dead = self._read_dead(pack.name)
            if key in dead:
                with self._lock:
                    self._mark_dead(pack, dead)
                continue
            try:
                os.utime(pack.path, follow_symlinks=False)
            except FileNotFoundError:
                self.forget(pack.name)
                continue
            return True
        return False

    # -- removal ------------------------------------------------------------------------

    def mark_dead(self, keys: Iterable[str], older_than: Optional[float]) -> Tuple[Set[str], Set[str], Set[str]]:
        """Name ``keys``' packed copies in their dead lists (the caller holds the exclusive
        collection lock); with ``older_than`` only copies whose pack was not used after it.
        (keys with every packed copy now dead, keys with a copy kept, packs whose dead lists
        grew): not durable until :meth:`finish`."""
        marked, kept = set(), set()
        pending: Dict[str, List[str]] = {}
        with self._lock:
            self._refresh(dead_lists=False)
            fresh: Set[str] = set()  # packs whose dead list was read under this lock
            for key in keys:
                for name in list(self._holders.get(key, ())):
                    pack = self._packs[name]
                    if name not in fresh:
                        fresh.add(name)
                        self._mark_dead(pack, self._read_dead(name))
                        if key in pack.dead:
                            continue
                    try:
                        used = os.stat(pack.path, follow_symlinks=False).st_mtime
                    except FileNotFoundError:
                        self._forget(name)
                        continue
                    if older_than is not None and used > older_than:
                        kept.add(key)
                    else:
                        pending.setdefault(name, []).append(key)
                        marked.add(key)
            for name, dead in pending.items():
                fd = self.fs.open(self.dead_path(name), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                try:
                    self.fs.write(fd, packfile.dead_entries(dead))
                finally:
                    self.fs.close(fd)
                self._mark_dead(self._packs[name], set(dead))
        return marked - kept, kept, set(pending)

    def finish(self, touched: Set[str]) -> None:
        """Make the dead lists appended to durable, then unlink the packs left with no live
        member and repack the mostly dead ones (new pack durable first)."""
        if not touched:
            return
        for name in sorted(touched):
            fd = self.fs.open(self.dead_path(name), os.O_WRONLY)
            try:
                self.fs.fdatasync(fd)
            finally:
                self.fs.close(fd)
        self.fs.fsync_dir(self.dir)  # a dead list created now
        with self._lock:
            packs = [self._packs[n] for n in sorted(touched) if n in self._packs]
            empty = [p for p in packs if not p.live()]
            crowded = [p for p in packs if p.crowded(self.REPACK_DEAD_SHARE)]
        for pack in crowded:
            self._repack(pack)
        gone = empty + crowded
        for pack in gone:
            self._unlink(pack.path)
            self.forget(pack.name)
        # Dead lists that outlived their pack (these, or a crash's): a pack's name is never reused.
        orphans = sorted(self._names(packfile.DEAD_SUFFIX) - self._names())
        if gone or orphans:
            # Every pack unlink seen above is made durable before a dead list goes: a crash
            # that kept a pack but lost its dead list would bring its removed members back.
            self.fs.fsync_dir(self.dir)
        for name in orphans:
            self._unlink(self.dead_path(name))
        if orphans:
            self.fs.fsync_dir(self.dir)

    def _unlink(self, path: str) -> None:
        try:
            self.fs.unlink(path)
        except FileNotFoundError:
            pass

    def _repack(self, pack: _Pack) -> None:
        """Copy ``pack``'s live members into a new pack, durable before the old one goes."""
        writer = self.begin()
        try:
            fd = open_regular(pack.path)
        except FileNotFoundError:
            writer.abort()
            return
        try:
            for member in pack.live():
                writer.add(member.key, [_pread(fd, member.length, member.offset, pack.path)])
        except BaseException:
            writer.abort()
            raise
        finally:
            os.close(fd)
        writer.commit()

    def quarantine(self, key: str, dest: str) -> None:
        """Copy ``key``'s packed bytes to ``dest`` durably, then name it dead in every pack holding it."""
        with self.open(key) as (fd, member, path):
            data = _pread(fd, member.length, member.offset, path)
        atomic_write(dest, data, self.fs)
        with self.lock(True):
            _dead, _kept, grew = self.mark_dead([key], None)
        self.finish(grew)
