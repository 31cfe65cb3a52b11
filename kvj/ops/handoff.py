"""Live handoff of a serving engine's requests to another engine: arming, the manifest, the status.

While a handoff is armed (``JOURNAL/handoff.json``, ``kvj.ops.armed``) the vLLM connector
journals each aborted request as a HANDOFF record to the target; once they are durable,
``write_manifest`` writes ``JOURNAL/handoff/manifest-<target>.json`` in the schema of
``kvj recover``'s manifest, so the target resumes them as after a recovery. A durable HANDOFF
has ended the request here; one that is not durable is resumed here by recovery.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from kvj.errors import KvjError
from kvj.fileio import atomic_write, makedirs_durable
from kvj.journal.config import default_store_path
from kvj.journal.replay import replay
from kvj.journal.state import JournalState, RequestState
from kvj.names import check_request_id
from kvj.ops.armed import arm, read_control, write_control
from kvj.ops.recover import MANIFEST_VERSION, _request_entry, plan_request
from kvj.segments.check import Problem, opened_store, segment_problems

#: Where the handoff manifests are written, inside the journal directory.
MANIFEST_DIR = "handoff"


def moved(state: JournalState, to: Optional[str] = None) -> List[RequestState]:
    """Requests a durable HANDOFF record moved (to ``to``, or anywhere), in start order."""
    return sorted((r for r in state.requests.values() if r.moved_to and (to is None or r.moved_to == to)),
                  key=lambda r: r.start_lsn)


def build_manifest(journal: str, to: str, state: Optional[JournalState] = None) -> Dict[str, Any]:
    """The manifest of the requests moved to ``to``: ``kvj recover``'s schema, each segment verified."""
    state = replay(journal) if state is None else state
    requests = moved(state, to)
    store_root = default_store_path(journal)
    needed = [(ref.key, ref.digest) for r in requests for ref in r.segments.values() if ref.key]
    problems: Dict[str, Optional[Problem]] = {}
    if needed:
        with opened_store(None, store_root) as store:
            problems = segment_problems(store, needed)
    entries = [_request_entry(r, plan_request(r, problems)) for r in requests]
    fallbacks = [f"request {e['id']}: resumes at token {e['resume_position']} instead of {e['recorded_position']}"
                 for e in entries if e["fallback"]]
    return {
        "kvj_recovery_manifest": MANIFEST_VERSION, "journal": journal, "store": store_root, "epoch": None,
        "created": time.time(), "recovered_lsn": state.last_lsn, "first_lsn": state.first_lsn,
        "snapshot_lsn": state.snapshot_lsn, "torn_tail": state.tail, "requests": entries,
        "ended_requests": len(state.ended()) + state.ended_compacted,
        "training": {"checkpoint": None, "deltas": [], "step": None, "fallback": None},
        "segments_verified": sum(1 for p in problems.values() if p is None),
        "segments_unusable": sum(1 for p in problems.values() if p is not None),
        "fallbacks": fallbacks, "warnings": state.warnings,
        "tokens": {"restorable": sum(e["resume_position"] for e in entries), "lost": 0},
        "handoff": {"from": journal, "to": to},
    }


def write_manifest(journal: str, to: str) -> Tuple[str, Dict[str, Any]]:
    """Write the handoff manifest (atomically, fsynced) and record the result in the control file."""
    check_request_id(to)
    manifest = build_manifest(journal, to)
    directory = os.path.join(journal, MANIFEST_DIR)
    makedirs_durable(directory)
    path = os.path.join(directory, f"manifest-{to}.json")
    atomic_write(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    control = {**(read_control(journal) or {}), "to": to, "state": "done", "manifest": path,
               "requests": len(manifest["requests"]), "done_at": time.time()}
    write_control(journal, control)
    return path, manifest


def pending(state: JournalState, vllm_ids: List[str]) -> List[str]:
    """The vLLM ids whose request is not journaled as ended yet (its START, or its HANDOFF or END,
    is not durable yet)."""
    latest: Dict[str, RequestState] = {}
    for r in sorted(state.requests.values(), key=lambda r: r.start_lsn):
        latest[str((r.meta or {}).get("vllm_id"))] = r
    return [v for v in vllm_ids if v not in latest or not latest[v].ended]


class HandoffTimeout(KvjError):
    """Requests of an armed handoff were not all journaled as ended in time (the engine was not paused?)."""


def pause_server(url: str, mode: str) -> None:
    """Ask the server at ``url`` to stop its requests: ``abort`` (handed off, the handoff being
    armed) or ``finish`` (they finish there). A ``kvj serve`` does it through its own route
    (``POST /v1/kvj/handoff``: no vLLM dev mode, and it keeps accepting requests; ``VLLM_API_KEY``
    is sent when set); a ``vllm serve`` needs ``VLLM_SERVER_DEV_MODE=1``, which mounts ``POST /pause``
    (it pauses: no new request is scheduled until it is resumed)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    key = os.environ.get("VLLM_API_KEY")
    served = url.rstrip("/") + "/v1/kvj/handoff?" + urllib.parse.urlencode({"mode": mode})
    request = urllib.request.Request(served, method="POST",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            reply.read()
        return
    except urllib.error.HTTPError as exc:
        if exc.code != 404:  # a kvj serve that refused: say why
            raise KvjError(f"kvj serve at {url} refused the handoff: {exc.read().decode(errors='replace')[:300]}") \
                from None
    except (urllib.error.URLError, OSError) as exc:
        raise KvjError(f"cannot reach the server at {url}: {exc}") from None
    target = url.rstrip("/") + "/pause?" + urllib.parse.urlencode({"mode": "abort" if mode == "abort" else "wait"})
    try:
        with urllib.request.urlopen(urllib.request.Request(target, method="POST"), timeout=600) as reply:
            reply.read()
    except (urllib.error.URLError, OSError) as exc:
        raise KvjError(f"cannot pause the server at {url}: {exc} (POST /pause needs VLLM_SERVER_DEV_MODE=1)") from None


def hand_off(journal: str, to: str, *, mode: str = "abort", url: Optional[str] = None,
             timeout: float = 600.0, poll: float = 0.2) -> Tuple[str, Dict[str, Any]]:
    """Arm a handoff, pause the server at ``url`` if given (else the operator pauses it), wait until
    every request in flight when it was armed is journaled as ended (moved, or finished), and
    write the manifest; returns its path and the manifest."""
    arm(journal, to, mode)
    waiting = [r.id for r in replay(journal).in_flight()]
    if url is not None:
        pause_server(url, mode)
    deadline = time.monotonic() + timeout
    while True:
        state = replay(journal)
        left = [rid for rid in waiting if rid in state.requests and not state.requests[rid].ended]
        if not left:
            return write_manifest(journal, to)
        if time.monotonic() > deadline:
            raise HandoffTimeout(f"handoff to {to}: {len(left)} request(s) still in flight after {timeout:g} s "
                                 "(is the engine paused with mode=abort?); the handoff stays armed")
        time.sleep(poll)
