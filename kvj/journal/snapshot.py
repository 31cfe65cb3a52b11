"""Snapshots: the folded state as of an LSN, written by compaction (spec: man/kvj-journal.5,
SNAPSHOTS). A snapshot is written durably before any log file it covers is deleted, into the
mirror too; reading takes the mirror's copy when the journal's is missing or damaged.
"""

from __future__ import annotations

import os
import re
import struct
from typing import Dict, List, Optional, Tuple

import msgspec
from crc32c import crc32c

from kvj.errors import CorruptionError, FormatError
from kvj.fileio import FS, REAL_FS, atomic_write
from kvj.journal.mirror import log, mirror_of
from kvj.journal.reader import list_logs, read_header
from kvj.journal.source import DIRECT, Pinned
from kvj.journal.state import JournalState

SNAP_MAGIC = b"\x89KVJSNP\n"
SNAP_VERSION = 1
SNAP_HEADER = struct.Struct("<8sHHQQI")  # magic version flags lsn body_len crc (over the rest and the body)
SNAP_RE = re.compile(r"^snapshot-(\d{16})\.snap$")
MAX_SNAPSHOT = 1 << 31


def snapshot_name(lsn: int) -> str:
    """File name of the snapshot at ``lsn``."""
    return f"snapshot-{lsn:016d}.snap"


def list_snapshots(directory: str, files: Pinned = DIRECT) -> List[Tuple[int, str]]:
    """(lsn, path) of every snapshot file, newest first."""
    found = []
    for name in files.listdir(directory):
        m = SNAP_RE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def encode_snapshot(state: JournalState) -> bytes:
    """The snapshot file of ``state`` (without its ended requests)."""
    body = msgspec.msgpack.encode(state.to_dict(include_ended=False))
    head = SNAP_HEADER.pack(SNAP_MAGIC, SNAP_VERSION, 0, state.last_lsn, len(body), 0)[:-4]
    return head + struct.pack("<I", crc32c(body, crc32c(head))) + body


def decode_snapshot(data: bytes, path: str) -> JournalState:
    """The state snapshot file ``path`` holds; anything else is ``CorruptionError`` (``FormatError``
    for an unknown version)."""
    if len(data) < SNAP_HEADER.size:
        raise CorruptionError(path, 0, "snapshot shorter than its header")
    magic, version, _flags, lsn, body_len, crc = SNAP_HEADER.unpack_from(data, 0)
    if magic != SNAP_MAGIC:
        raise CorruptionError(path, 0, "bad snapshot magic")
    if version != SNAP_VERSION:
        raise FormatError(f"{path}: snapshot version {version} is not supported")
    body = data[SNAP_HEADER.size:]
    if body_len != len(body) or body_len > MAX_SNAPSHOT:
        raise CorruptionError(path, SNAP_HEADER.size, f"snapshot body is {len(body)} bytes, header says {body_len}")
    if crc32c(body, crc32c(data[:SNAP_HEADER.size - 4])) != crc:
        raise CorruptionError(path, 0, "snapshot checksum mismatch")
    try:
        state = JournalState.from_dict(msgspec.msgpack.decode(body))
        # do what replay, fsck and compaction do with a state, so that wrong-typed fields fail
        # here, as corruption, not later as a TypeError or an unreadable next snapshot
        msgspec.msgpack.decode(msgspec.msgpack.encode(state.to_dict()))
        state.referenced_keys()
        state.cached_keys()
    except Exception as exc:  # a valid CRC over a malformed body: written by a buggy or hostile tool
        raise CorruptionError(path, SNAP_HEADER.size, f"malformed snapshot body: {_reason(exc)}") from None
    if state.last_lsn != lsn:
        raise CorruptionError(path, 0, f"snapshot header LSN {lsn} disagrees with its body ({state.last_lsn})")
    state.snapshot_lsn = lsn
    return state


def _reason(exc: Exception) -> str:
    """``exc`` as a reason that is never empty: its type, then its text or its type's docstring."""
    text = str(exc) or (type(exc).__doc__ or "").strip().partition("\n")[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def all_snapshots(directory: str, files: Pinned = DIRECT) -> Dict[int, List[str]]:
    """LSN -> the paths of the snapshots at it, in the journal and its mirror (the journal's first)."""
    mirror = mirror_of(directory)
    found: Dict[int, List[str]] = {}
    for d in [directory] + ([mirror] if mirror else []):
        try:
            for lsn, path in list_snapshots(d, files):
                found.setdefault(lsn, []).append(path)
        except FileNotFoundError:
            continue
    return found


def load_latest(directory: str, files: Pinned = DIRECT) -> Optional[JournalState]:
    """The newest snapshot's state, or None. A damaged newest snapshot is an error, never skipped,
    unless the mirror holds an intact copy (then a warning says so)."""
    found = all_snapshots(directory, files)
    mirror = mirror_of(directory)
    if not found:
        return None
    paths = found[max(found)]
    for index, path in enumerate(paths):
        try:
            with files.open(path) as f:
                state = decode_snapshot(f.read(), path)
        except (CorruptionError, FormatError, OSError) as exc:
            if index == len(paths) - 1:
                raise
            damage = exc
            continue
        if index:
            state.warnings.append(f"snapshot {paths[0]} is damaged or unreadable ({damage}); its copy {path} was used")
        elif len(paths) == 1 and mirror:
            other = directory if os.path.dirname(path) == mirror else mirror
            state.warnings.append(f"snapshot {os.path.basename(path)} is missing from {other}; {path} was used")
        return state
    return None  # pragma: no cover - the loop returns or raises


def write_snapshot(directory: str, state: JournalState, fs: FS = REAL_FS) -> str:
    """Durably write a snapshot of ``state`` (into the journal's mirror too); returns its path."""
    name = snapshot_name(state.last_lsn)
    path = os.path.join(directory, name)
    data = encode_snapshot(state)
    atomic_write(path, data, fs)
    mirror = mirror_of(directory)
    if mirror is not None:
        try:
            atomic_write(os.path.join(mirror, name), data, fs)
            _drop_covered(mirror, state.last_lsn, fs)
        except OSError as exc:  # the journal's copy is whole; the next writer restores the mirror's
            log.warning("journal %s: snapshot %s not copied to the mirror %s (%s); the mirror keeps its log files",
                        directory, name, mirror, exc)
    return path


def _drop_covered(mirror: str, lsn: int, fs: FS) -> None:
    """Unlink the mirror's older snapshots and the log files whose records the snapshot at
    ``lsn`` holds (every file before one that starts at or before ``lsn`` + 1), oldest first."""
    logs = list_logs(mirror)
    bases = [read_header(p) for p in logs]
    covered = [p for i, p in enumerate(logs[:-1])
               if any(h is not None and h.base_lsn <= lsn + 1 for h in bases[i + 1:])]
    old = [p for s_lsn, p in sorted(list_snapshots(mirror)) if s_lsn < lsn]
    for path in covered + old:
        fs.unlink(path)
    if covered or old:
        fs.fsync_dir(mirror)
