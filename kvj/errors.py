"""Exceptions kvj raises on purpose: the CLI maps each to one line on stderr and an exit code."""

from __future__ import annotations

from typing import Optional


class KvjError(Exception):
    """Base class for every error kvj reports on purpose."""


class InvalidArgument(KvjError, ValueError):
    """An argument kvj cannot use (a bad device, inconsistent options); nothing was written."""


class CacheFull(KvjError, MemoryError):
    """A paged KV cache has no free block left for a request: free or evict one first."""


class DeviceOutOfMemory(KvjError, MemoryError):
    """A device (or its pinned host memory) has no room for kvj's staging buffers."""


class UnsafePath(KvjError):
    """A symlink, FIFO, device, hard-linked file or untrusted directory where kvj would read or
    write: refused, since one planted there could turn a privileged kvj against its machine."""


class NotFound(KvjError):
    """A journal, store or input the caller named does not exist, or holds nothing kvj wrote."""


class FormatError(KvjError):
    """Input is not in a format kvj understands (bad magic, unsupported version, bad field)."""


class LegacyJournal(FormatError):
    """A seed-era JSON-lines journal: kvj reads it only to migrate it (``kvj migrate``)."""


class CorruptionError(KvjError):
    """Stored bytes fail their checks somewhere other than a torn tail."""

    def __init__(self, path: str, offset: Optional[int], reason: str):
        self.path, self.offset, self.reason = path, offset, reason
        where = f"{path}" if offset is None else f"{path} at offset {offset}"
        super().__init__(f"corruption in {where}: {reason}")


class SegmentCorrupt(CorruptionError):
    """A segment file fails its header, chunk or digest check."""


class SegmentMissing(KvjError):
    """A journal record points at a segment the store does not hold."""


class LayoutMismatch(KvjError):
    """A segment belongs to another model or cache layout than the one it is loaded into."""


class InvalidName(KvjError):
    """A request id or segment key would be unsafe as part of a path, or is malformed."""


class JournalLocked(KvjError):
    """Another live process holds the journal's writer (or compactor) lock."""

    def __init__(self, path: str, pid: Optional[int], what: str = "writer"):
        self.path, self.pid = path, pid
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(f"journal {path} is locked by a live {what} ({holder})")


class JournalFailed(KvjError):
    """The writer hit an I/O error earlier; it accepts nothing more (fsync is never retried)."""


class JournalClosed(KvjError):
    """The journal was closed."""
