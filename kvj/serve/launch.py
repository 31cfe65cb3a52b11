"""Run vLLM's own OpenAI-compatible server (``run_server``) with kvj serve inside it.

``kvj serve`` (``kvj.cli.serve``) parses the command line with vLLM's own parser plus a ``kvj``
group and passes the connector as one more ``--kv-transfer-config`` (``transfer_config``), so
vLLM parses it exactly as from the command line. ``run`` then resumes what the journals hold
(``kvj.serve.restore.prepare``, before vLLM starts), installs the endpoint plugin and hands
over to ``vllm.entrypoints.launchers.api_server.entry.run_server``: vLLM's app, endpoints,
options, ``/health`` and ``/metrics``, in this process.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

from kvj.errors import KvjError

log = logging.getLogger("kvj.serve")

#: Where kvj serve's connector is (vLLM loads it in the engine process).
CONNECTOR = {"kv_connector": "KvjConnector", "kv_connector_module_path": "kvj.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@dataclass(frozen=True)
class Options:
    """kvj serve's own options (the ``kvj`` group of ``kvj serve --help``)."""

    journal: str
    retention: float = 3600.0
    retention_bytes: int = 1 << 30
    admission: str = "arrival"
    store_bytes: Optional[int] = None
    recovery_mode: str = "tolerate-torn-tail"
    source: Optional[str] = None  #: ``--from``: the journal of a kvj serve that handed its replies off here


def transfer_config(options: Options) -> Dict[str, Any]:
    """The ``--kv-transfer-config`` kvj serve gives vLLM: KvjConnector on the journal, the store's budget."""
    extra: Dict[str, Any] = {"journal": options.journal}
    if options.store_bytes is not None:
        extra["max_store_bytes"] = options.store_bytes
    if options.source is not None:
        extra["sources"] = [options.source]  # its blocks load read-only
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def refusal(args: Any) -> Optional[str]:
    """Which ``vllm serve`` mode kvj serve does not run (one API server, one engine), or None."""
    if getattr(args, "headless", False):
        return "--headless (kvj serve runs its API server and engine together)"
    if (getattr(args, "api_server_count", None) or 1) > 1:
        return "--api-server-count above 1 (one API process writes the reply journal)"
    if getattr(args, "grpc", False):
        return "--grpc (kvj serve serves vLLM's HTTP API)"
    if (getattr(args, "data_parallel_size", 1) or 1) > 1:
        return "data parallelism (run one kvj serve, with a journal of its own, per engine)"
    return None


def engine_environment(env: Dict[str, str]) -> None:
    """vLLM's CPU settings kvj serve needs, where the operator set none: a core for the API
    process, and no split of a long sequence's keys among threads, whose sums depend on the batch
    (a resumed reply's tail, computed again in one prefill, would not match the decode steps that
    first computed it: docs/serve.md). Both are read only by vLLM's CPU backend."""
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    env.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")


def run(args: Any, options: Options, say: Any = None) -> None:
    """Resume, then serve until vLLM's server exits (SIGTERM, SIGINT)."""
    import uvloop

    from kvj.serve import determinism
    from kvj.serve.plugin import KvjPlugin, install
    from kvj.serve.restore import prepare
    from kvj.serve.retention import Retention
    from kvj.serve.server import Server

    gone = determinism.missing()
    if gone:
        raise KvjError(f"kvj serve does not know this vLLM ({gone[0]} is gone): it supports vLLM 0.32")
    engine_environment(os.environ)
    if not log.handlers:  # kvj serve's lines among vLLM's, in their form
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("(APIServer pid=%(process)d) %(levelname)s %(asctime)s [kvj serve] "
                                               "%(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    say = say or (lambda line: print(f"kvj serve: {line}", file=sys.stderr, flush=True))
    reply_log, done, lines = prepare(options.journal, options.recovery_mode, options.source)
    for line in lines:
        say(line)
    server = Server(options.journal, reply_log, done.replies, options.admission)
    install(KvjPlugin(server, Retention(options.retention, options.retention_bytes)))
    from vllm.entrypoints.launchers.api_server.entry import run_server

    try:
        uvloop.run(run_server(args))
    finally:
        reply_log.close()
