"""kvj serve inside vLLM's own server, through vLLM 0.32's endpoint-plugin hook.

``install`` wraps ``vllm.plugins.load_endpoint_plugins`` in this process only (no entry point,
no ``VLLM_PLUGINS``) so that vLLM's ``build_app`` also attaches ``KvjPlugin``: its routes replace
vLLM's of the same path and method (``kvj.serve.routes``). ``init_state`` runs once the engine is
up, on uvicorn's event loop, before the server listens: it takes the engine's ``generate`` (the
choke point), the determinism shims, SIGTERM's ``shutdown``, records the ``/dev/shm`` names the
engine mapped, and starts the restored replies' drives and the retention loop, which run while
new requests are served.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Optional

from kvj.errors import KvjError
from kvj.serve import determinism, shm
from kvj.serve.retention import Retention
from kvj.serve.server import Server

log = logging.getLogger("kvj.serve")


class KvjPlugin:
    """vLLM's ``EndpointPlugin`` protocol, for kvj serve."""

    name = "kvj"
    required_tasks = ("generate",)

    def __init__(self, server: Server, retention: Retention):
        self.server = server
        self.retention = retention
        self._loop_task: Optional["asyncio.Task[Any]"] = None

    def attach_router(self, app: Any) -> None:
        """vLLM's ``build_app``: kvj's routes, replacing vLLM's of the same path and method."""
        from kvj.serve.routes import attach

        attach(app)
        app.state.kvj_server = self.server

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """vLLM's ``init_app_state``, the engine up: take over (module docstring)."""
        if engine_client is None:
            raise KvjError("kvj serve needs an engine (not vLLM's render-only server)")
        determinism.install()
        state.kvj_server = self.server
        self.server.attach(engine_client, state)
        loop = asyncio.get_running_loop()
        _wrap_shutdown(engine_client, self.server, loop)
        try:
            shm.record(self.server.journal)
        except OSError as exc:  # the ledger only helps the next start clean up
            log.warning("kvj serve: the /dev/shm ledger could not be written: %s", exc)
        self._loop_task = loop.create_task(self.retention.run(self.server))
        restored = len([r for r in self.server.restored if not r.finished])
        log.info("kvj serve: engine up; %d replies resuming in the background, %d held", restored,
                 len(self.server.restored) - restored)


def _wrap_shutdown(engine_client: Any, server: Server, loop: asyncio.AbstractEventLoop) -> None:
    """vLLM's SIGTERM calls ``engine_client.shutdown`` in a thread: kvj first ends its streams and drives
    (whose engine requests are then parked, not ended) and makes its reply journal durable."""
    original = engine_client.shutdown
    loop_thread = threading.get_ident()

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        try:
            if server.closing:
                pass
            elif threading.get_ident() == loop_thread:  # vLLM's last call, on the loop: it cannot wait here
                server.close_now()
                server.log.sync()
            else:  # SIGTERM's, from a thread of vLLM's
                asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout=30)
        except Exception as exc:  # vLLM's own shutdown must run whatever happened here
            log.warning("kvj serve: closing replies at shutdown: %r", exc)
        return original(*args, **kwargs)

    engine_client.shutdown = shutdown


def install(plugin: KvjPlugin) -> None:
    """Make vLLM's app load ``plugin`` with its endpoint plugins (this process only)."""
    import vllm.plugins as plugins

    original = plugins.load_endpoint_plugins

    def load_endpoint_plugins(supported_tasks: Any = None) -> Any:
        return [*original(supported_tasks), plugin]

    plugins.load_endpoint_plugins = load_endpoint_plugins
