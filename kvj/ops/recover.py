"""Recovery after a crash: what to resume, verified, written down durably (kvj-recover(1)).

``recover(path)`` takes the writer and compactor locks, replays the journal to the end the
recovery ``mode`` allows (point-in-time sets damage aside: ``kvj.ops.salvage``), opens it as
its writer (which cuts a torn tail into ``torn/``), verifies every segment the live state
needs, plans each request in flight (its contiguous good segments from token 0; a missing or
damaged newest segment falls back to the one before) and training (checkpoint plus the
longest verified chain of deltas), writes the plan as ``recovery/manifest-<epoch>.json`` and
then appends a recovery-epoch record naming it. ``dry_run`` takes no lock and changes
nothing. ``load_manifest`` loads the planned segments onto a device and times it;
``kvj.ops.recover_ranks`` recovers a directory of rank journals.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from kvj.errors import InvalidArgument, KvjError, NotFound, SegmentMissing
from kvj.fileio import FS, REAL_FS, atomic_write, makedirs_durable
from kvj.journal.recovery import COMPACT_LOCK, LOCK_NAME, RECOVERY_DIR, DirLock
from kvj.journal.config import default_store_path
from kvj.journal.journal import Journal
from kvj.journal.reader import ABSOLUTE_CONSISTENCY, POINT_IN_TIME, TOLERATE_TORN_TAIL, check_mode
from kvj.journal.replay import check_journal, replay
from kvj.journal.state import JournalState, RequestState, SegmentRef
from kvj.ops.salvage import find_damage
from kvj.ops.salvage import set_aside as set_aside_damage
from kvj.ops.salvage_report import Salvage, clear_pending, load_pending
from kvj.segments.check import Problem, opened_store, segment_problems

if TYPE_CHECKING:
    import torch

MANIFEST_VERSION = 1
MANIFEST_RE = re.compile(r"^manifest-(\d+)\.json$")

Progress = Callable[[str, int, int], None]


@dataclass
class RecoveryResult:
    """The manifest and what recovery did to produce it."""

    manifest: Dict[str, Any]
    manifest_path: Optional[str] = None  # None on a dry run
    epoch_lsn: Optional[int] = None  # LSN of the recovery-epoch record, once durable
    dry_run: bool = False
    load: Optional[Dict[str, Any]] = None  # filled by load_manifest

    @property
    def fallbacks(self) -> List[str]:
        return self.manifest["fallbacks"]


@dataclass
class _Plan:
    segments: List[Dict[str, Any]] = field(default_factory=list)
    dropped: List[Dict[str, Any]] = field(default_factory=list)
    resume_position: int = 0


def _segment_entry(ref: SegmentRef) -> Dict[str, Any]:
    return {"seg": ref.seg, "key": ref.key, "tokens": list(ref.tokens) if ref.tokens else None,
            "layout": ref.layout, "raw_size": ref.raw_size, "stored_size": ref.stored_size,
            "digest": ref.digest, "codec": ref.codec, "lsn": ref.lsn}


def plan_request(req: RequestState, problems: Dict[str, Optional[Problem]]) -> _Plan:
    """Good segments covering tokens from 0 without a gap; everything else dropped, with why."""
    plan = _Plan()
    refs = sorted((r for r in req.segments.values() if r.tokens is not None), key=lambda r: (r.tokens, r.seg))
    pos = 0
    for ref in refs:
        problem = problems.get(ref.key) if ref.key else ("segment-missing", "record has no segment key")
        start, end = ref.tokens  # type: ignore[misc]
        if problem is not None:
            plan.dropped.append({**_segment_entry(ref), "problem": problem[0], "reason": problem[1]})
        elif start > pos:
            plan.dropped.append({**_segment_entry(ref), "problem": "after-gap",
                                 "reason": f"tokens {pos}..{start} before it are not covered by a good segment"})
        else:
            plan.segments.append(_segment_entry(ref))
            pos = max(pos, end)
    plan.resume_position = pos
    return plan


def _request_entry(req: RequestState, plan: _Plan) -> Dict[str, Any]:
    recorded = req.resume_position
    entry = {"id": req.id, "prompt_hash": req.prompt_hash, "tokens": req.tokens, "meta": req.meta,
             "start_lsn": req.start_lsn, "resume_position": plan.resume_position,
             "recorded_position": recorded, "segments": plan.segments, "fallback": None,
             "output": req.output}
    if plan.dropped or plan.resume_position < recorded:
        entry["fallback"] = {"dropped": plan.dropped, "lost_tokens": [plan.resume_position, recorded]}
    return entry


def plan_training(state: JournalState, problems: Dict[str, Optional[Problem]]) -> Dict[str, Any]:
    """The checkpoint and the longest chain of deltas on it whose segments all verified."""
    ckpt = state.checkpoint
    if ckpt is None:
        return {"checkpoint": None, "deltas": [], "step": None, "fallback": None}
    bad = {name: problems[key] for name, key in ckpt["keys"].items() if problems.get(key) is not None}
    if bad:
        return {"checkpoint": None, "deltas": [], "step": None,
                "fallback": {"reason": f"checkpoint at step {ckpt['step']} has unusable segments",
                             "unusable": {name: {"problem": p[0], "reason": p[1]} for name, p in bad.items()}}}
    reachable: Dict[int, List[Dict[str, Any]]] = {ckpt["step"]: []}  # step -> delta chain that reaches it
    skipped = []
    for delta in state.deltas:
        ok = all(problems.get(key) is None for key in delta["keys"].values())
        if ok and delta["base_step"] in reachable:
            reachable[delta["step"]] = reachable[delta["base_step"]] + [delta]
        else:
            skipped.append({"step": delta["step"], "base_step": delta["base_step"],
                            "reason": "unusable segments" if not ok else f"its base step {delta['base_step']} "
                            "cannot be restored"})
    step = max(reachable, key=lambda s: (len(reachable[s]) > 0, s))
    newest = max([ckpt["step"]] + [d["step"] for d in state.deltas])
    fallback = None
    if skipped and step < newest:
        fallback = {"reason": f"resumes at step {step} instead of {newest}", "skipped_deltas": skipped}
    return {"checkpoint": ckpt, "deltas": reachable[step], "step": step, "fallback": fallback}


def build_manifest(state: JournalState, problems: Dict[str, Optional[Problem]], *, journal: str,
                   store: Optional[str], epoch: int) -> Dict[str, Any]:
    """The recovery manifest for ``state`` given each needed segment's verification result."""
    requests = []
    fallbacks: List[str] = []
    for req in sorted(state.in_flight(), key=lambda r: r.start_lsn):
        plan = plan_request(req, problems)
        entry = _request_entry(req, plan)
        requests.append(entry)
        if entry["fallback"]:
            reasons = "; ".join(f"segment {d['seg']} {d['problem']}" for d in plan.dropped)
            fallbacks.append(f"request {req.id}: resumes at token {plan.resume_position} instead of "
                             f"{entry['recorded_position']} ({reasons})")
    training = plan_training(state, problems)
    if training["fallback"]:
        fallbacks.append(f"training: {training['fallback']['reason']}")
    restorable = sum(r["resume_position"] or 0 for r in requests)
    lost = sum(r["fallback"]["lost_tokens"][1] - r["fallback"]["lost_tokens"][0] for r in requests if r["fallback"])
    return {
        "kvj_recovery_manifest": MANIFEST_VERSION,
        "journal": journal, "store": store, "epoch": epoch, "created": time.time(),
        "recovered_lsn": state.last_lsn, "first_lsn": state.first_lsn, "snapshot_lsn": state.snapshot_lsn,
        "torn_tail": state.tail,
        "requests": requests, "ended_requests": len(state.ended()) + state.ended_compacted,
        "training": training,
        "segments_verified": sum(1 for p in problems.values() if p is None),
        "segments_unusable": sum(1 for p in problems.values() if p is not None),
        "fallbacks": fallbacks, "warnings": state.warnings,
        "tokens": {"restorable": restorable, "lost": lost}, "since_previous": since_previous(state),
    }


def since_previous(state: JournalState) -> Dict[str, Any]:
    """What the journal recorded after the previous recovery epoch (or from the start): records,
    requests started and ended, segments flushed (ended requests compacted away are not counted)."""
    prev = state.epochs[-1] if state.epochs else None
    after = prev["lsn"] if prev else 0
    reqs = list(state.requests.values())
    return {"epoch": prev["epoch"] if prev else None, "lsn": after, "time": prev.get("time") if prev else None,
            "records": max(0, state.last_lsn - after),
            "started": sum(1 for r in reqs if r.start_lsn > after),
            "ended": sum(1 for r in reqs if r.ended and (r.end_lsn or 0) > after),
            "segments": sum(1 for r in reqs for ref in r.segments.values() if ref.lsn > after)}


def _needed(state: JournalState) -> List[Tuple[str, Optional[str]]]:
    """(key, claimed digest) of every segment recovery may load."""
    wanted: List[Tuple[str, Optional[str]]] = []
    for req in state.in_flight():
        wanted += [(r.key, r.digest) for r in req.segments.values() if r.key]
    for entry in ([state.checkpoint] if state.checkpoint else []) + state.deltas:
        wanted += [(key, None) for key in entry["keys"].values() if isinstance(key, str)]
    return wanted


def next_epoch(state: JournalState, recovery_dir: str) -> int:
    known = [e["epoch"] for e in state.epochs]
    if os.path.isdir(recovery_dir):
        for name in os.listdir(recovery_dir):
            m = MANIFEST_RE.match(name)
            if m:
                known.append(int(m.group(1)))
    return max(known, default=0) + 1


def recover(path: str, store: Any = None, *, dry_run: bool = False, mode: str = TOLERATE_TORN_TAIL,
            fs: FS = REAL_FS, progress: Optional[Progress] = None, mirror: Optional[str] = None,
            mirror_policy: str = "fail") -> RecoveryResult:
    """Recover the journal at ``path`` (``store``: a ``SegmentStore`` or its root, default
    ``<journal>/segments``). ``JournalLocked`` while a writer or compactor runs;
    ``CorruptionError`` (nothing changed) for damage the ``mode`` does not end the log at;
    ``LegacyJournal`` for a seed-era journal. ``mirror``/``mirror_policy`` go to ``Journal.open``."""
    check_mode(mode)
    until_damage = mode == POINT_IN_TIME
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise NotFound(f"no journal at {path}")
    check_journal(path)  # a seed-era journal: LegacyJournal, nothing written
    recovery_dir = os.path.join(path, RECOVERY_DIR)
    if store is None:
        store_root: Optional[str] = default_store_path(path)
    elif isinstance(store, (str, os.PathLike)):
        store_root = os.path.abspath(os.fspath(store))
    else:
        store_root = getattr(getattr(store, "backend", None), "root", None)
    found = find_damage(path) if until_damage else None
    if mode == ABSOLUTE_CONSISTENCY:
        replay(path, strict=True)  # a torn tail is an error too: refused before anything (a lock file) is written
    _require_store(path, store, store_root, found.kept_state if found else None)
    if dry_run:
        return _recover(path, store, store_root, recovery_dir, dry_run, fs, None, progress, _with_pending(path, found))
    compactor = DirLock(path, COMPACT_LOCK, "compactor").acquire()
    try:
        salvage = _with_pending(path, None)
        writer = DirLock(path, LOCK_NAME, "writer").acquire()
        try:
            if found is not None:
                found = find_damage(path)  # again, under the locks: what is set aside is what was found
                if found is not None:
                    salvage = _with_pending(path, found)
                    set_aside_damage(path, found, fs, report=salvage)
            # Replayed before the writer opens the journal and cuts its torn tail: damage is refused
            # here with nothing changed, and the state keeps what the tail was (its records, its bytes).
            state: Optional[JournalState] = replay(path, strict=mode == ABSOLUTE_CONSISTENCY)
        finally:
            writer.release()
        with Journal.open(path, create=False, fs=fs, mirror=mirror, mirror_policy=mirror_policy) as journal:
            if state is not None and journal.writer.last_lsn != state.last_lsn:
                state = None  # a writer came and went between the locks: replay what it left
            result = _recover(path, store, store_root, recovery_dir, dry_run, fs, journal, progress, salvage, state)
        clear_pending(path, fs)  # the epoch record that carries the report is durable
        return result
    finally:
        compactor.release()


def _with_pending(path: str, found: Optional[Salvage]) -> Optional[Salvage]:
    """The salvage this recovery reports: an interrupted salvage's pending report (unless an
    epoch record already carries it), completed by what ``found`` adds, or ``found`` alone."""
    pending = load_pending(path)
    if pending is None:
        return found
    if found is None:
        return pending  # whether an epoch record carries it is checked against the replayed state
    if _recorded(found.kept_state, pending):
        return found
    return pending.merged(found)


def _recorded(state: Optional[JournalState], salvage: Salvage) -> bool:
    return state is not None and any((e.get("salvage") or {}).get("id") == salvage.id for e in state.epochs)


def _require_store(path: str, store: Any, store_root: Optional[str], state: Optional[JournalState]) -> None:
    """Refuse (``NotFound``, before anything is written) a missing or empty store when the
    journal needs segments: a mistyped ``--store`` or ``KVJ_STORE`` must not turn into a
    manifest in which every request resumes at token 0. An empty store that quarantined one
    of the needed segments (``kvj fsck --repair``) is this journal's store: those are known
    losses, and recovery falls back past them as fsck said it would."""
    needed: Optional[set] = None
    with opened_store(store, store_root or "") as seg_store:
        if seg_store is not None and next(iter(seg_store.keys()), None) is not None:
            return
        needed = {key for key, _digest in _needed(state if state is not None else replay(path))}
        if seg_store is not None and any(seg_store.quarantined_copies(key) for key in needed):
            return
    if needed:
        state = "holds no segments" if seg_store is not None else "does not exist"
        raise NotFound(f"segment store {store_root} {state}, but the journal needs {len(needed)} segments: "
                       "wrong --store or KVJ_STORE? Nothing was changed")


def _recover(path: str, store: Any, store_root: Optional[str], recovery_dir: str, dry_run: bool,
             fs: FS, journal: Optional[Journal], progress: Optional[Progress],
             salvage: Optional[Salvage] = None, state: Optional[JournalState] = None) -> RecoveryResult:
    if state is None:
        state = (salvage.kept_state if salvage is not None and dry_run and salvage.kept_state is not None
                 else replay(path))
    if salvage is not None and _recorded(state, salvage):
        salvage = None  # a pending report whose epoch record is durable: only its file was left
    cut = journal.cut_tail if journal is not None else None
    problems: Dict[str, Optional[Problem]] = {}
    needed = _needed(state)
    if needed:
        with opened_store(store, store_root or "", fs) as seg_store:
            problems = segment_problems(seg_store, needed, progress)
    epoch = next_epoch(state, recovery_dir)
    manifest = build_manifest(state, problems, journal=path, store=store_root, epoch=epoch)
    if cut is not None:
        manifest["torn_tail"] = {**(manifest["torn_tail"] or {}), "kept_at": cut, "length": os.path.getsize(cut)}
    if salvage is not None:
        manifest["salvage"] = salvage.to_dict()
    result = RecoveryResult(manifest, dry_run=dry_run)
    if dry_run:
        return result
    makedirs_durable(recovery_dir, fs)
    target = os.path.join(recovery_dir, f"manifest-{epoch:06d}.json")
    atomic_write(target, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode(), fs)
    result.manifest_path = target
    if journal is not None:  # the manifest is durable before the record that points at it
        result.epoch_lsn = journal.epoch(epoch, manifest["recovered_lsn"], os.path.relpath(target, path),
                                         salvage=salvage.epoch_record() if salvage is not None else None)
    return result


def manifest_keys(manifest: Dict[str, Any]) -> List[str]:
    """Every distinct segment key a manifest plans to load, requests first, then training."""
    keys: List[str] = []
    for req in manifest["requests"]:
        keys += [s["key"] for s in req["segments"] if s.get("key")]
    training = manifest["training"]
    for entry in ([training["checkpoint"]] if training["checkpoint"] else []) + training["deltas"]:
        keys += [k for k in entry["keys"].values() if isinstance(k, str)]
    return list(dict.fromkeys(keys))


def check_device(device: str) -> "torch.device":
    """The device ``device`` names, if tensors can be placed on it here; else ``InvalidArgument``.

    Called before recovery writes anything, so a device that cannot work (``bogus``,
    ``cuda:0`` without CUDA, ``cuda:7`` on a 1-GPU machine) changes nothing.
    """
    import torch

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidArgument("CUDA is not available on this machine")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise InvalidArgument(f"this machine has {torch.cuda.device_count()} CUDA devices")
        elif dev.type != "cpu":
            torch.empty(0, device=dev)  # any other backend: can a tensor live there?
    except (InvalidArgument, RuntimeError, TypeError, ValueError, AssertionError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise InvalidArgument(f"cannot load onto device {device!r}: {reason}") from None
    return dev


def load_manifest(manifest: Dict[str, Any], store: Any, device: str, *, workers: Optional[int] = None,
                  progress: Optional[Progress] = None) -> Dict[str, Any]:
    """Load every segment the manifest plans onto ``device``; returns counts, bytes, seconds, GB/s.

    Segments load in parallel through ``kvj.restore`` (pinned staging for CUDA); each tensor
    is dropped once loaded, so memory stays bounded: this proves and times the restore
    path, and the server loads for itself. A segment that fails is listed under ``failed``.
    """
    import torch

    from kvj.segments import device as cuda
    from kvj.segments.load import load
    from kvj.segments.staging import StagingPool

    dev = check_device(device)
    dev = cuda.CUDA.resolve(dev)  # here, in the caller's thread: a bare "cuda" is its current device
    keys = manifest_keys(manifest)
    failed: List[Dict[str, str]] = []
    nbytes = 0
    with opened_store(store, manifest.get("store") or "") as seg_store:
        if seg_store is None and keys:
            raise SegmentMissing(f"no segment store at {store}")
        staging = StagingPool(1 << 30, pinned=True) if dev.type == "cuda" else None

        def one(key: str) -> int:
            tensor = load(seg_store, key, dev, staging=staging)
            return tensor.numel() * tensor.element_size()

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 2)) as pool:
            futures = {key: pool.submit(one, key) for key in keys}
            for i, (key, future) in enumerate(futures.items(), 1):
                try:
                    nbytes += future.result()
                except (KvjError, OSError) as exc:
                    failed.append({"key": key, "reason": str(exc)})
                if progress:
                    progress(f"loading onto {device}", i, len(keys))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - start
    return {"device": str(dev), "segments": len(keys) - len(failed), "bytes": nbytes, "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0, "failed": failed}
