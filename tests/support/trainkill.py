"""Kills inside a training save, for the end-to-end training tests.

``inside_save(argv, n)`` turns the argv of a training worker (``python -m kvj.demo.worker
train|hf-train ...``) into one that runs it through this module (``python -m
support.trainkill N ...``): it wraps ``SegmentStore.put`` so that the worker SIGKILLs itself
inside its ``n``-th save, once the save's state document is durable and before its journal
record, having written ``{"event": "dying", "key"}`` (the document's segment key) first.
``check_died_inside_save`` asserts that is what happened: the document is in the store and
no record names it (the document holds the step, so no earlier save can share its
content-addressed key).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Dict, List, Tuple

import kvj
from kvj.demo.crashrun import Killed
from kvj.segments.store import SegmentStore

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inside_save(argv: List[str], n: int) -> Tuple[List[str], Dict[str, str]]:
    """The argv and environment that make a training worker die inside its ``n``-th save."""
    at = argv.index("kvj.demo.worker")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    return argv[:at] + ["support.trainkill", str(n)] + argv[at + 1:], env


def die_in_save(n: int) -> None:
    """Wrap ``SegmentStore.put``: SIGKILL this process right after its ``n``-th state document is stored."""
    import torch

    from kvj.demo.worker import emit
    from kvj.integrations.training import TREE

    put, docs = SegmentStore.put, [0]

    def put_then_die(self: SegmentStore, tensor: torch.Tensor, **kwargs: Any) -> Any:
        info = put(self, tensor, **kwargs)
        if (kwargs.get("layout") or {}).get("name") == TREE:
            docs[0] += 1
            if docs[0] == n:
                emit(event="dying", key=info.key)
                os.kill(os.getpid(), signal.SIGKILL)
        return info

    SegmentStore.put = put_then_die  # type: ignore[method-assign]


def check_died_inside_save(journal: str, killed: Killed) -> None:
    dying = killed.last("dying")
    assert dying, "the worker did not reach the save it was to die in"
    key = dying[0]["key"]
    with SegmentStore(f"{journal}/segments") as store:
        assert key in set(store.keys()), "the save's document was not durable before the kill"
    state = kvj.replay(journal)
    records = ([state.checkpoint] if state.checkpoint else []) + list(state.deltas)
    assert key not in {k for record in records for k in record["keys"].values()}, \
        "the kill landed after the save's record"


if __name__ == "__main__":
    from kvj.demo.worker import main

    die_in_save(int(sys.argv[1]))
    main(sys.argv[2:])
