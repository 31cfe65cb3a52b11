"""The running server's replies: the registry, the drives through vLLM's handlers, cancel, shutdown.

A *drive* is one run of vLLM's own handler (``create_chat_completion``, ``create_completion``,
``create_responses``) for a reply, in a task of kvj's with the reply in its context
(``kvj.serve.determinism.DRIVE``): live (the engine), or again from the reply's tokens alone when
its events were dropped from memory. Its events are kept as frames; readers follow them. A
client that goes away ends its reader, never the drive. Shutdown (SIGTERM) ends the readers
without a terminal event and cancels the drives: vLLM aborts their engine requests, which the
connector parks (no END), and the next start continues them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from http import HTTPStatus
from typing import Any, AsyncIterator, Dict, List, Optional

from kvj.serve import frames as wire
from kvj.serve.determinism import DRIVE, Drive
from kvj.serve.engine import Engine, Halt, PromptChanged, mark_cancel
from kvj.serve.replies import Reply, ReplyLog

log = logging.getLogger("kvj.serve")

#: The vLLM handler (app.state attribute) and its method, by reply kind.
HANDLERS = {"chat": ("openai_serving_chat", "create_chat_completion"),
            "completion": ("openai_serving_completion", "create_completion"),
            "responses": ("openai_serving_responses", "create_responses")}


def request_model(kind: str, body: Dict[str, Any]) -> Any:
    """vLLM's request object of a reply's body."""
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as model
    elif kind == "completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as model
    else:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as model
    return model.model_validate(body)


class Server:
    """kvj serve's replies in the API process (module docstring)."""

    def __init__(self, journal: str, log_: ReplyLog, restored: List[Reply], admission: str = "arrival"):
        self.journal = journal
        self.log = log_
        self.admission = admission
        self.replies: Dict[str, Reply] = {r.key: r for r in restored}
        self.restored = list(restored)
        self.engine: Optional[Engine] = None
        self.state: Any = None
        self.closing = False
        self.counters = {"replies": 0, "resumed": sum(1 for r in restored if not r.finished), "derived": 0,
                         "held_at_start": sum(1 for r in restored if r.finished)}

    def attach(self, engine_client: Any, state: Any) -> None:
        """Engine up (vLLM's ``init_state``): take the choke point; run the restored replies' drives."""
        self.engine = Engine(engine_client, self)
        self.state = state
        for reply in self.restored:
            if reply.finished:
                continue  # held: its events are derived when asked for
            reply.frames = []
            self.start(reply, "live")

    # ------------------------------------------------------------------ drives

    def new(self, key: str, kind: str, body: Dict[str, Any], stream: bool) -> Reply:
        """A reply for a request just accepted (journaled once the engine input is rendered)."""
        reply = Reply(key, kind, body, int(time.time()), stream, self.admission)
        reply.frames = []
        reply.opened = asyncio.get_running_loop().create_future()
        self.replies[key] = reply
        self.counters["replies"] += 1
        return reply

    def start(self, reply: Reply, mode: str) -> "asyncio.Task[Any]":
        """Drive ``reply`` through vLLM's handler in a task of its own (``mode``: live or replay)."""
        context = contextvars.copy_context()
        context.run(DRIVE.set, Drive(reply, mode))
        reply.done = False
        reply.task = asyncio.get_running_loop().create_task(self._drive(reply, mode), context=context)
        return reply.task

    async def _drive(self, reply: Reply, mode: str) -> None:
        attr, method = HANDLERS[reply.kind]
        call = getattr(getattr(self.state, attr), method)
        reply.frames = []
        try:
            request = request_model(reply.kind, reply.body)
            if reply.kind == "responses":
                request.background, request.stream = False, True  # vLLM's stream generator, driven here
            result = await call(request, None)
            if reply.kind == "responses":
                request.background = bool(reply.body.get("background"))  # read lazily: the client's flag
            if type(result).__name__ == "ErrorResponse":
                reply.error, reply.status_code = result.model_dump(mode="json"), result.error.code
                if reply.prompt_hash is not None:  # a reply accepted earlier that this server cannot continue
                    log.error("kvj serve: reply %s cannot continue on this server: %s", reply.key,
                              result.error.message)
            elif hasattr(result, "model_dump_json"):  # a whole (non-stream) response
                reply.frames.append(f"data: {result.model_dump_json()}\n\n")
            else:
                async for item in result:
                    reply.frames.append(wire.responses_frame(item) if reply.kind == "responses" else item)
                    reply.notify()
        except Halt:
            pass
        except PromptChanged as exc:
            log.error("kvj serve: %s", exc)
            reply.error = wire.error_body(str(exc), HTTPStatus.CONFLICT)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or an engine failure: the reply fails, the server goes on
            log.exception("kvj serve: reply %s failed", reply.key)
            reply.error = wire.error_body(f"reply {reply.key} failed: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR,
                                          err_type="internal_error")
        finally:
            reply.done = True
            if reply.opened is not None and not reply.opened.done():
                reply.opened.set_result(None)
            reply.notify()
        if mode == "live" and reply.prompt_hash is not None and not reply.finished and not self.closing:
            await self.finish(reply, {"status": "failed", "count": len(reply.tokens), "at": time.time()})
        elif reply.prompt_hash is None and reply.error is not None and mode == "live":
            self.replies.pop(reply.key, None)  # refused before it was journaled: nothing to keep

    async def opened(self, reply: Reply) -> None:
        """Journal a new reply's START (durable first under ``--admission durable``) and let its route answer."""
        if self.closing:
            raise asyncio.CancelledError()
        lsn = self.log.opened(reply)
        if reply.admission == "durable":
            await self.log.durable(lsn)
        if reply.opened is not None and not reply.opened.done():
            reply.opened.set_result(None)

    async def released(self, reply: Reply, tokens: List[int]) -> None:
        """Journal tokens about to be released (durable first under ``--admission durable``), then release them."""
        lsn = self.log.released(reply, tokens)
        if reply.admission == "durable":
            await self.log.durable(lsn)
        reply.tokens += tokens

    async def finish(self, reply: Reply, end: Dict[str, Any]) -> None:
        """REPLY, durable before the reply's last event is released."""
        if reply.end is not None:
            return
        lsn = self.log.finished(reply, end)
        reply.end = end
        await self.log.durable(lsn)

    async def cancel(self, reply: Reply, status: str = "cancelled", to: Optional[str] = None) -> bool:
        """Stop a running reply where it is (its tokens released so far): cancelled, or handed off to
        engine ``to`` (a handoff armed: the connector journals its engine request as moved). False if
        it had finished."""
        if reply.end is not None:
            return False
        reply.end = {"status": status, "count": len(reply.tokens), "at": time.time(), "to": to}
        lsn = self.log.finished(reply, reply.end)
        task = reply.task
        if task is not None and not task.done():
            if status == "cancelled":
                mark_cancel(self.journal, reply.key)  # vLLM's abort of its engine request is journaled "cancelled"
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        await self.log.durable(lsn)
        reply.done = True
        reply.notify()
        return True

    async def hand_off(self, to: str) -> List[str]:
        """Hand every running reply off to engine ``to`` (armed by ``kvj handoff``); new requests are
        still served here. Their streams end with no terminal event; the other kvj serve (``--from``
        this journal) continues them and their clients re-attach there."""
        moving = [r for r in self.replies.values() if r.end is None and r.task is not None and not r.task.done()]
        for reply in moving:
            await self.cancel(reply, "handoff", to)
        return [r.key for r in moving]

    def forget(self, reply: Reply, status: str) -> None:
        """END a finished reply (expired, evicted, abandoned): gone from the journal at its next compaction."""
        self.log.ended(reply.key, status)
        self.replies.pop(reply.key, None)
        reply.frames = None
        reply.done = True
        reply.notify()

    # ------------------------------------------------------------------ readers

    async def events(self, reply: Reply) -> List[str]:
        """The reply's events so far (derived again from its tokens when they were dropped)."""
        if reply.frames is None:
            if reply.task is None or reply.task.done():
                self.counters["derived"] += 1
                self.start(reply, "replay")
            await asyncio.shield(reply.task)
        reply.last_read = time.monotonic()
        return reply.frames or []

    async def follow(self, reply: Reply, after: int) -> AsyncIterator[str]:
        """Its events after event ``after``, with their ``id:``, as they come; ends with the reply (or at
        shutdown, with no terminal event: the client re-attaches to the next server)."""
        await self.events(reply)
        reply.readers += 1
        try:
            i = after + 1
            while True:
                frames = reply.frames or []
                while i < len(frames):
                    yield wire.on_wire(i, frames[i])
                    i += 1
                if reply.done or self.closing:
                    break
                await reply.changed()
            if reply.error is not None and (reply.frames is not None and i >= len(reply.frames)):
                yield wire.error_frame(reply.error)
        finally:
            reply.readers -= 1
            reply.last_read = time.monotonic()

    def status(self) -> Dict[str, Any]:
        """``GET /v1/kvj/status``: replies running and held, and what the start-up restored."""
        running = [r for r in self.replies.values() if not r.finished]
        held = [r for r in self.replies.values() if r.finished]
        return {"journal": self.journal, "admission": self.admission, "running": len(running), "held": len(held),
                "held_bytes": sum(r.held_bytes() for r in held), "closing": self.closing, **self.counters}

    # ------------------------------------------------------------------ shutdown

    def close_now(self) -> List["asyncio.Task[Any]"]:
        """Stop admitting, end every reader, cancel every drive (vLLM aborts their engine requests; the
        connector parks them); the drives' tasks, which end at their next step."""
        self.closing = True
        tasks = [r.task for r in self.replies.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        for reply in self.replies.values():
            reply.notify()
        return tasks

    async def close(self) -> None:
        """SIGTERM: ``close_now``, wait for the drives to end, make the reply journal durable."""
        tasks = self.close_now()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.log.sync()
