"""Hand a vLLM engine's live requests off to another engine (imports without vLLM; docs/handoff.md).

``drain(llm_a, "B")`` arms the handoff (``kvj.ops.armed``: ``JA/handoff.json``), aborts every request
(the connector then journals a HANDOFF to B after each request's segments instead of an END), waits
until every HANDOFF is durable and writes the manifest (``kvj.ops.handoff``) that ``resume(llm_b,
manifest)`` continues from, B's connector loading A's blocks read-only (``"sources": [JA]``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from kvj.errors import KvjError
from kvj.journal.replay import replay
from kvj.ops.armed import arm, armed_target
from kvj.ops.handoff import pending, write_manifest

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["arm", "armed_target", "drain", "engine_journal"]


def engine_journal(llm: "LLM") -> str:
    """The journal of ``llm``'s KvjConnector (its ``kv_connector_extra_config["journal"]``)."""
    transfer = llm.llm_engine.vllm_config.kv_transfer_config
    journal = (transfer.kv_connector_extra_config or {}).get("journal") if transfer is not None else None
    if not journal:
        raise KvjError("this engine runs no KvjConnector (no kv_connector_extra_config['journal'])")
    return os.path.abspath(str(journal))


def drain(llm: "LLM", to: str, *, timeout: float = 600.0, poll: float = 0.05) -> str:
    """Hand every request ``llm`` has in flight off to engine ``to``; returns the manifest's path.

    Arms the handoff, aborts the requests (vLLM stops them; their KV and tokens are made
    durable and each is journaled as moved to ``to``), waits until every HANDOFF record is
    durable (stepping an engine whose core runs in this process), and writes the manifest
    ``resume(llm_to, path)`` continues them from. The engine keeps running: requests it
    takes later are served (and, while the handoff stays armed, handed off again if aborted).
    """
    from vllm.v1.engine.core_client import InprocClient

    journal = engine_journal(llm)
    arm(journal, to)
    engine = llm.llm_engine
    ids = list(engine.output_processor.request_states)  # vLLM's internal ids: the connector's
    if ids:
        engine.abort_request(ids, internal=True)
    # The worker journals the moves at the engine's next steps: an engine core in another
    # process takes them on its own; one in this process only when stepped (it never blocks).
    in_process = isinstance(engine.engine_core, InprocClient)
    deadline = time.monotonic() + timeout
    while True:
        if in_process:
            engine.step()
        try:
            left = pending(replay(journal), ids)
        except KvjError:
            left = ids  # caught mid-write of its first file; read again
        if not left:
            break
        if time.monotonic() > deadline:
            raise KvjError(f"handoff to {to}: {len(left)} request(s) not journaled as moved after {timeout:.0f} s")
        time.sleep(poll)
    path, _ = write_manifest(journal, to)
    return path

