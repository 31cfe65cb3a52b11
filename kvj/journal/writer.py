"""The writer, as LevelDB's write queue and ``log::Writer`` (spec: man/kvj-journal.5, LOG FILE,
DURABILITY and MIRROR): ``append`` frames a record into a buffer on the caller's thread; a
committer thread writes what accumulated as one commit group, fdatasynced in every copy before
the next, and at most ``max_pending_records`` are ever appended but not durable (``append``
blocks beyond: the most a crash can lose). A failed write or fsync is final, never retried.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Deque, Iterable, List, Mapping, Optional, Tuple, Union

from kvj.errors import JournalClosed, JournalFailed
from kvj.fileio import FS, REAL_FS, Buffer, DurabilityError
from kvj.journal.config import CommitPolicy
from kvj.journal.framing import (MAX_GROUP_BODY, MAX_RECORD_PAYLOAD, RECORD_HEADER_SIZE, encode_file_header,
                                 encode_group_header, encode_record)
from kvj.journal.mirror import DEGRADE, FAIL, log
from kvj.journal.records import encode_payload


def log_name(seq: int) -> str:
    """File name of log file number ``seq`` (zero-padded so names sort in order)."""
    return f"{seq:016d}.log"


class LogCopy:
    """One copy of the log file being written, in ``directory``."""

    def __init__(self, directory: str, fs: FS = REAL_FS):
        self.directory = directory
        self.fs = fs
        self._fd = -1

    def create(self, name: str, header: bytes) -> None:
        """Create file ``name`` holding ``header``, it and its directory entry durable."""
        fd = self.fs.open(os.path.join(self.directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        try:
            self.fs.write(fd, header)
            self.fs.fsync(fd)
            self.fs.fsync_dir(self.directory)
        except BaseException:
            self.fs.close(fd)
            raise
        self._fd = fd

    def resume(self, name: str) -> int:
        """Open file ``name`` (whole groups, durable) to append; returns its size."""
        self._fd = self.fs.open(os.path.join(self.directory, name), os.O_WRONLY | os.O_APPEND)
        return os.fstat(self._fd).st_size

    def write_synced(self, parts: List[Buffer]) -> None:
        self.fs.writev(self._fd, parts)
        self.fs.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            self.fs.close(fd)


class LogFile:
    """The newest log file, in the journal's directory and its mirror's (written at once, on a
    thread of its own), appended to one commit group at a time."""

    def __init__(self, directory: str, fs: FS, *, seq: int, next_lsn: int, salt: Optional[int] = None,
                 mirror: Optional[str] = None, mirror_policy: str = FAIL):
        """Append to file ``seq`` when its ``salt`` is given, else create it, from ``next_lsn``."""
        self.primary = LogCopy(directory, fs)
        self._mirror = LogCopy(mirror, fs) if mirror is not None else None
        self.mirror_policy = mirror_policy
        self.mirror_error: Optional[OSError] = None  #: why the mirror was dropped (policy degrade)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvj-mirror") if mirror is not None else None
        self.seq = seq
        if salt is None:
            self._create(seq, next_lsn)
        else:
            name = log_name(seq)
            self.salt, self.size = salt, self.primary.resume(name)
            self._on_mirror(lambda m: m.resume(name))

    @property
    def mirror(self) -> Optional[str]:
        """The mirror's directory while it is written; None once dropped."""
        return self._mirror.directory if self._mirror is not None else None

    def _create(self, seq: int, base_lsn: int) -> None:
        salt = int.from_bytes(os.urandom(4), "little")
        header = encode_file_header(seq, base_lsn, salt)
        self.primary.create(log_name(seq), header)
        self._on_mirror(lambda m: m.create(log_name(seq), header))
        self.seq, self.size, self.salt = seq, len(header), salt

    def add_group(self, body: Buffer, count: int, first_lsn: int) -> None:
        """Write the commit group of ``count`` framed records ``body`` and fdatasync it in every
        copy: once this returns, its records are durable."""
        head = encode_group_header(len(body), count, first_lsn, self.salt, time.time_ns())
        parts = [head, body]
        mirror = self._mirror
        if mirror is None:
            self.primary.write_synced(parts)
        else:
            mirrored = self._pool.submit(mirror.write_synced, parts)  # type: ignore[union-attr]
            try:
                self.primary.write_synced(parts)
            finally:
                wait([mirrored])  # never leave the mirror's copy in flight
            self._on_mirror(lambda _m: mirrored.result())
        self.size += len(head) + len(body)

    def rotate(self, next_lsn: int) -> None:
        """Close this file (every group in it durable) and create the next, from ``next_lsn``."""
        self._close_copies()
        self._create(self.seq + 1, next_lsn)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._close_copies()

    def _close_copies(self) -> None:
        self.primary.close()
        self._on_mirror(lambda m: m.close())

    def _on_mirror(self, op: Callable[[LogCopy], Any]) -> None:
        """Run ``op`` on the mirror's copy, unless it was dropped. A failure is the writer's under
        mirror policy fail; under degrade it is logged and the mirror is not written again."""
        mirror = self._mirror
        if mirror is None:
            return
        try:
            op(mirror)
        except OSError as exc:
            if self.mirror_policy != DEGRADE:
                raise DurabilityError(exc.errno or errno.EIO, f"mirror {mirror.directory}: {exc}") from exc
            log.warning("journal mirror %s failed (%s): writing the primary copy %s only until the journal is "
                        "opened again (mirror policy degrade)", mirror.directory, exc, self.primary.directory)
            try:
                mirror.close()
            except OSError:
                pass
            self.mirror_error, self._mirror = exc, None


class LogWriter:
    """Appends records to the log files of one journal directory. One per journal."""

    def __init__(self, directory: str, *, next_seq: int, next_lsn: int,
                 policy: CommitPolicy = CommitPolicy(), fs: FS = REAL_FS, resume_salt: Optional[int] = None,
                 mirror: Optional[str] = None, mirror_policy: str = FAIL,
                 on_durable: Optional[Callable[[int], None]] = None):
        """Write LSNs from ``next_lsn`` on, in log file ``next_seq`` (appended to when its ``resume_salt``
        is given), in ``mirror`` too; ``on_durable(lsn)`` runs on the committer once ``lsn`` is durable."""
        self.directory = directory
        self._on_durable = on_durable
        self.policy = policy
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # committer waits here
        self._done = threading.Condition(self._lock)  # sync() and full-buffer appends wait here
        # A group is the whole buffer: committed before one more record could take it past what a
        # reader accepts (kvj-journal(5), Limits), whatever the policy allows.
        self._max_buffer = min(policy.max_buffer_bytes, MAX_GROUP_BODY - MAX_RECORD_PAYLOAD - RECORD_HEADER_SIZE)
        self._max_pending = policy.max_pending_records
        self._group_cap = policy.max_group_records or 0  # 0: no cap; a full group is sealed (``_seal``)
        self._max_records = min(policy.max_records, self._group_cap) if self._group_cap else policy.max_records
        self._sealed: Deque[Tuple[bytearray, int, int]] = deque()
        self._sealed_bytes = 0
        self._buf = bytearray()
        self._count = 0
        self._first_lsn = next_lsn
        self._first_time = 0.0
        self._next_lsn = next_lsn
        self._durable_lsn = next_lsn - 1
        #: the last LSN ``append`` may give without waiting: durable + max pending; -1 once the
        #: writer failed or is closing, so that one comparison sends ``append`` to the slow path
        self._room_lsn = self._durable_lsn + self._max_pending
        self._sync_target = 0
        self._error: Optional[BaseException] = None
        self._closing = False
        self._closed = False
        self._log = LogFile(directory, fs, seq=next_seq, next_lsn=next_lsn, salt=resume_salt, mirror=mirror,
                            mirror_policy=mirror_policy)
        self._thread = threading.Thread(target=self._run, name="kvj-committer", daemon=True)
        self._thread.start()

    @property
    def mirror(self) -> Optional[str]:
        """The mirror written along with the journal, or None (none, or dropped: ``mirror_error``)."""
        return self._log.mirror

    @property
    def mirror_error(self) -> Optional[OSError]:
        """Why the mirror was dropped under policy degrade; None while it is written."""
        return self._log.mirror_error

    def append(self, rtype: int, payload: Union[bytes, Mapping[str, Any]], durable: bool = False) -> int:
        """Frame a record (its payload encoded, or a map, unchecked: the schema is the caller's) into
        the buffer and return its LSN; with ``durable``, wait for it."""
        body = payload if type(payload) is bytes else encode_payload(payload)
        with self._lock:
            lsn = self._frame(rtype, body)
        if durable:
            self.wait_durable(lsn)
        return lsn

    def append_many(self, records: Iterable[Tuple[int, bytes]], durable: bool = False) -> List[int]:
        """Frame encoded records in order under one lock and return their LSNs (consecutive
        unless the buffer filled on the way and another thread appended meanwhile)."""
        lsns: List[int] = []
        with self._lock:
            for rtype, body in records:
                lsns.append(self._frame(rtype, body))
        if durable and lsns:
            self.wait_durable(lsns[-1])
        return lsns

    def _frame(self, rtype: int, body: bytes) -> int:
        """(Lock held) frame one record into the buffer, waiting for room, and return its LSN."""
        lsn = self._next_lsn
        buf = self._buf
        if lsn > self._room_lsn or len(buf) >= self._max_buffer:
            lsn, buf = self._wait_for_room()
        self._next_lsn = lsn + 1
        buf += encode_record(rtype, lsn, body)
        count = self._count = self._count + 1
        if count == 1 or count == self._max_records:
            self._group_due(count)
        return lsn

    def _group_due(self, count: int) -> None:
        """(Lock held) wake the committer for a group's first record (its max_delay starts) or once
        max_records are pending; seal the group once it holds max_group_records."""
        if count == 1:
            self._first_time = time.monotonic()
        if count == self._group_cap:
            self._seal()
        self._wake.notify()

    def _seal(self) -> None:
        """(Lock held) queue the full buffer for the committer and fill the next meanwhile;
        ``_max_buffer`` shrinks by the sealed bytes, so ``max_buffer_bytes`` bounds them all."""
        buf = self._buf
        self._sealed.append((buf, self._count, self._first_lsn))
        self._sealed_bytes += len(buf)
        self._max_buffer = self.policy.max_buffer_bytes - self._sealed_bytes
        self._first_lsn += self._count
        self._buf = bytearray()
        self._count = 0

    def _wait_for_room(self) -> Tuple[int, bytearray]:
        """(Lock held) block while the buffer is full or too many records are not durable; raise
        once the writer failed or is closing. Returns the next LSN and the buffer."""
        while True:
            if self._error is not None or self._closing:
                self._raise_state()
            if len(self._buf) < self._max_buffer and self._next_lsn <= self._room_lsn:
                return self._next_lsn, self._buf
            if self._sync_target < self._next_lsn - 1:
                self._sync_target = self._next_lsn - 1  # commit what is pending now, not after max_delay
                self._wake.notify()
            self._done.wait()

    def sync(self) -> int:
        """Block until every record appended so far is durable; return the last LSN."""
        with self._lock:
            target = self._next_lsn - 1
        self.wait_durable(target)
        return target

    def wait_durable(self, lsn: int) -> None:
        """Block until ``lsn`` is durable, asking the committer to commit now."""
        with self._lock:
            if self._durable_lsn >= lsn:
                return
            if self._sync_target < lsn:
                self._sync_target = lsn
                self._wake.notify()
            while self._durable_lsn < lsn:
                if self._error is not None:
                    self._raise_state()
                if self._closed:
                    raise JournalClosed("journal closed before the record was durable")
                self._done.wait()

    @property
    def durable_lsn(self) -> int:
        return self._durable_lsn

    @property
    def last_lsn(self) -> int:
        return self._next_lsn - 1

    @property
    def failed(self) -> Optional[BaseException]:
        return self._error

    def close(self) -> None:
        """Commit what is pending, stop the committer and close the file."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._room_lsn = -1
            self._wake.notify()
        self._thread.join()
        with self._lock:
            self._closed = True
            self._done.notify_all()
        try:
            self._log.close()
        except OSError as exc:
            self._error = self._error or exc
        if self._error is not None:
            raise JournalFailed(f"journal writer failed: {self._error}") from self._error

    def fail(self, error: BaseException) -> None:
        """Enter the failed state for ``error`` (a segment the journal needed could not be made
        durable): nothing more is written; every waiter and later call gets ``JournalFailed``."""
        with self._lock:
            if self._error is None:
                self._error = error
            self._room_lsn = -1
            self._wake.notify()
            self._done.notify_all()

    def _raise_state(self) -> None:
        if self._error is not None:
            raise JournalFailed(f"journal writer failed earlier and accepts nothing more: {self._error}")
        raise JournalClosed("journal is closed")

    def _take_group(self) -> Optional[tuple]:
        """Wait until a group is due; return (data, count, first_lsn) or None to stop."""
        policy = self.policy
        with self._lock:
            while True:
                if self._error is not None:
                    return None
                if self._sealed:  # full groups come first: they are older than the buffer
                    data, count, first = self._sealed.popleft()
                    self._sealed_bytes -= len(data)
                    self._max_buffer = policy.max_buffer_bytes - self._sealed_bytes
                    self._done.notify_all()  # room in the buffer again
                    return data, count, first
                if self._count:
                    due = (self._closing or self._count >= policy.max_records
                           or self._sync_target >= self._first_lsn)
                    if not due:
                        remaining = self._first_time + policy.max_delay - time.monotonic()
                        if remaining > 0:
                            self._wake.wait(remaining)
                            continue
                    data, count, first = self._buf, self._count, self._first_lsn
                    self._buf = bytearray()
                    self._count = 0
                    self._first_lsn = first + count
                    self._done.notify_all()  # room in the buffer again
                    return data, count, first
                if self._closing:
                    return None
                self._wake.wait()

    def _run(self) -> None:
        log_file = self._log
        try:
            while True:
                group = self._take_group()
                if group is None:
                    return
                data, count, first = group
                log_file.add_group(data, count, first)
                with self._lock:
                    self._durable_lsn = first + count - 1
                    if not self._closing:
                        self._room_lsn = self._durable_lsn + self._max_pending
                    self._done.notify_all()
                if self._on_durable is not None:
                    self._on_durable(first + count - 1)
                if log_file.size >= self.policy.file_size_limit:
                    log_file.rotate(first + count)
        except BaseException as exc:  # an I/O error is final: never retry fsync
            err = exc if isinstance(exc, OSError) else DurabilityError(errno.EIO, str(exc))
            with self._lock:
                self._error = err
                self._room_lsn = -1
                self._done.notify_all()
