"""Simulated power loss and I/O errors for kvj's file operations.

kvj routes every write, fsync, fdatasync, rename, create, unlink, mkdir, directory
fsync and ftruncate through an ``FS`` object (``kvj.fileio``). This module provides
three of them for tests:

``RecordingFS``
    Passes every operation through to a real directory (so the engine sees a normal
    file system) and logs it, together with an inode-level model of what is durable.
    ``crash_state`` then builds, for any prefix of the log, the on-disk states a power
    loss at that point may leave, following the persistence model that ALICE,
    CrashMonkey, LazyFS and SQLite's crash VFS use:

    * data written since the file's last fsync/fdatasync may be lost (all of it, or
      any subset of the writes: the disk reorders them);
    * a write may be torn at a 512- or 4096-byte boundary, the rest of it reading as
      zeros, as garbage, or as the old content;
    * a file grown by unsynced writes may keep its new size with zeros in place of
      data (metadata persisted, data not);
    * a create, rename, unlink or mkdir is durable only once its directory is
      fsynced: until then it may vanish (or the rename revert, the unlink undo).

``FaultFS``
    Wraps another FS and injects ``ENOSPC``/``EIO`` (or any errno) on chosen
    operations, transient or persistent, after a countdown, like SQLite's
    ``SQLITE_IOERR`` test hooks. It logs every call so tests can prove, for example,
    that fsync was never retried on a descriptor whose fsync failed.

``FastFS``
    Real operations with fsyncs skipped: for checking crash states quickly, where
    durability of the check's own writes does not matter.

A crash state is materialised as real files in a fresh directory, so the engine's
reader, replay, ``Journal.open`` and fsck run on it unchanged.
"""

from __future__ import annotations

import errno as errno_mod
import hashlib
import os
import random
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

from kvj.fileio import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, FS

PathLike = Union[str, "os.PathLike[str]"]

#: Data-op fates for one sector-aligned chunk of an unsynced write at a crash.
KEEP, DROP, ZERO, GARBAGE = "keep", "drop", "zero", "garbage"


class SimulatedKill(OSError):
    """Raised by every operation of a ``RecordingFS`` after ``kill()``: the process is gone.

    An ``OSError`` on purpose: the engine treats it like any failed I/O (the writer and
    the segment store enter their failed states), and nothing more reaches the disk.
    """

    def __init__(self, message: str):
        super().__init__(errno_mod.EIO, message)


@dataclass
class Op:
    """One logged file-system operation (or a test's note between operations)."""

    index: int
    kind: str  # create, write, trunc, sync, rename, unlink, mkdir, fsync_dir, note
    path: Optional[str] = None  # absolute
    inode: Optional[int] = None
    offset: int = 0  # write offset, or new length for trunc
    data: bytes = b""
    dst: Optional[str] = None  # rename target
    note: Any = None  # for kind == "note"

    def describe(self) -> str:
        """A one-line description for failure messages."""
        if self.kind == "write":
            return f"#{self.index} write {self.path} [{self.offset}, {self.offset + len(self.data)})"
        if self.kind == "rename":
            return f"#{self.index} rename {self.path} -> {self.dst}"
        if self.kind == "note":
            return f"#{self.index} note {self.note!r}"
        extra = f" len={self.offset}" if self.kind == "trunc" else ""
        return f"#{self.index} {self.kind} {self.path}{extra}"


@dataclass
class _Handle:
    inode: int
    path: str
    append: bool


class RecordingFS(FS):
    """An FS that passes operations through to ``root`` and logs them for crash states.

    Everything kvj does under ``root`` must go through this object (files that exist
    when it is created are taken as durable). ``real_sync=False`` (the default) skips
    the real fsync syscalls: the model, not the disk, decides what is durable, and the
    tests run much faster.
    """

    def __init__(self, root: PathLike, *, real_sync: bool = False):
        self.root = os.path.abspath(os.fspath(root))
        self.real_sync = real_sync
        self.ops: List[Op] = []
        self._lock = threading.RLock()
        self._fds: Dict[int, _Handle] = {}
        self._next_inode = 1
        self.killed = False
        self.kill_at: Optional[int] = None  # kill() automatically once the log has this many ops
        self.adopted: List[str] = []  # paths the engine touched that were created behind our back
        # the starting state, all durable
        self.base_files: Dict[str, int] = {}
        self.base_data: Dict[int, bytes] = {}
        self.base_dirs: Set[str] = {self.root}
        self._ns: Dict[str, int] = {}  # volatile namespace: path -> inode
        self._dirs: Set[str] = {self.root}
        os.makedirs(self.root, exist_ok=True)
        for dirpath, dirnames, filenames in os.walk(self.root):
            for d in dirnames:
                self.base_dirs.add(os.path.join(dirpath, d))
            for name in filenames:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    data = f.read()
                ino = self._new_inode()
                self.base_files[path] = ino
                self.base_data[ino] = data
        self._ns = dict(self.base_files)
        self._dirs = set(self.base_dirs)

    # -- bookkeeping ------------------------------------------------------------------------

    def _new_inode(self) -> int:
        ino = self._next_inode
        self._next_inode += 1
        return ino

    def _log(self, kind: str, **kw: Any) -> Op:
        op = Op(len(self.ops), kind, **kw)
        self.ops.append(op)
        return op

    def _path(self, path: PathLike) -> str:
        p = os.path.abspath(os.fspath(path))
        if p != self.root and not p.startswith(self.root + os.sep):
            raise AssertionError(f"kvj touched {p}, outside the recorded root {self.root}")
        return p

    def _alive(self) -> None:
        if self.kill_at is not None and len(self.ops) >= self.kill_at:
            self.killed = True
        if self.killed:
            raise SimulatedKill("simulated process kill: no further I/O reaches the disk")

    def note(self, value: Any) -> None:
        """Log a test event (e.g. an acknowledged LSN) in order with the I/O operations."""
        with self._lock:
            self._log("note", note=value)

    def kill(self) -> None:
        """Simulate SIGKILL: from now on every operation fails without touching the disk.

        What was written stays in the 'page cache' (the real files) but unsynced; call
        ``revive`` before a new writer (the next 'process') uses this FS.
        """
        with self._lock:
            self.killed = True

    def revive(self) -> None:
        with self._lock:
            self.killed = False
            self.kill_at = None
            for fd in list(self._fds):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()

    @property
    def crash_points(self) -> List[int]:
        """Op counts k at which a crash may be simulated: after each I/O op (and at 0)."""
        return [0] + [op.index + 1 for op in self.ops if op.kind != "note"]

    def notes(self, upto: Optional[int] = None) -> List[Any]:
        """The notes logged among the first ``upto`` ops."""
        ops = self.ops if upto is None else self.ops[:upto]
        return [op.note for op in ops if op.kind == "note"]

    # -- the FS interface -------------------------------------------------------------------

    def open(self, path: PathLike, flags: int, mode: int = DEFAULT_FILE_MODE) -> int:
        with self._lock:
            self._alive()
            p = self._path(path)
            existed = p in self._ns
            if not existed and os.path.exists(p) and not (flags & os.O_CREAT and flags & os.O_EXCL):
                # created by plain os/open calls, not through the FS: take it as durable
                self.adopted.append(p)
                ino = self._new_inode()
                with open(p, "rb") as f:
                    self.base_data[ino] = f.read()
                self.base_files[p] = ino
                self._ns[p] = ino
                existed = True
            fd = super().open(p, flags, mode)
            if existed:
                ino = self._ns[p]
            else:
                ino = self._new_inode()
                self._ns[p] = ino
                self._log("create", path=p, inode=ino)
            if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY:
                self._log("trunc", path=p, inode=ino, offset=0)
            self._fds[fd] = _Handle(ino, p, bool(flags & os.O_APPEND))
            return fd

    def write(self, fd: int, data: Union[bytes, bytearray, memoryview]) -> None:
        with self._lock:
            self._alive()
            h = self._fds[fd]
            offset = os.fstat(fd).st_size if h.append else os.lseek(fd, 0, os.SEEK_CUR)
            blob = bytes(memoryview(data).cast("B"))
            super().write(fd, blob)
            self._log("write", path=h.path, inode=h.inode, offset=offset, data=blob)

    def fsync(self, fd: int) -> None:
        with self._lock:
            self._alive()
            h = self._fds[fd]
            if self.real_sync:
                super().fsync(fd)
            self._log("sync", path=h.path, inode=h.inode)

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            self._alive()
            h = self._fds[fd]
            if self.real_sync:
                super().fdatasync(fd)
            self._log("sync", path=h.path, inode=h.inode)

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._alive()
            h = self._fds[fd]
            super().ftruncate(fd, length)
            self._log("trunc", path=h.path, inode=h.inode, offset=length)

    def close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            super().close(fd)  # a killed process's descriptors are closed by the kernel too

    def rename(self, src: PathLike, dst: PathLike) -> None:
        with self._lock:
            self._alive()
            s, d = self._path(src), self._path(dst)
            if s in self._dirs:
                raise NotImplementedError("RecordingFS models file renames only")
            super().rename(s, d)
            ino = self._ns.pop(s)
            self._ns[d] = ino
            self._log("rename", path=s, dst=d, inode=ino)

    def unlink(self, path: PathLike) -> None:
        with self._lock:
            self._alive()
            p = self._path(path)
            super().unlink(p)
            ino = self._ns.pop(p, None)
            self._log("unlink", path=p, inode=ino)

    def mkdir(self, path: PathLike, mode: int = DEFAULT_DIR_MODE) -> None:
        with self._lock:
            self._alive()
            p = self._path(path)
            super().mkdir(p, mode)
            self._dirs.add(p)
            self._log("mkdir", path=p)

    def fsync_dir(self, path: PathLike) -> None:
        with self._lock:
            self._alive()
            p = self._path(path)
            if self.real_sync:
                super().fsync_dir(p)
            self._log("fsync_dir", path=p)


# ---------------------------------------------------------------------------------------
# crash states


@dataclass
class CrashPlan:
    """How a crash state treats what was not yet durable at the crash point.

    ``meta``: which unsynced namespace operations (create/rename/unlink/mkdir) survive:
    ``"none"``, ``"all"``, ``"prefix"`` (a prefix in issue order: journaled file systems
    such as ext4 and XFS commit metadata in order) or ``"subset"`` (each independently:
    the worst case, as ALICE allows for file systems that reorder directory operations).
    ``data``: which unsynced
    writes survive: ``"none"``, ``"all"``, ``"subset"`` (whole writes, independently),
    ``"zeros"`` (sizes grow, contents are zeros), ``"torn"`` (all but the last unsynced
    write survive; that one is cut at a ``sector`` boundary and the rest of it becomes
    ``tear_fill``), or ``"sectors"`` (every sector of every unsynced write independently
    kept, dropped, zeroed or garbage).
    """

    name: str
    meta: str = "none"
    data: str = "none"
    sector: int = 4096
    tear_fill: str = ZERO  # for data == "torn": DROP, ZERO or GARBAGE
    seed: int = 0


#: Plans every crash point is checked with (deterministic; duplicates are skipped).
FIXED_PLANS: Tuple[CrashPlan, ...] = (
    CrashPlan("synced-only", meta="none", data="none"),
    CrashPlan("volatile-kept", meta="all", data="all"),  # a process crash, no power loss
    CrashPlan("meta-kept-data-lost", meta="all", data="none"),
    CrashPlan("sizes-grown-zeros", meta="all", data="zeros"),
)


def random_plans(rng: random.Random, count: int, meta_modes: Sequence[str] = ("subset", "prefix")) -> List[CrashPlan]:
    """``count`` randomized plans: reordering, tearing at 512/4096 bytes, sector garbage.
    ``meta_modes``: how unsynced namespace operations may survive (see ``CrashPlan``)."""
    plans = []
    for i in range(count):
        seed = rng.getrandbits(32)
        kind = i % 4
        meta = rng.choice(list(meta_modes))
        if kind == 0:
            plans.append(CrashPlan(f"reorder-{meta}", meta=meta, data="subset", seed=seed))
        elif kind in (1, 2):
            sector = rng.choice((512, 4096))
            fill = rng.choice((DROP, ZERO, GARBAGE))
            plans.append(CrashPlan(f"torn{sector}-{fill}-{meta}", meta=rng.choice(("all", meta)), data="torn",
                                   sector=sector, tear_fill=fill, seed=seed))
        else:
            sector = rng.choice((512, 4096))
            plans.append(CrashPlan(f"sectors{sector}-{meta}", meta=meta, data="sectors", sector=sector, seed=seed))
    return plans


@dataclass
class _ModelState:
    """The durable/volatile model after replaying a prefix of the op log."""

    durable_data: Dict[int, bytes]
    pending: Dict[int, List[Op]]  # unsynced data ops per inode, in order
    meta: List[Tuple[Op, bool]]  # namespace ops in order, with 'durable'


def _model(fs: RecordingFS, upto: int) -> _ModelState:
    durable = dict(fs.base_data)
    pending: Dict[int, List[Op]] = {}
    meta: List[List[Any]] = []
    for op in fs.ops[:upto]:
        if op.kind in ("write", "trunc"):
            pending.setdefault(op.inode, []).append(op)
        elif op.kind == "sync":
            if op.inode in pending:
                durable[op.inode] = _apply_data(durable.get(op.inode, b""), pending.pop(op.inode), None)
        elif op.kind in ("create", "rename", "unlink", "mkdir"):
            meta.append([op, False])
        elif op.kind == "fsync_dir":
            for entry in meta:
                if not entry[1] and op.path in _meta_dirs(entry[0]):
                    entry[1] = True
    return _ModelState(durable, pending, [(m[0], m[1]) for m in meta])


def _meta_dirs(op: Op) -> Set[str]:
    """Directories whose fsync makes ``op`` durable (a rename: its target's directory)."""
    if op.kind == "rename":
        return {os.path.dirname(op.dst)}
    return {os.path.dirname(op.path)}


def _apply_data(base: bytes, ops: Sequence[Op], fates: Optional[Callable[[Op], List[Tuple[int, int, str]]]],
                garbage_seed: str = "") -> bytes:
    """Apply data ops to ``base``; ``fates(op)`` splits a write into (start, end, fate) pieces."""
    buf = bytearray(base)
    for op in ops:
        if op.kind == "trunc":
            if fates is None or fates(op):
                del buf[op.offset:]
                if len(buf) < op.offset:
                    buf.extend(bytes(op.offset - len(buf)))
            continue
        pieces = [(op.offset, op.offset + len(op.data), KEEP)] if fates is None else fates(op)
        for start, end, fate in pieces:
            if fate == DROP or end <= start:
                continue
            if len(buf) < start:
                buf.extend(bytes(start - len(buf)))
            if fate == KEEP:
                chunk = op.data[start - op.offset:end - op.offset]
            elif fate == ZERO:
                chunk = bytes(end - start)
            else:  # garbage: a function of the plan, op and offset (not of the order files are built in)
                chunk = random.Random(f"{garbage_seed}:{op.index}:{start}").randbytes(end - start)
            buf[start:end] = chunk
    return bytes(buf)


def _chunks(op: Op, sector: int) -> List[Tuple[int, int]]:
    """Split a write into pieces at absolute file offsets that are multiples of ``sector``."""
    start, end = op.offset, op.offset + len(op.data)
    cuts = [start]
    nxt = (start // sector + 1) * sector
    while nxt < end:
        cuts.append(nxt)
        nxt += sector
    cuts.append(end)
    return [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]


def _data_fates(plan: CrashPlan, pending_ops: List[Op], rng: random.Random) -> Callable[[Op], Any]:
    """The per-op fate function for ``plan`` (``pending_ops``: every unsynced data op, in order)."""
    if plan.data == "none":
        return lambda op: [] if op.kind == "write" else False
    if plan.data == "all":
        return lambda op: [(op.offset, op.offset + len(op.data), KEEP)] if op.kind == "write" else True
    if plan.data == "zeros":
        return lambda op: [(op.offset, op.offset + len(op.data), ZERO)] if op.kind == "write" else True
    if plan.data == "subset":
        keep = {op.index for op in pending_ops if rng.random() < 0.5}
        return lambda op: ([(op.offset, op.offset + len(op.data), KEEP if op.index in keep else DROP)]
                           if op.kind == "write" else op.index in keep)
    writes = [op for op in pending_ops if op.kind == "write"]
    if plan.data == "torn":
        last = writes[-1].index if writes else -1
        cut: Dict[int, int] = {}
        for op in writes:
            if op.index == last:
                pieces = _chunks(op, plan.sector)
                cut[op.index] = rng.randrange(len(pieces))  # pieces before it survive

        def torn(op: Op) -> Any:
            if op.kind != "write":
                return True
            if op.index != last:
                return [(op.offset, op.offset + len(op.data), KEEP)]
            pieces = _chunks(op, plan.sector)
            j = cut[op.index]
            return [(a, b, KEEP if i < j else plan.tear_fill) for i, (a, b) in enumerate(pieces)]
        return torn
    if plan.data == "sectors":
        table = {op.index: [(a, b, rng.choice((KEEP, KEEP, DROP, ZERO, GARBAGE))) for a, b in _chunks(op, plan.sector)]
                 for op in writes}
        truncs = {op.index for op in pending_ops if op.kind == "trunc" and rng.random() < 0.5}
        return lambda op: table[op.index] if op.kind == "write" else op.index in truncs
    raise ValueError(f"unknown data plan {plan.data!r}")


def crash_state(fs: RecordingFS, upto: int, plan: CrashPlan, dest: PathLike) -> str:
    """Materialise in ``dest`` (created; must not exist) the disk after a crash following
    the first ``upto`` logged ops, per ``plan``. Returns a digest of the state's content
    so callers can skip states they already checked.
    """
    dest = os.fspath(dest)
    rng = random.Random(f"{plan.seed}:{upto}:{plan.name}")
    model = _model(fs, upto)
    # namespace: durable ops always, unsynced ones per plan
    files = dict(fs.base_files)
    dirs = set(fs.base_dirs)
    n_pending = sum(1 for _op, durable in model.meta if not durable)
    prefix = rng.randrange(n_pending + 1) if plan.meta == "prefix" else n_pending
    seen_pending = 0
    for op, durable in model.meta:
        if not durable:
            seen_pending += 1
            if plan.meta == "none" or (plan.meta == "subset" and rng.random() < 0.5) or seen_pending > prefix:
                continue
        if op.kind == "create":
            files[op.path] = op.inode
        elif op.kind == "unlink":
            if files.get(op.path) == op.inode:
                del files[op.path]
        elif op.kind == "rename":
            if files.get(op.path) == op.inode:
                del files[op.path]
            files[op.dst] = op.inode
        elif op.kind == "mkdir":
            dirs.add(op.path)
    # file contents: durable data plus unsynced ops per plan
    pending_all = sorted((op for ops in model.pending.values() for op in ops), key=lambda o: o.index)
    fates = _data_fates(plan, pending_all, rng)
    digest = hashlib.blake2b(digest_size=16)

    def reachable(path: str) -> bool:
        parent = os.path.dirname(path)
        while parent != fs.root:
            if parent not in dirs:
                return False
            parent = os.path.dirname(parent)
        return True

    os.makedirs(dest)
    for d in sorted(dirs):
        if d != fs.root and reachable(d) and d in dirs:
            rel = os.path.relpath(d, fs.root)
            os.makedirs(os.path.join(dest, rel), mode=0o700, exist_ok=True)
            digest.update(b"D" + rel.encode() + b"\0")
    for path in sorted(files):
        if not reachable(path):
            continue
        ino = files[path]
        data = _apply_data(model.durable_data.get(ino, b""), model.pending.get(ino, []), fates,
                           f"{plan.seed}:{upto}:{plan.name}")
        rel = os.path.relpath(path, fs.root)
        with open(os.path.join(dest, rel), "wb") as f:
            f.write(data)
        os.chmod(os.path.join(dest, rel), 0o600)
        digest.update(b"F" + rel.encode() + b"\0" + hashlib.blake2b(data, digest_size=16).digest())
    return digest.hexdigest()


def iter_crash_states(fs: RecordingFS, points: Iterable[int], plans_for: Callable[[int], Sequence[CrashPlan]],
                      scratch: PathLike) -> Iterator[Tuple[int, CrashPlan, str]]:
    """Yield (crash point, plan, directory) for every distinct crash state; the directory is
    removed when the caller asks for the next one. A state is yielded once per set of notes
    before it: the same disk after more acknowledgements is checked again, against them (a
    pack whose dead list alone was unlinked reads as it did before its first removal)."""
    seen: Set[Tuple[str, int]] = set()
    notes_before = [0]
    for op in fs.ops:
        notes_before.append(notes_before[-1] + (op.kind == "note"))
    n = 0
    for k in points:
        for plan in plans_for(k):
            dest = os.path.join(os.fspath(scratch), f"state-{n}")
            n += 1
            digest = crash_state(fs, k, plan, dest)
            try:
                if (digest, notes_before[k]) in seen:
                    continue
                seen.add((digest, notes_before[k]))
                yield k, plan, dest
            finally:
                shutil.rmtree(dest, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# fault injection


@dataclass
class Fault:
    """One injected failure, SQLite style.

    ``op`` names the operation: write, fsync, fdatasync, sync (either of the two),
    fsync_dir, open, rename, unlink, mkdir or ftruncate. The first ``after`` matching
    calls succeed; then the fault fires once (transient) or on every later matching call
    (``persistent``). ``path_contains`` narrows it to matching paths. For writes,
    ``partial`` bytes are written before the error, like a short write into a full disk.
    """

    op: str
    err: int = errno_mod.EIO
    after: int = 0
    persistent: bool = False
    path_contains: Optional[str] = None
    partial: int = 0
    gate: Optional[threading.Event] = None  # when set, the failing call waits for it first
    seen: int = 0
    fired: int = 0
    entered: threading.Event = field(default_factory=threading.Event)  # set when it first fires

    def matches(self, op: str, path: Optional[str]) -> bool:
        if self.op != op and not (self.op == "sync" and op in ("fsync", "fdatasync")):
            return False
        return self.path_contains is None or (path is not None and self.path_contains in path)

    def should_fire(self) -> bool:
        self.seen += 1
        if self.seen <= self.after:
            return False
        if self.fired and not self.persistent:
            return False
        self.fired += 1
        return True


@dataclass
class Call:
    """One call a ``FaultFS`` saw, and whether it failed (with which errno)."""

    op: str
    path: Optional[str]
    fd: Optional[int]
    failed: Optional[int] = None
    thread: str = field(default_factory=lambda: threading.current_thread().name)


class FaultFS(FS):
    """Injects errors into an inner FS (``REAL_FS`` semantics, or a ``RecordingFS``)."""

    def __init__(self, faults: Sequence[Fault] = (), inner: Optional[FS] = None):
        self.inner: FS = inner if inner is not None else FS()
        self.faults = list(faults)
        self.calls: List[Call] = []
        self._paths: Dict[int, str] = {}
        self._lock = threading.Lock()

    def _check(self, op: str, path: Optional[str], fd: Optional[int] = None) -> Tuple[Call, Optional[Fault]]:
        with self._lock:
            call = Call(op, path, fd)
            self.calls.append(call)
            for fault in self.faults:
                if fault.matches(op, path) and fault.should_fire():
                    call.failed = fault.err
                    return call, fault
            return call, None

    def _raise(self, fault: Fault, op: str, path: Optional[str]) -> None:
        fault.entered.set()
        if fault.gate is not None:
            fault.gate.wait(30)
        raise OSError(fault.err, f"injected {errno_mod.errorcode.get(fault.err, fault.err)} on {op}", path)

    @property
    def fired(self) -> int:
        return sum(f.fired for f in self.faults)

    def calls_after_first_failure(self, ops: Iterable[str] = ("fsync", "fdatasync")) -> List[Call]:
        """Calls of the given kinds made after the first injected failure."""
        wanted = set(ops)
        first = next((i for i, c in enumerate(self.calls) if c.failed is not None), None)
        if first is None:
            return []
        return [c for c in self.calls[first + 1:] if c.op in wanted]

    def open(self, path: PathLike, flags: int, mode: int = DEFAULT_FILE_MODE) -> int:
        p = os.fspath(path)
        _call, fault = self._check("open", p)
        if fault:
            self._raise(fault, "open", p)
        fd = self.inner.open(p, flags, mode)
        self._paths[fd] = p
        _call.fd = fd
        return fd

    def write(self, fd: int, data: Union[bytes, bytearray, memoryview]) -> None:
        p = self._paths.get(fd)
        _call, fault = self._check("write", p, fd)
        if fault:
            if fault.partial:
                self.inner.write(fd, bytes(memoryview(data).cast("B")[:fault.partial]))
            self._raise(fault, "write", p)
        self.inner.write(fd, data)

    def fsync(self, fd: int) -> None:
        p = self._paths.get(fd)
        _call, fault = self._check("fsync", p, fd)
        if fault:
            self._raise(fault, "fsync", p)
        self.inner.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        p = self._paths.get(fd)
        _call, fault = self._check("fdatasync", p, fd)
        if fault:
            self._raise(fault, "fdatasync", p)
        self.inner.fdatasync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        p = self._paths.get(fd)
        _call, fault = self._check("ftruncate", p, fd)
        if fault:
            self._raise(fault, "ftruncate", p)
        self.inner.ftruncate(fd, length)

    def close(self, fd: int) -> None:
        with self._lock:
            self.calls.append(Call("close", self._paths.pop(fd, None), fd))
        self.inner.close(fd)

    def rename(self, src: PathLike, dst: PathLike) -> None:
        _call, fault = self._check("rename", os.fspath(dst))
        if fault:
            self._raise(fault, "rename", os.fspath(dst))
        self.inner.rename(src, dst)

    def unlink(self, path: PathLike) -> None:
        _call, fault = self._check("unlink", os.fspath(path))
        if fault:
            self._raise(fault, "unlink", os.fspath(path))
        self.inner.unlink(path)

    def mkdir(self, path: PathLike, mode: int = DEFAULT_DIR_MODE) -> None:
        _call, fault = self._check("mkdir", os.fspath(path))
        if fault:
            self._raise(fault, "mkdir", os.fspath(path))
        self.inner.mkdir(path, mode)

    def fsync_dir(self, path: PathLike) -> None:
        _call, fault = self._check("fsync_dir", os.fspath(path))
        if fault:
            self._raise(fault, "fsync_dir", os.fspath(path))
        self.inner.fsync_dir(path)


class FastFS(FS):
    """Real file operations without fsyncs: for checking crash states, not for durability."""

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: PathLike) -> None:
        pass


FAST_FS = FastFS()
