"""Recovery of a tensor/pipeline-parallel engine's directory of rank journals (``kvj.journal.ranks``):
each rank as ``recover`` does, then one manifest for the engine whose resume positions are the
minimum over the ranks."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from kvj.errors import FormatError, NotFound
from kvj.fileio import FS, REAL_FS, atomic_write, makedirs_durable
from kvj.journal import ranks
from kvj.journal.reader import TOLERATE_TORN_TAIL, list_logs
from kvj.journal.recovery import COMPACT_LOCK, RECOVERY_DIR, DirLock
from kvj.journal.snapshot import list_snapshots
from kvj.journal.state import JournalState
from kvj.ops.recover import MANIFEST_VERSION, Progress, RecoveryResult, next_epoch, recover


def recover_ranks(path: str, *, dry_run: bool = False, mode: str = TOLERATE_TORN_TAIL, fs: FS = REAL_FS,
                  progress: Optional[Progress] = None) -> RecoveryResult:
    """Recover every rank journal of a directory of rank journals (``kvj.journal.ranks``), each as
    ``recover`` does (its own manifest and epoch record), and write one manifest for the engine,
    ``<path>/recovery/manifest-<epoch>.json`` (``merge_rank_manifests``): each request's resume
    position is the minimum over the ranks. A rank that never made its journal holds nothing.
    Holds the directory's compactor lock (``kvj prune`` takes it to remove old engine manifests)."""
    path = os.path.abspath(path)
    journals = ranks.rank_journals(path)
    if not journals:
        raise NotFound(f"{path} holds no rank journals ({ranks.RANKS_FILE} is missing)")
    compactor = None if dry_run else DirLock(path, COMPACT_LOCK, "compactor").acquire()
    try:
        per_rank: Dict[str, Optional[RecoveryResult]] = {}
        for (t, p), journal in journals.items():
            made = os.path.isdir(journal) and bool(list_logs(journal) or list_snapshots(journal))
            per_rank[ranks.rank_name(t, p)] = (recover(journal, dry_run=dry_run, mode=mode, fs=fs, progress=progress)
                                               if made else None)
        recovery_dir = os.path.join(path, RECOVERY_DIR)
        epoch = next_epoch(JournalState(), recovery_dir)
        manifest = merge_rank_manifests({name: r.manifest if r is not None else None for name, r in per_rank.items()},
                                        journal=path, epoch=epoch)
        for name, r in per_rank.items():
            if r is not None:
                manifest["ranks"][name].update(manifest_path=r.manifest_path, epoch_lsn=r.epoch_lsn)
        result = RecoveryResult(manifest, dry_run=dry_run)
        if not dry_run:
            makedirs_durable(recovery_dir, fs)
            target = os.path.join(recovery_dir, f"manifest-{epoch:06d}.json")
            atomic_write(target, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode(), fs)
            result.manifest_path = target
        return result
    finally:
        if compactor is not None:
            compactor.release()


def merge_rank_manifests(manifests: Dict[str, Optional[Dict[str, Any]]], *, journal: str,
                         epoch: int) -> Dict[str, Any]:
    """One engine's manifest from its ranks' (rank name -> manifest; None: that rank has no journal).

    A request is listed if it is in flight on any rank; its resume position is the minimum over
    all ranks (absent on a rank: 0), its segments those of the rank with the most durable tokens
    up to that position. Its tokens are that rank's: every rank journaled the same tokens, and
    any rank's durable ones were generated (a rank whose tokens contradict another's is an error).
    """
    names = sorted(manifests)
    entries: Dict[str, Dict[str, Dict[str, Any]]] = {}  # request id -> rank -> entry
    for name in names:
        for entry in (manifests[name] or {}).get("requests", []):
            entries.setdefault(entry["id"], {})[name] = entry
    requests, fallbacks = [], []
    for rid, by_rank in entries.items():
        ref = max(by_rank.values(), key=lambda e: len(e.get("output") or []))
        known = (ref.get("tokens") or []) + (ref.get("output") or [])
        for name, e in by_rank.items():
            mine = (e.get("tokens") or []) + (e.get("output") or [])
            if known[:len(mine)] != mine:
                raise FormatError(f"request {rid}: rank journal {name} holds other tokens than another rank's")
        positions = {name: (by_rank[name]["resume_position"] or 0) if name in by_rank else 0 for name in names}
        position = min(positions.values())
        recorded = max(e["recorded_position"] or 0 for e in by_rank.values())
        dropped = [{**d, "rank": name} for name, e in by_rank.items() for d in (e.get("fallback") or {}).get("dropped", [])]
        entry = {**ref, "resume_position": position, "recorded_position": recorded,
                 "segments": [s for s in ref["segments"] if s["tokens"] and s["tokens"][1] <= position],
                 "ranks": {name: {"resume_position": positions[name], "in_flight": name in by_rank} for name in names},
                 "fallback": None}
        if dropped or position < recorded:
            entry["fallback"] = {"dropped": dropped, "lost_tokens": [position, recorded]}
            behind = ", ".join(f"{name} at {n}" for name, n in positions.items() if n == position)
            fallbacks.append(f"request {rid}: resumes at token {position} instead of {recorded} ({behind})")
        requests.append(entry)
    present = [m for m in manifests.values() if m is not None]
    return {
        "kvj_recovery_manifest": MANIFEST_VERSION, "journal": journal, "store": None, "epoch": epoch,
        "created": time.time(), "recovered_lsn": None, "first_lsn": None, "snapshot_lsn": None, "torn_tail": None,
        "ranks": {name: ({"recovered_lsn": m["recovered_lsn"], "epoch": m["epoch"], "requests": len(m["requests"])}
                         if m is not None else {"recovered_lsn": None, "epoch": None, "requests": 0})
                  for name, m in manifests.items()},
        "requests": requests, "ended_requests": min((m["ended_requests"] for m in present), default=0),
        "training": {"checkpoint": None, "deltas": [], "step": None, "fallback": None},
        "segments_verified": sum(m["segments_verified"] for m in present),
        "segments_unusable": sum(m["segments_unusable"] for m in present),
        "fallbacks": fallbacks, "warnings": [f"{name}: {w}" for name, m in manifests.items() if m for w in m["warnings"]],
        "tokens": {"restorable": sum(r["resume_position"] for r in requests),
                   "lost": sum(r["fallback"]["lost_tokens"][1] - r["fallback"]["lost_tokens"][0]
                               for r in requests if r["fallback"])},
        "since_previous": None,
    }
