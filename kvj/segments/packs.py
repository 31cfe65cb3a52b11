"""The packs of a local store: many segments per file, one fdatasync and one directory fsync for all.

``root/packs/NAME.kvjpack`` holds whole segment files (``packfile.py``); its dead list
``NAME.dead`` names members removed since. Above the backend a packed member is a segment
like any other: it is found, read, claimed, collected and quarantined by key.

- Writing: a pack is written as a temp file in ``root/tmp`` (flocked, cleaned like any temp
  file when its writer dies), fdatasynced once, renamed into ``packs/`` and the directory
  fsynced: only then is any member durable, so a torn pack is never in ``packs/``.
- Finding: the index (key -> packs holding it live) is built from the packs' tails and dead
  lists on first use and refreshed on a miss (another process may have written a pack). A
  copy found through a stale index is checked on disk before it is claimed (``touch``).
- Removing: under the store's exclusive collection lock a member is named in its pack's dead
  list (appended; made durable before removal returns). A pack with no live member left is
  unlinked; one mostly dead is repacked (its live members into a new durable pack first, then
  the old one unlinked), so dead bytes never exceed live ones for long.
- Claiming: ``touch`` sets the pack's modification time (every member's last use) while it
  holds the shared collection lock, after checking the member is not dead: a claim and a
  collection exclude each other exactly as for a loose segment file.
"""

from __future__ import annotations

import os
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from kvj.errors import SegmentCorrupt, SegmentMissing, UnsafePath
from kvj.fileio import Buffer, DurabilityError, atomic_write, discard_temp, list_dir, makedirs_durable, open_regular
from kvj.segments import packfile
from kvj.segments.packfile import Member

if TYPE_CHECKING:
    from kvj.segments.backend import LocalDirBackend

PACKS_DIR = "packs"


@dataclass
class _Pack:
    """One pack as the index knows it: its members by key and which of them are dead."""

    name: str
    path: str
    members: Dict[str, Member]
    dead: Set[str] = field(default_factory=set)

    def live(self) -> List[Member]:
        return sorted((m for k, m in self.members.items() if k not in self.dead), key=lambda m: m.offset)

    def dead_bytes(self) -> int:
        return sum(self.members[k].length for k in self.dead if k in self.members)

    def member_bytes(self) -> int:
        return sum(m.length for m in self.members.values())


def _pread(fd: int, length: int, offset: int, path: str) -> bytes:
    """Exactly ``length`` bytes at ``offset``; ``SegmentCorrupt`` when the file ends first."""
    parts, got = [], 0
    while got < length:
        try:
            part = os.pread(fd, length - got, offset + got)
        except OSError as exc:
            raise SegmentCorrupt(path, offset + got, f"read failed: {exc.strerror or exc}") from None
        if not part:
            raise SegmentCorrupt(path, offset + got, f"file ended after {offset + got} bytes, "
                                 f"{offset + length} expected")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class PackWriter:
    """One pack being written: ``add`` members (each a whole segment file's bytes), then
    ``commit`` (durable when it returns) or ``abort``."""

    def __init__(self, packs: "PackDir"):
        self.packs = packs
        self.fs = packs.fs
        self.tmp, self.fd = packs.backend.new_temp()
        self.members: List[Member] = []
        self.keys: Set[str] = set()
        self.pos = 0
        self._write([packfile.preamble()])

    def _failed(self, exc: OSError, what: str) -> DurabilityError:
        self.abort()
        return DurabilityError(exc.errno or 0, f"{what} pack temp file {self.tmp}: {exc.strerror or exc}")

    def _write(self, parts: Iterable[Buffer]) -> int:
        assert self.fd is not None
        n = 0
        try:
            for part in parts:
                self.fs.write(self.fd, part)
                n += len(part)
        except OSError as exc:
            raise self._failed(exc, "writing") from exc
        self.pos += n
        return n

    def add(self, key: str, parts: Iterable[Buffer]) -> None:
        """Append one member; a key already in this pack is not written twice."""
        if key in self.keys:
            return
        start = self.pos
        self.members.append(Member(key, start, self._write(parts)))
        self.keys.add(key)

    def commit(self) -> Optional[str]:
        """Index, trailer, one fdatasync, rename into ``packs/``, one directory fsync; the pack's
        path (None, and nothing written, without members)."""
        if not self.members:
            self.abort()
            return None
        self._write([packfile.tail(self.members, self.pos)])
        assert self.fd is not None
        try:
            self.fs.fdatasync(self.fd)
        except OSError as exc:
            raise self._failed(exc, "fsyncing") from exc
        packs = self.packs
        try:
            makedirs_durable(packs.dir, self.fs)
            while True:
                name = secrets.token_hex(8)
                if not os.path.lexists(packs.path(name)):
                    break
            self.fs.rename(self.tmp, packs.path(name))  # still flocked: no cleaner takes it from under us
            self.fs.fsync_dir(packs.dir)
        finally:
            fd, self.fd = self.fd, None
            self.fs.close(fd)
        packs.added(_Pack(name, packs.path(name), {m.key: m for m in self.members}))
        return packs.path(name)

    def abort(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            discard_temp(self.fs, fd, self.tmp)


class PackDir:
    """The ``packs/`` directory of a ``LocalDirBackend``: its index, writes, dead lists, repacks."""

    #: A pack is repacked once its dead members hold at least this share of its member bytes.
    REPACK_DEAD_SHARE = 0.5

    def __init__(self, backend: "LocalDirBackend"):
        self.backend = backend
        self.fs = backend.counted_fs
        self.dir = os.path.join(backend.root, PACKS_DIR)
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

    def _names(self) -> Set[str]:
        names = set()
        for entry in list_dir(self.dir):
            stem = entry[:-len(packfile.SUFFIX)]
            if entry.endswith(packfile.SUFFIX) and packfile.NAME_RE.fullmatch(stem):
                names.add(stem)
        return names

    def _read_dead(self, name: str) -> Set[str]:
        try:
            fd = open_regular(self.dead_path(name))
        except FileNotFoundError:
            return set()
        except UnsafePath:  # not a file kvj wrote: it names nothing
            return set()
        try:
            size = os.fstat(fd).st_size
            return packfile.parse_dead(_pread(fd, size, 0, self.dead_path(name)))
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
        """Catch up with the directory: packs written or removed since, and (``dead_lists``)
        members other processes removed."""
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

    def read(self, key: str) -> bytes:
        """A member's bytes."""
        with self.open(key) as (fd, member, path):
            return _pread(fd, member.length, member.offset, path)

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
        """Name ``keys``' packed copies in their packs' dead lists (the caller holds the
        exclusive collection lock); with ``older_than`` only copies whose pack was not used
        after it. Returns (keys with every packed copy now dead, keys with a copy kept, the
        packs whose dead lists grew); not yet durable: :meth:`finish` makes it so."""
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
                self._append_dead(name, dead)
                self._mark_dead(self._packs[name], set(dead))
        return marked - kept, kept, set(pending)

    def _append_dead(self, name: str, keys: List[str]) -> None:
        fd = self.fs.open(self.dead_path(name), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            self.fs.write(fd, packfile.dead_entries(keys))
        finally:
            self.fs.close(fd)

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
            crowded = [p for p in packs if p.live() and p.dead_bytes() >= self.REPACK_DEAD_SHARE * p.member_bytes()]
        for pack in crowded:
            self._repack(pack)
        gone = empty + crowded
        for pack in gone:
            self._unlink(pack.path)
            self.forget(pack.name)
        orphans = self._orphan_dead_lists()  # these packs' and any a crash (or another collector) left
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

    def _orphan_dead_lists(self) -> List[str]:
        """Packs whose dead list outlived them: garbage, since a dead list is only written for
        a pack that is there and a pack's name is never used again."""
        packs = self._names()
        return [entry[:-len(packfile.DEAD_SUFFIX)] for entry in list_dir(self.dir)
                if entry.endswith(packfile.DEAD_SUFFIX) and entry[:-len(packfile.DEAD_SUFFIX)] not in packs
                and packfile.NAME_RE.fullmatch(entry[:-len(packfile.DEAD_SUFFIX)])]

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
        """Copy ``key``'s packed bytes to ``dest`` durably, then name it dead in every pack
        holding it (the other members stay)."""
        atomic_write(dest, self.read(key), self.fs)
        with self.backend.collection_lock(exclusive=True):
            _dead, _kept, grew = self.mark_dead([key], None)
        self.finish(grew)
