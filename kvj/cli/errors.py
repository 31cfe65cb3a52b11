"""The one place where failures become an exit status and one line on stderr.

Every command exits with a status from ``EXIT_CODES`` (the BSD sysexits values, so
systemd units and scripts can tell "try again later" from "the data is damaged");
``kvj fsck`` uses e2fsck's statuses instead (``FSCK_CODES``). The man pages print
both tables from here.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from typing import Dict, Optional, Tuple

from kvj.errors import (
    CorruptionError,
    FormatError,
    InvalidArgument,
    InvalidName,
    JournalFailed,
    JournalLocked,
    KvjError,
    LayoutMismatch,
    NotFound,
    SegmentMissing,
    UnsafePath,
)

# sysexits.h's values, as the os module has them, and two of the shell's.
OK = os.EX_OK
FAILURE = 1
USAGE = os.EX_USAGE
DATAERR = os.EX_DATAERR
NOINPUT = os.EX_NOINPUT
SOFTWARE = os.EX_SOFTWARE
DONE_UNREPORTED = os.EX_CANTCREAT  # "can't create (user) output file": the work itself is done
IOERR = os.EX_IOERR
TEMPFAIL = os.EX_TEMPFAIL
NOPERM = os.EX_NOPERM
INTERRUPTED = 128 + signal.SIGINT  # as a shell reports a command that SIGINT ended

#: status -> meaning, for help text and man pages.
EXIT_CODES: Dict[int, str] = {
    OK: "success",
    FAILURE: "the command ran but its check failed (e.g. recover --device could not load a segment)",
    USAGE: "usage error: unknown option, bad argument",
    DATAERR: "corrupt or malformed input: damaged journal or segment, bad NDJSON or tensor file; or a seed-era "
             "JSON-lines journal, which only kvj migrate reads (the message names the kvj migrate command)",
    NOINPUT: "missing or unreadable journal, store or input file",
    SOFTWARE: "internal error (a bug: set KVJ_DEBUG=1 for the traceback and report it)",
    DONE_UNREPORTED: "the work is done and durable, but its output could not be written (standard output closed, "
                     "full or failing): the message says what was done",
    IOERR: "I/O error while writing: failed write or fsync, disk full (nothing after it is durable)",
    TEMPFAIL: "the journal is locked by a live writer or compactor (its pid is named); try again later",
    NOPERM: "permission denied, or refused: a symlink, FIFO or device where kvj keeps a file, a file with other "
            "hard links that kvj would write, or (as root) a journal another user owns",
    INTERRUPTED: "interrupted (Ctrl-C)",
}

FSCK_CLEAN = 0
FSCK_CORRECTED = 1
FSCK_UNCORRECTED = 4
FSCK_OPERATIONAL = 8
FSCK_USAGE = 16
FSCK_CANCELED = 32
FSCK_USE_LOG = 64  # kvj's own (e2fsck leaves 64 unused): kvj.ops.fsck.USE_LOG_DAMAGED

#: kvj fsck's statuses, as e2fsck's (a sum when both 1 and 4 apply).
FSCK_CODES: Dict[int, str] = {
    FSCK_CLEAN: "no errors",
    FSCK_CORRECTED: "errors found and corrected (torn tail cut and kept aside, damaged unreferenced segment "
                    "quarantined, disagreeing snapshot set aside)",
    FSCK_UNCORRECTED: "errors left uncorrected (run with --repair, or the damage cannot be repaired)",
    FSCK_OPERATIONAL: "operational error: missing or unreadable journal, locked, permission denied, I/O error, "
                      "a kvj.conf every command refuses (not JSON, or a commit policy that cannot work), a "
                      "seed-era JSON-lines journal (kvj migrate converts it)",
    FSCK_USAGE: "usage error",
    FSCK_CANCELED: "interrupted (Ctrl-C)",
    FSCK_USE_LOG: "a warning, added to the others: records of the segment store's use log (uses.kvjuse, "
                  "kvj-segment(5), USE LOG) fail their CRC with valid records after them; only eviction order and "
                  "the hit rate read it, and the next kvj compact rewrites it",
}


def classify(exc: BaseException) -> Tuple[int, str]:
    """(exit status, one-line message) for an exception that ends a command."""
    if isinstance(exc, JournalLocked):
        return TEMPFAIL, str(exc)
    if isinstance(exc, JournalFailed):
        return IOERR, str(exc)
    if isinstance(exc, (CorruptionError, LayoutMismatch, SegmentMissing)):
        return DATAERR, str(exc)
    if isinstance(exc, (InvalidName, InvalidArgument)):
        return USAGE, str(exc)
    if isinstance(exc, NotFound):
        return NOINPUT, str(exc)
    if isinstance(exc, UnsafePath):
        return NOPERM, str(exc)
    if isinstance(exc, FormatError):
        return DATAERR, str(exc)
    if isinstance(exc, KvjError):
        return FAILURE, str(exc)
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    return SOFTWARE, f"internal error: {type(exc).__name__}: {exc} (set KVJ_DEBUG=1 for the traceback)"


def _os_error(exc: OSError) -> Tuple[int, str]:
    where = exc.filename if exc.filename is not None else None
    reason = exc.strerror or str(exc)
    text = f"{where}: {reason}" if where else reason
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return NOPERM, f"permission denied: {text}"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG):
        return NOINPUT, text
    return IOERR, f"I/O error: {text}"


def fsck_status(status: int) -> int:
    """Map a general exit status to fsck's: usage errors 16, anything operational 8."""
    if status == OK:
        return FSCK_CLEAN
    if status == USAGE:
        return FSCK_USAGE
    return FSCK_OPERATIONAL


def one_line(message: str) -> str:
    return " ".join(str(message).split())


def report(prog: str, message: str, stream: Optional[object] = None) -> None:
    """Print ``prog: error: message`` as one line on stderr."""
    print(f"{prog}: error: {one_line(message)}", file=stream or sys.stderr)


def debug() -> bool:
    return os.environ.get("KVJ_DEBUG", "") not in ("", "0")


def fail(prog: str, exc: BaseException, rank: Optional[str] = None) -> Tuple[int, str]:
    """Report ``exc`` as one line (naming the rank journal it stopped, if any: the others go on);
    returns its exit status and message. The traceback too under KVJ_DEBUG=1."""
    status, message = classify(exc)
    if debug():
        import traceback
        traceback.print_exception(exc)
    report(prog, f"{rank}: {message}" if rank else message)
    return status, message
