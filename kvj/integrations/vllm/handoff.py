"""Hand a vLLM engine's live requests off to another engine (imports without vLLM).

Engine A (journal ``JA``) runs ``KvjConnector``; engine B runs it with a journal of its own and
``"sources": [JA]``, so that it may load A's durable blocks, read-only (it never writes there).

**Drain A.** ``drain(llm_a, "B")`` (an offline ``LLM``), or for a server ``kvj handoff JA --to B``
followed by vLLM's pause with ``mode=abort``:

1. ``kvj.ops.armed.arm`` writes ``JA/handoff.json`` (atomically): armed, target ``B``;
2. vLLM aborts every request (``drain``: ``LLMEngine.abort_request`` of all it has;
   a server: ``pause_scheduler(mode="abort")``, which calls ``scheduler.finish_requests``):
   for each, the connector's ``request_finished`` sees the control file (one ``stat`` per
   aborted request; nothing on the steps' hot path) and plans a HANDOFF to ``B`` instead of an
   END. The worker saves the blocks it computed and not yet saved, journals its tokens, and
   appends the HANDOFF record after its segments, exactly where an END would go;
3. once every aborted request's record is durable (read from the journal on disk, lock-free,
   as ``kvj status`` reads it), ``kvj.ops.handoff.write_manifest`` writes
   ``JA/handoff/manifest-B.json``, ``kvj recover``'s manifest schema, and records the result.

**Continue on B.** ``resume(llm_b, manifest)``: B's connector counts A's durable blocks of its own
layout seed as loadable, so each request loads its blocks from A's store and vLLM computes only
what follows its last durable block; B's START names the request it continues (``resumes``)
and A's journal (``from``), and B never writes an END for A's id (it ended in A's journal).

**Keys.** Blocks are named by chain keys from the layout seed (weights' digest, dtypes,
geometry, block size, parallel sizes: ``kvj.segments.kvblock``; the digest is of the weight
files' bytes, not their path), so B loads A's blocks only when they agree; when they do not,
B logs one line naming both seeds and loads nothing (its counters show nothing restored).

Limits: engines of one rank (tensor- and pipeline-parallel handoff is refused by ``arm``);
``mode="finish"`` lets vLLM finish the requests and hands nothing off.
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

