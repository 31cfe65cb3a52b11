"""Retention for what kvj sets aside and never removes by itself (``torn/``, ``recovery/``, the
store's quarantine): ``prune`` removes what is older than an age, always keeping the newest
recovery manifest, under the compactor lock; ``prune_engine`` does it for an engine
directory's own manifests.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from kvj.errors import InvalidArgument, NotFound
from kvj.fileio import FS, READ_ONLY_FS, REAL_FS, list_dir
from kvj.journal.recovery import COMPACT_LOCK, RECOVERY_DIR, TORN_DIR, DirLock
from kvj.journal.ranks import RANKS_FILE, holds_ranks
from kvj.journal.replay import check_journal
from kvj.ops.recover import MANIFEST_RE
from kvj.segments.check import opened_store


@dataclass
class PruneResult:
    """What ``prune`` removed (or, for a dry run, would remove), per folder."""

    older_than: float
    removed: Dict[str, List[str]] = field(default_factory=lambda: {"torn": [], "recovery": [], "quarantine": []})
    kept_newest_manifest: Optional[str] = None
    bytes_reclaimed: int = 0
    dry_run: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _set_aside_at(path: str) -> float:
    """When a file was put where it is: its inode change time, which a rename sets (a log file
    moved to torn/ or a segment moved to quarantine keeps its old modification time)."""
    st = os.stat(path, follow_symlinks=False)
    return max(st.st_mtime, st.st_ctime)


def _old_files(directory: str, cutoff: float) -> List[str]:
    """Plain files directly in ``directory`` put there before ``cutoff``, oldest first."""
    found = []
    for name in list_dir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not os.path.islink(path) and _set_aside_at(path) < cutoff:
            found.append((_set_aside_at(path), path))
    return [path for _when, path in sorted(found)]


def _cutoff(older_than: float, now: Optional[float]) -> float:
    """The time before which what was set aside goes: ``older_than`` seconds before ``now``."""
    if older_than < 0:
        raise InvalidArgument("the age cannot be negative")
    return (time.time() if now is None else now) - older_than


@contextmanager
def _compactor(directory: str, dry_run: bool) -> Iterator[None]:
    """Hold ``directory``'s compactor lock: exclusive, or shared for a dry run (which creates no lock file)."""
    compactor = DirLock(directory, COMPACT_LOCK, "compactor")
    lock = compactor.acquire_shared() if dry_run else compactor.acquire()
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _manifests(directory: str, cutoff: float, result: PruneResult) -> Tuple[str, List[str]]:
    """``directory``'s recovery/ and its files put there before ``cutoff``, but the newest
    manifest, which ``result`` records as kept."""
    recovery_dir = os.path.join(directory, RECOVERY_DIR)
    manifests = sorted(n for n in list_dir(recovery_dir) if MANIFEST_RE.match(n))
    newest = os.path.join(recovery_dir, manifests[-1]) if manifests else None
    result.kept_newest_manifest = newest
    return recovery_dir, [p for p in _old_files(recovery_dir, cutoff) if p != newest]


def _remove(plan: Dict[str, Tuple[str, List[str]]], result: PruneResult, fs: FS) -> None:
    """Remove (unless ``result`` is a dry run's) the files ``plan`` lists per folder, each folder
    made durable once; ``result`` says what went and how many bytes."""
    for folder, (directory, paths) in plan.items():
        for path in paths:
            result.bytes_reclaimed += os.stat(path, follow_symlinks=False).st_size
            if not result.dry_run:
                fs.unlink(path)
            result.removed[folder].append(path)
        if paths and not result.dry_run:
            fs.fsync_dir(directory)


def prune(journal: str, store: Any = None, *, older_than: float, now: Optional[float] = None, dry_run: bool = False,
          fs: FS = REAL_FS) -> PruneResult:
    """Remove set-aside files, recovery manifests and quarantined segments older than
    ``older_than`` seconds (see the module docstring)."""
    cutoff = _cutoff(older_than, now)
    journal = os.path.abspath(journal)
    check_journal(journal)  # a seed-era journal: LegacyJournal
    fs = READ_ONLY_FS if dry_run else fs
    result = PruneResult(older_than, dry_run=dry_run)
    with _compactor(journal, dry_run):
        torn_dir = os.path.join(journal, TORN_DIR)
        plan = {"torn": (torn_dir, _old_files(torn_dir, cutoff)), "recovery": _manifests(journal, cutoff, result)}
        with opened_store(store, os.path.join(journal, "segments"), fs) as seg_store:
            if seg_store is not None:
                aside = seg_store.quarantined_copies()
                plan["quarantine"] = (os.path.dirname(aside[0]) if aside else "",
                                      [p for p in aside if _set_aside_at(p) < cutoff])
        _remove(plan, result, fs)
        return result


def prune_engine(path: str, *, older_than: float, now: Optional[float] = None, dry_run: bool = False,
                 fs: FS = REAL_FS) -> PruneResult:
    """Remove the recovery manifests older than ``older_than`` seconds, but the newest, that
    ``kvj recover`` wrote for the engine directory ``path`` (``recover_ranks``), under the
    directory's compactor lock, which engine recovery holds; its rank journals are ``prune``'s."""
    cutoff = _cutoff(older_than, now)
    path = os.path.abspath(path)
    if not holds_ranks(path):
        raise NotFound(f"{path} is not a directory of rank journals (no {RANKS_FILE})")
    fs = READ_ONLY_FS if dry_run else fs
    result = PruneResult(older_than, removed={"recovery": []}, dry_run=dry_run)
    with _compactor(path, dry_run):
        _remove({"recovery": _manifests(path, cutoff, result)}, result, fs)
        return result
