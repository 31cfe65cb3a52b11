"""Kills inside a training save, for the end-to-end training tests.

``python -m kvj.demo.worker train|hf-train`` run with ``inside_save(n)`` in its environment
SIGKILLs itself inside its ``n``-th save, once the save's state document is durable and
before its journal record (the worker's ``KVJ_DEMO_DIE_IN_SAVE`` hook). ``check_died_inside_save``
asserts that is what happened: the document is in the store and no record names it (the
document holds the step, so no earlier save can share its content-addressed key).
"""

from __future__ import annotations

from typing import Dict

import kvj
from kvj.demo.crashrun import Killed
from kvj.segments.store import SegmentStore


def inside_save(n: int) -> Dict[str, str]:
    """The environment that makes a training worker die inside its ``n``-th save."""
    return {"KVJ_DEMO_DIE_IN_SAVE": str(n)}


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
