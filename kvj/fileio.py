"""The one door through which kvj touches the disk.

Every write, fsync, rename, create and unlink goes through an ``FS`` object, so tests can swap
in a recording or fault-injecting one (``tests/support/crashfs.py``) and build the crash states
a real disk allows. Reads go through ``open_regular``; a small file read whole goes through
``read_bounded``, its size checked first. Every file is opened with ``O_NOFOLLOW`` and must be
a regular file: a symlink, FIFO, device or socket planted in a journal or store is refused
(``UnsafePath``), and so is a file with other hard links that kvj would write to.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from typing import BinaryIO, Callable, List, Union

from kvj.errors import FormatError, UnsafePath

PathLike = Union[str, "os.PathLike[str]"]
#: Bytes kvj writes or reads without copying them first.
Buffer = Union[bytes, bytearray, memoryview]

#: Files and directories kvj creates are owner-only unless the caller asks otherwise.
DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700


class DurabilityError(OSError):
    """A write or fsync failed; nothing after it may be reported durable."""


def open_regular(path: PathLike, flags: int = os.O_RDONLY, mode: int = DEFAULT_FILE_MODE) -> int:
    """Open a file kvj keeps: never through a symlink, never a FIFO, device or socket (opened
    non-blocking so a FIFO cannot hang, then checked), to write never a file with other hard
    links; ``UnsafePath`` else."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{os.fspath(path)} is a symbolic link: refused (kvj opens its files only "
                             "directly)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{os.fspath(path)} is not a regular file (a FIFO, device, socket or directory): "
                             "refused")
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise UnsafePath(f"{os.fspath(path)} has {st.st_nlink} hard links: refused (kvj writes only to files "
                             "it created)")
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_read(path: PathLike) -> BinaryIO:
    """``open(path, "rb")`` through ``open_regular``."""
    return os.fdopen(open_regular(path), "rb")


def read_bounded(path: PathLike, max_bytes: int) -> bytes:
    """The whole of the small file ``path`` (opened by ``open_regular``); one over ``max_bytes``
    (a planted huge or sparse file) is ``FormatError``, refused by its size before reading."""
    with open_read(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
    if size > max_bytes or len(data) > max_bytes:
        raise FormatError(f"{os.fspath(path)} is {max(size, len(data))} bytes, more than the {max_bytes} it may be")
    return data


def _on_fd(fd: int, call: Callable[..., object], *args: object) -> None:
    """``call(*args)``; its ``OSError`` names the file ``fd`` is open on (the OS names none for a
    write or fsync), so that "Input/output error" says where."""
    try:
        call(*args)
    except OSError as exc:
        if exc.filename is None:
            try:
                exc.filename = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # no /proc (macOS), or the descriptor is gone
                pass
        raise


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - os.write raises instead on real errors
            raise OSError(errno.EIO, "short write")
        view = view[n:]


class FS:
    """Real file operations (the default). Subclasses record or inject faults."""

    def open(self, path: PathLike, flags: int, mode: int = DEFAULT_FILE_MODE) -> int:
        return open_regular(path, flags, mode)

    def write(self, fd: int, data: Buffer) -> None:
        """Write all of ``data`` at the current offset (loops over short writes)."""
        _on_fd(fd, _write_all, fd, data)

    def writev(self, fd: int, parts: "list[Buffer]") -> None:
        """Write several buffers in order without joining them (one ``write`` each)."""
        for part in parts:
            self.write(fd, part)

    def fsync(self, fd: int) -> None:
        _on_fd(fd, os.fsync, fd)

    def fdatasync(self, fd: int) -> None:
        _on_fd(fd, getattr(os, "fdatasync", os.fsync), fd)  # macOS has no fdatasync

    def ftruncate(self, fd: int, length: int) -> None:
        _on_fd(fd, os.ftruncate, fd, length)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: PathLike, dst: PathLike) -> None:
        os.rename(src, dst)

    def unlink(self, path: PathLike) -> None:
        os.unlink(path)

    def mkdir(self, path: PathLike, mode: int = DEFAULT_DIR_MODE) -> None:
        os.mkdir(path, mode)

    def fsync_dir(self, path: PathLike) -> None:
        """fsync a directory so that entries created or renamed in it survive power loss."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError as exc:
            exc.filename = exc.filename or os.fspath(path)
            raise
        finally:
            os.close(fd)


#: The process-wide default; engine objects take an ``fs=`` argument to override it.
REAL_FS = FS()


def _refusing(what: str, names_path: bool = False) -> Callable[..., None]:
    """A ``ReadOnlyFS`` method: ``EROFS`` for the change ``what`` (naming its path, if it has one)."""
    def refuse(self: FS, *args: object) -> None:
        raise OSError(errno.EROFS, f"a read-only command must not {what}", args[0] if names_path else None)
    return refuse


class ReadOnlyFS(FS):
    """Refuses every change (``EROFS``): a read-only command's FS, so a write it must never make
    fails loudly instead of happening."""

    _WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def open(self, path: PathLike, flags: int, mode: int = DEFAULT_FILE_MODE) -> int:
        if flags & self._WRITING:
            raise OSError(errno.EROFS, "a read-only command must not open a file for writing", path)
        return super().open(path, flags, mode)

    write = writev = _refusing("write")
    fsync = fdatasync = _refusing("fsync")
    ftruncate = _refusing("truncate")
    rename = _refusing("rename", names_path=True)
    unlink = _refusing("remove", names_path=True)
    mkdir = _refusing("make a directory", names_path=True)
    fsync_dir = _refusing("fsync", names_path=True)


READ_ONLY_FS = ReadOnlyFS()


class CountedFS(FS):
    """``inner``'s file operations, counting syncs and bytes written (``counts``: the benchmarks' figures)."""

    def __init__(self, inner: FS = REAL_FS):
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


def makedirs_durable(path: PathLike, fs: FS = REAL_FS, mode: int = DEFAULT_DIR_MODE) -> None:
    """Create ``path`` and any missing parents, fsyncing each new entry's parent. ``path`` itself
    must not be a symlink (``UnsafePath``): kvj writes only into directories it made; parents are
    taken as they are (a journal may live behind its owner's symlink)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.islink(path):
        raise UnsafePath(f"{path} is a symbolic link: refused (kvj writes only into directories it made)")
    _makedirs(path, fs, mode)


def _makedirs(path: str, fs: FS, mode: int) -> None:
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        _makedirs(parent, fs, mode)
    try:
        fs.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    fs.fsync_dir(parent)


def list_dir(path: PathLike) -> List[str]:
    """The names in directory ``path`` ([] when it does not exist). A symlink where kvj keeps its
    own folder is ``UnsafePath``: what kvj lists there it may remove, never through a link."""
    path = os.fspath(path)
    if os.path.islink(path):
        raise UnsafePath(f"{path} is a symbolic link: refused (kvj lists only directories it made)")
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def rename_durable(src: PathLike, dst: PathLike, fs: FS = REAL_FS) -> None:
    """Rename ``src`` to ``dst`` and fsync both directories, so the move survives power loss."""
    fs.rename(src, dst)
    dst_dir = os.path.dirname(os.path.abspath(os.fspath(dst)))
    src_dir = os.path.dirname(os.path.abspath(os.fspath(src)))
    fs.fsync_dir(dst_dir)
    if src_dir != dst_dir:
        fs.fsync_dir(src_dir)


def fsync_path(path: PathLike, fs: FS = REAL_FS) -> None:
    """fsync an existing file by path: make what readers already saw in it durable."""
    fd = fs.open(path, os.O_RDONLY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def discard_temp(fs: FS, fd: int, tmp: str) -> None:
    """After a failure, close ``fd`` and remove the temporary file ``tmp`` it was writing; best
    effort (the caller reports the first error)."""
    try:
        fs.close(fd)
    except OSError:
        pass
    try:
        fs.unlink(tmp)
    except OSError:
        pass


def atomic_write(path: PathLike, data: Buffer, fs: FS = REAL_FS, mode: int = DEFAULT_FILE_MODE) -> None:
    """Durably replace ``path`` with ``data`` (temp file, fsync, rename, fsync directory): after
    a crash it holds the old content or the new, never a mix. An ``OSError`` names ``path``,
    never the temporary file."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        try:
            fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:  # left by a crashed run with this pid, or planted: replace the name, not its target
            fs.unlink(tmp)
            fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            fs.write(fd, data)
            fs.fsync(fd)
        except BaseException:
            discard_temp(fs, fd, tmp)
            raise
        fs.close(fd)
        fs.rename(tmp, path)
        fs.fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        if exc.filename in (None, tmp, os.path.realpath(tmp)):  # realpath: as _on_fd names it
            exc.filename = path
        raise
