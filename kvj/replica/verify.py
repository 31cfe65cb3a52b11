"""Check a replica without restoring it (like ``wal-g wal-verify``): the replicated log's
continuity, and every segment it needs present, a ``sample`` of them read in full."""

from __future__ import annotations

import math
import random
import secrets
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from kvj.errors import CorruptionError, FormatError
from kvj.journal.replay import replay
from kvj.replica import manifest as mf
from kvj.replica.pull import Progress, download_journal, load_manifest, segment_sizes
from kvj.replica.remote import Remote


@dataclass
class VerifyReport:
    """What ``verify_remote`` checked and found; ``ok`` when nothing is wrong."""

    url: str = ""
    last_lsn: int = 0
    snapshot_lsn: Optional[int] = None
    logs: int = 0
    parts: int = 0
    segments_needed: int = 0
    segments_present: int = 0
    segments_read: int = 0
    sample: float = 1.0
    seed: int = 0
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _read_segment(remote: Remote, key: str, size: int) -> Optional[str]:
    """What is wrong with segment ``key``'s object, read in full; None if nothing."""
    from kvj.segments import segfile

    obj = mf.segment_object(key)
    try:
        header = segfile.verify(remote.read(obj, size), name=f"{remote.url}/{obj}")
    except FileNotFoundError:
        return f"segment {key}: missing"
    except (CorruptionError, FormatError) as exc:
        return f"segment {key}: {exc}"
    if header.digest.hex() != key:
        return f"segment {key}: its content digest is {header.digest.hex()}"
    return None


def verify_remote(remote: Remote, *, sample: float = 1.0, seed: Optional[int] = None, threads: int = 8,
                  progress: Optional[Progress] = None) -> VerifyReport:
    """Verify the replica at ``remote``; the sample is chosen with ``seed`` (random if None, reported)."""
    if not 0.0 < sample <= 1.0:
        raise FormatError(f"sample {sample} is not a fraction in (0, 1]")
    report = VerifyReport(url=remote.url, sample=sample, seed=secrets.randbelow(1 << 31) if seed is None else seed)
    try:
        m = load_manifest(remote)
    except CorruptionError as exc:
        report.problems.append(str(exc))
        return report
    report.last_lsn, report.logs = m.last_lsn, len(m.logs)
    report.snapshot_lsn = m.snapshot.lsn if m.snapshot else None
    report.parts = sum(len(e.parts) for e in m.logs)
    with tempfile.TemporaryDirectory(prefix="kvj-verify-") as tmp:
        try:
            download_journal(remote, m, tmp, None, threads)
            state = replay(tmp, strict=True)
        except (CorruptionError, FormatError, FileNotFoundError) as exc:
            report.problems.append(str(exc))
            return report
    if state.last_lsn != m.last_lsn:
        report.problems.append(f"the replicated log ends at LSN {state.last_lsn}, the manifest says {m.last_lsn}")
    segments = segment_sizes(remote, state)
    report.segments_needed = len(state.referenced_keys())
    report.segments_present = report.segments_needed - segments.missing
    report.problems += segments.problems
    sizes = segments.sizes
    present = sorted(sizes)
    chosen = random.Random(report.seed).sample(present, math.ceil(len(present) * sample)) if present else []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for done, problem in enumerate(pool.map(lambda k: _read_segment(remote, k, sizes[k]), chosen), 1):
            report.segments_read += 1
            if problem:
                report.problems.append(problem)
            if progress:
                progress("reading segments", done, len(chosen))
    return report
