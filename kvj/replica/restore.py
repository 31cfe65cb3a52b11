"""Restore a journal from its replica onto a fresh directory, verifying every object.

Each log part and the snapshot must match the BLAKE3 the manifest recorded, the log files
are then read back strictly (every CRC, LSN continuity), and every segment the restored
state needs is checked in full (chunk CRCs and the content digest) before it is stored.
Everything is written durably into a staging directory that is renamed into place last,
so an interrupted restore never leaves a half journal under the target name.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Optional

from kvj.errors import CorruptionError, FormatError
from kvj.fileio import atomic_write, makedirs_durable, rename_durable
from kvj.journal.framing import (
    FILE_HEADER_SIZE,
    READABLE_VERSIONS,
    decode_file_header,
    encode_group_header,
    encode_record,
    group_header_at,
    parse_group,
)
from kvj.journal.journal import default_store_path
from kvj.journal.replay import replay
from kvj.journal.snapshot import decode_snapshot, snapshot_name
from kvj.journal.state import JournalState
from kvj.replica import manifest as mf
from kvj.replica.remote import Remote

Progress = Callable[[str, int, int], None]


@dataclass
class RestoreResult:
    """What a restore wrote."""

    journal: str = ""
    last_lsn: int = 0
    snapshot_lsn: Optional[int] = None
    logs: int = 0
    segments: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _checked(remote: Remote, obj: str, blake: str) -> bytes:
    data = remote.read(obj)
    if mf.digest(data) != blake:
        raise CorruptionError(f"{remote.url}/{obj}", None, "object differs from the digest the manifest recorded")
    return data


def trim_log(data: bytes, at_lsn: int, path: str) -> bytes:
    """The log file ``data`` cut after LSN ``at_lsn``: a group holding it is re-framed up to
    it, in the file's own format version and with the group's own time."""
    header = decode_file_header(data)
    if header is None:
        raise CorruptionError(path, 0, "bad log file header")
    if header.version not in READABLE_VERSIONS:
        raise FormatError(f"{path}: log format version {header.version} is not supported")
    out = [data[:FILE_HEADER_SIZE]]
    off = FILE_HEADER_SIZE
    while off < len(data):
        parsed = parse_group(data, off, path, header.salt, version=header.version)
        if parsed is None:
            raise CorruptionError(path, off, "damaged commit group in a replicated log")
        records, end = parsed
        if records[-1].lsn <= at_lsn:
            out.append(data[off:end])
            off = end
            continue
        keep = [r for r in records if r.lsn <= at_lsn]
        if keep:
            time_ns = group_header_at(data, off, header.salt, header.version)[3]  # type: ignore[index]
            body = b"".join(encode_record(r.rtype, r.lsn, r.payload) for r in keep)
            out.append(encode_group_header(len(body), len(keep), keep[0].lsn, header.salt, time_ns or 0,
                                           header.version) + body)
        break
    return b"".join(out)


def download_journal(remote: Remote, m: mf.Manifest, directory: str, at_lsn: Optional[int] = None,
                     threads: int = 8) -> int:
    """Write the replica's snapshot and log files (cut after ``at_lsn``) into ``directory``,
    each checked against the manifest; returns the bytes written."""
    written = 0
    if m.snapshot is not None:
        data = _checked(remote, m.snapshot.object, m.snapshot.blake3)
        decode_snapshot(data, f"{remote.url}/{m.snapshot.object}")
        atomic_write(os.path.join(directory, snapshot_name(m.snapshot.lsn)), data)
        written += len(data)
    entries = [e for e in m.logs if at_lsn is None or e.base_lsn <= at_lsn + 1]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [[pool.submit(_checked, remote, p.object, p.blake3) for p in e.parts] for e in entries]
        for entry, parts in zip(entries, futures):
            data = b"".join(f.result() for f in parts)
            where = f"{remote.url} log {entry.name}"
            header = decode_file_header(data)
            if header is None or (header.base_lsn, header.salt, header.seq) != (entry.base_lsn, entry.salt, entry.seq):
                raise CorruptionError(where, 0, "log header disagrees with the manifest")
            if at_lsn is not None and entry.last_lsn > at_lsn:
                data = trim_log(data, at_lsn, where)
            atomic_write(os.path.join(directory, entry.name), data)
            written += len(data)
    return written


def resolve_at(m: mf.Manifest, at_lsn: Optional[int], at_time: Optional[float]) -> Optional[int]:
    """The LSN to restore to: ``at_lsn``, the LSN replicated at ``at_time``, or None (the end)."""
    if at_time is not None:
        at_lsn = m.lsn_at(at_time)
    if at_lsn is None:
        return None
    if at_lsn > m.last_lsn:
        raise FormatError(f"the replica ends at LSN {m.last_lsn}; LSN {at_lsn} was never replicated")
    if m.snapshot is not None and at_lsn < m.snapshot.lsn:
        raise FormatError(f"LSN {at_lsn} precedes the replica's snapshot at LSN {m.snapshot.lsn}: history before "
                          "it was compacted away")
    return at_lsn


def load_manifest(remote: Remote) -> mf.Manifest:
    m, _ = mf.load(remote)
    if m is None:
        raise FileNotFoundError(2, "no replica here (no manifest.json)", remote.url)
    m.check(f"{remote.url}/{mf.MANIFEST_OBJECT}")
    return m


def fetch_segments(remote: Remote, state: JournalState, store: Any, threads: int = 8,
                   progress: Optional[Progress] = None) -> int:
    """Download, verify in full and store every segment ``state`` needs; returns the bytes."""
    keys = sorted(state.referenced_keys())

    def one(key: str) -> int:
        data = remote.get(mf.segment_object(key))
        if data is None:
            raise CorruptionError(f"{remote.url}/{mf.segment_object(key)}", None,
                                  f"segment {key} ({state.referenced_keys()[key]}) is missing from the replica")
        store.ingest_stored(key, data[0])
        return len(data[0])

    total = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for done, size in enumerate(pool.map(one, keys), 1):
            total += size
            if progress:
                progress("restoring segments", done, len(keys))
    return total


def restore(remote: Remote, journal: str, *, store: Optional[str] = None, at_lsn: Optional[int] = None,
            at_time: Optional[float] = None, threads: int = 8, progress: Optional[Progress] = None) -> RestoreResult:
    """Restore the replica at ``remote`` into the new directory ``journal`` (see the module docstring)."""
    from kvj.segments.store import SegmentStore

    t0 = time.perf_counter()
    target = os.path.abspath(journal)
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise FileExistsError(17, "refusing to restore over an existing journal (give a new or empty directory)",
                              target)
    m = load_manifest(remote)
    at = resolve_at(m, at_lsn, at_time)
    staging = f"{target}.restoring.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    makedirs_durable(staging)
    try:
        result = RestoreResult(journal=target, snapshot_lsn=m.snapshot.lsn if m.snapshot else None)
        result.bytes = download_journal(remote, m, staging, at, threads)
        state = replay(staging, strict=True)
        want = m.last_lsn if at is None else at
        if state.last_lsn != want:
            raise CorruptionError(remote.url, None, f"the replicated log ends at LSN {state.last_lsn}, the manifest "
                                  f"says {want}")
        root = os.path.abspath(store) if store else default_store_path(staging)
        with SegmentStore(root, threads=threads) as seg_store:
            result.bytes += fetch_segments(remote, state, seg_store, threads, progress)
            result.segments = len(state.referenced_keys())
        result.logs = len([n for n in os.listdir(staging) if n.endswith(".log")])
        result.last_lsn = state.last_lsn
        if os.path.isdir(target):
            os.rmdir(target)
        rename_durable(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.seconds = time.perf_counter() - t0
    return result
