"""Snapshots: the folded state as of an LSN, written by compaction (spec: man/kvj-journal.5).

    header  magic[8] version:u16 flags:u16 lsn:u64 body_len:u64 crc:u32
    body    msgpack map (JournalState.to_dict without ended requests)

The CRC32C covers the header's first 28 bytes and the body. A snapshot is written with
``atomic_write`` (temp file, fsync, rename, fsync directory) before any log file it
covers is deleted.
"""

from __future__ import annotations

import os
import re
import struct
from typing import List, Optional, Tuple

import msgpack
from crc32c import crc32c

from kvj.errors import CorruptionError, FormatError
from kvj.fileio import FS, REAL_FS, atomic_write, open_read
from kvj.journal.state import JournalState

SNAP_MAGIC = b"\x89KVJSNP\n"
SNAP_VERSION = 1
SNAP_HEADER = struct.Struct("<8sHHQQI")
SNAP_RE = re.compile(r"^snapshot-(\d{16})\.snap$")
MAX_SNAPSHOT = 1 << 31


def snapshot_name(lsn: int) -> str:
    return f"snapshot-{lsn:016d}.snap"


def list_snapshots(directory: str) -> List[Tuple[int, str]]:
    """(lsn, path) of every snapshot file, newest first."""
    found = []
    for name in os.listdir(directory):
        m = SNAP_RE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def encode_snapshot(state: JournalState) -> bytes:
    body = msgpack.packb(state.to_dict(include_ended=False), use_bin_type=True)
    head = SNAP_HEADER.pack(SNAP_MAGIC, SNAP_VERSION, 0, state.last_lsn, len(body), 0)[:-4]
    return head + struct.pack("<I", crc32c(body, crc32c(head))) + body


def decode_snapshot(data: bytes, path: str) -> JournalState:
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
        state = JournalState.from_dict(msgpack.unpackb(body, raw=False))
        # exercise what replay, fsck and compaction do with a state (fold, serialise into the
        # next snapshot and read that back), so that a body with wrong-typed fields fails
        # here, as corruption, and not later as a TypeError or as an unreadable snapshot
        msgpack.unpackb(msgpack.packb(state.to_dict(), use_bin_type=True), raw=False)
        state.referenced_keys()
    except Exception as exc:  # a valid CRC over a malformed body: written by a buggy or hostile tool
        raise CorruptionError(path, SNAP_HEADER.size, f"malformed snapshot body: {exc}") from None
    if state.last_lsn != lsn:
        raise CorruptionError(path, 0, f"snapshot header LSN {lsn} disagrees with its body ({state.last_lsn})")
    state.snapshot_lsn = lsn
    return state


def load_latest(directory: str) -> Optional[JournalState]:
    """The newest snapshot's state, or None. A damaged newest snapshot is an error, not skipped."""
    snaps = list_snapshots(directory)
    if not snaps:
        return None
    _lsn, path = snaps[0]
    with open_read(path) as f:
        return decode_snapshot(f.read(), path)


def write_snapshot(directory: str, state: JournalState, fs: FS = REAL_FS) -> str:
    """Durably write a snapshot of ``state``; returns its path."""
    path = os.path.join(directory, snapshot_name(state.last_lsn))
    atomic_write(path, encode_snapshot(state), fs)
    return path
