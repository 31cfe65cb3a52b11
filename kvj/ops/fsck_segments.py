"""fsck of the segment store: every segment the live state needs exists with its digest, cached
KV blocks and orphans are intact, and the store's use log is sound; verified in parallel."""

from __future__ import annotations

import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from kvj.journal.config import default_store_path
from kvj.journal.state import JournalState

if TYPE_CHECKING:
    from kvj.ops.fsck import _Checker

USE_LOG_KIND = "use-log-damaged"
#: (kind, reason) of a segment that cannot be used, as ``kvj.segments.check`` reports it.
Problem = Tuple[str, str]


def check_segments(checker: "_Checker", state: JournalState) -> None:
    """Every segment the live state needs is in the store and intact, cached blocks and orphans
    too (damaged ones quarantined under repair or preen), and the store's use log is sound."""
    from kvj.segments.check import opened_store

    with opened_store(checker.store_arg, default_store_path(checker.path), checker.fs) as store:
        _segments(checker, state, store)
        if store is not None:
            _use_log(checker, store.backend.uses)


def _use_log(checker: "_Checker", log: Any) -> None:
    """The store's use log (``kvj.segments.uses``): records failing their CRC before a
    valid one are damage (a warning with its own status bit, ``USE_LOG_DAMAGED``); bytes
    after the last valid record are a torn append, which a crash leaves (a note)."""
    uses = log.read()
    if uses.damaged:
        checker.add("warning", USE_LOG_KIND, f"{uses.damaged} records of the store's use log fail their CRC, with "
                 "valid records after them (damage, not a torn append): eviction order and hit rate leave "
                 "them out; the next kvj compact rewrites the log", log.path, uses.damage_offset)
    if uses.ignored_bytes:
        checker.add("note", "use-log-torn", f"the store's use log ends in {uses.ignored_bytes} bytes of a torn "
                 "append (a crash while appending, or one in progress; the log is advisory): ignored", log.path)


def _segments(checker: "_Checker", state: JournalState, store: Any) -> None:
    referenced = state.referenced_keys()
    digests = _record_digests(state)
    if store is None:
        if referenced:
            checker.add("error", "segment-missing", f"no segment store, but {len(referenced)} segments are needed")
        return
    held = set(store.keys())
    cached = {key: who for key, who in state.cached_keys().items() if key not in referenced}
    orphans = sorted(held - referenced.keys() - cached.keys())
    problems = _verify(checker, store, sorted(referenced) + orphans + sorted(held & cached.keys()), digests)
    for key, who in sorted(referenced.items()):
        problem = problems[key]
        if problem is None:
            continue
        kind, reason = problem
        aside = store.quarantined_copies(key) if kind == "segment-missing" else []
        if aside:  # a known loss: an earlier repair (or a healing put) moved the damaged copy aside
            checker.add("warning", "segment-quarantined", f"{who} needs segment {key}, quarantined as damaged "
                     f"earlier ({aside[-1]}); recovery falls back to the segments before it")
            continue
        finding = checker.add("error", kind, f"{who} needs segment {key}: {reason}; recovery will fall back "
                           "to an older segment or recompute")
        if kind == "segment-damaged":
            # the bytes are out of harm's way and recovery's plan no longer depends on them;
            # the tokens the segment held are lost (recovery says which)
            checker.fix(finding, lambda k=key: f"quarantined as {store.quarantine(k)}; recovery falls back to "
                     "the segments before it")
    checker.result.orphans = orphans
    checker.result.cached = len(held & cached.keys())
    for key in sorted(held & cached.keys()):
        problem = problems[key]
        if problem is not None:
            finding = checker.add("error", problem[0], f"{cached[key]}, segment {key}: {problem[1]} (a cached block: "
                               "a request that needs it recomputes it)")
            checker.fix(finding, lambda k=key: f"quarantined as {store.quarantine(k)}", preen=True)
    if cached.keys() - held:
        checker.add("note", "cache-evicted", f"{len(cached.keys() - held)} cached KV blocks were evicted from the "
                 "store (the next kvj compact drops them from the cache)")
    for key in orphans:
        problem = problems[key]
        if problem is not None:
            finding = checker.add("error", problem[0], f"unreferenced segment {key}: {problem[1]}")
            checker.fix(finding, lambda k=key: f"quarantined as {store.quarantine(k)}", preen=True)
    if orphans:
        checker.add("note", "orphans", f"{len(orphans)} segments no live record references "
                 "(kvj compact collects them after the grace period)")


def _verify(checker: "_Checker", store: Any, keys: List[str], digests: Dict[str, str]) -> Dict[str, Optional[Problem]]:
    """Each key's problem, in parallel: read in full, or its header only when a
    --read-data-subset sample leaves it out."""
    from kvj.segments.check import segment_problem

    full = _sampled(checker, keys)
    results: Dict[str, Optional[Problem]] = {}
    if not keys:
        return results
    threads = verify_threads()
    # keys in batches, a task each: one task per key cost the main thread more (a future, a
    # lock, a wake-up: ~40 µs) than a small segment's check, holding the GIL the checks need
    size = max(1, min(VERIFY_BATCH, -(-len(keys) // (4 * threads))))
    batches = [keys[i:i + size] for i in range(0, len(keys), size)]

    def check(batch: List[str]) -> List[Optional[Problem]]:
        return [segment_problem(store, key, digests.get(key), key in full) for key in batch]

    done = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for batch, problems in zip(batches, pool.map(check, batches)):
            results.update(zip(batch, problems))
            done += len(batch)
            if checker.progress:
                checker.progress("verifying segments", done, len(keys))
    checker.result.segments_checked = len(keys)
    checker.result.data_verified = len(full)
    checker.result.headers_checked = len(keys) - len(full)
    return results


def _sampled(checker: "_Checker", keys: List[str]) -> Set[str]:
    """The keys to read in full: all of them, or a random ``sample`` fraction (at least one)."""
    if checker.sample is None or not keys:
        return set(keys)
    seed = int.from_bytes(os.urandom(4), "little")
    checker.result.sample_seed = seed
    count = min(len(keys), max(1, math.ceil(len(keys) * checker.sample)))
    return set(random.Random(seed).sample(keys, count))


#: The most segments one verification task checks.
VERIFY_BATCH = 256


def verify_threads() -> int:
    """The threads segments are verified on (their reads and hashing overlap)."""
    return min(8, os.cpu_count() or 1)


def _record_digests(state: JournalState) -> Dict[str, str]:
    """Digest each live segment record claims for its key."""
    out: Dict[str, str] = {}
    for req in state.in_flight():
        for ref in req.segments.values():
            if ref.key and ref.digest:
                out[ref.key] = ref.digest
    return out
