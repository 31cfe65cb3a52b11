"""kvj serve's HTTP surface: vLLM's POST routes made durable, and the routes that read a reply back.

Through vLLM's endpoint-plugin hook these replace vLLM's routes of the same path and method:
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
``GET /v1/responses/{response_id}``, ``POST /v1/responses/{response_id}/cancel``. A request kvj
does not make durable (``durable``: logprobs, n > 1, beam search, tools, structured output,
several prompts, echo, a Responses request not in background mode) goes to vLLM's own
endpoint unchanged. Extensions: ``GET /v1/chat/completions/{id}`` and ``GET /v1/completions/{id}``
(the reply so far or finished; ``?stream=true`` re-attaches after ``Last-Event-ID`` or
``?starting_after=N``), ``POST /v1/kvj/replies/{id}/abandon`` and ``GET /v1/kvj/status``.
A POST with the ``X-Request-Id`` of a known reply re-attaches to it: nothing is generated twice.
"""

# No ``from __future__ import annotations``: FastAPI reads these annotations at import.
import asyncio
from http import HTTPStatus
from typing import Any, Callable, Dict, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.serve.utils.api_utils import validate_json_request

from kvj.errors import InvalidName, KvjError
from kvj.names import check_request_id
from kvj.serve import frames as wire
from kvj.serve.replies import Reply

#: vLLM's route functions kvj serve delegates to, by (method, path).
Originals = Dict[tuple, Callable[..., Any]]
DURABLE_POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
STREAM = "text/event-stream"


def durable(kind: str, request: Any) -> Optional[str]:
    """Why kvj serve passes ``request`` to vLLM unchanged (not durable: README, docs/serve.md), or None."""
    if kind == "responses":
        return None if request.background else "not in background mode"
    if (request.n or 1) != 1:
        return "n > 1"
    if request.use_beam_search:
        return "beam search"
    if request.logprobs or getattr(request, "top_logprobs", 0) or request.prompt_logprobs is not None:
        return "logprobs"
    if getattr(request, "tools", None):
        return "tools"
    if request.response_format is not None and getattr(request.response_format, "type", "text") != "text":
        return "structured output"
    if request.structured_outputs is not None or getattr(request, "repetition_detection", None) is not None:
        return "structured output or repetition detection"
    if request.echo:
        return "echo"
    if kind == "completion":
        prompt = request.prompt
        single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int))
        if not single or request.prompt_embeds is not None or request.suffix is not None:
            return "several prompts, prompt embeddings or a suffix"
    return None


def refusal(request: Any) -> Optional[str]:
    """What kvj serve's durable background mode cannot do (a 400 says so), or None."""
    if request.tools:
        return "tools"
    if request.previous_response_id is not None or request.previous_input_messages:
        return "previous_response_id"
    if request.top_logprobs:
        return "top_logprobs"
    return None


def _error(body: Dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, status_code=body["error"]["code"])


def _bad(message: str, param: Optional[str] = None) -> JSONResponse:
    return _error(wire.error_body(message, HTTPStatus.BAD_REQUEST, param))


def _position(raw: Request, starting_after: Optional[str]) -> int:
    """Where a re-attaching client resumes: after ``Last-Event-ID``, else ``starting_after``, else the start."""
    last = wire.parse_position(raw.headers.get("Last-Event-ID"), "Last-Event-ID")
    after = wire.parse_position(starting_after, "starting_after")
    return last if last is not None else (after if after is not None else -1)


def _stream(server: Any, reply: Reply, after: int) -> StreamingResponse:
    return StreamingResponse(server.follow(reply, after), media_type=STREAM, headers={"X-Kvj-Reply": reply.key})


async def _whole(server: Any, reply: Reply) -> JSONResponse:
    """A non-stream reply, once it finished (its one event), or its error."""
    while not reply.done:
        await reply.changed()
    events = await server.events(reply)
    if reply.error is not None and not events:
        return _error(reply.error)
    return JSONResponse(wire._data(events[0]) if events else None, status_code=reply.status_code)


def make_router(originals: Originals) -> APIRouter:
    """kvj serve's routes (module docstring); ``originals``: vLLM's POST endpoints, to delegate to."""
    router = APIRouter()

    async def create(kind: str, prefix: str, request: Any, raw: Request) -> Any:
        server = raw.app.state.kvj_server
        path = DURABLE_POSTS[("chat", "completion", "responses").index(kind)]
        if durable(kind, request) is not None:
            return await originals[("POST", path)](request, raw)
        if kind == "responses" and refusal(request) is not None:
            return _bad(f"kvj serve's durable background mode does not support {refusal(request)}", "background")
        if server.closing:
            return JSONResponse(wire.error_body("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE),
                                status_code=HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "5"})
        # chat and completions take X-Request-Id as vLLM does; a response's id is its request_id
        base = request.request_id if kind == "responses" else raw.headers.get("X-Request-Id") or request.request_id
        key = base if kind == "responses" else f"{prefix}{base}"
        try:
            check_request_id(key)
        except InvalidName:
            return _bad(f"request id {base!r}: kvj serve journals replies under it; use 1-250 of "
                        "[A-Za-z0-9._:@+=-]", "X-Request-Id")
        known = server.replies.get(key)
        if known is not None:  # a retry, or a client that lost its stream: re-attach, generate nothing twice
            if known.kind != kind:
                return _bad(f"request id {base!r} names a reply of another kind", "X-Request-Id")
            if known.status == "handoff":
                return _moved(known)
            return await reattach(server, known, raw, None, bool(request.stream))
        request.request_id = key if kind == "responses" else base
        reply = server.new(key, kind, request.model_dump(mode="json"), bool(request.stream))
        server.start(reply, "live")
        await asyncio.shield(reply.opened)
        if reply.error is not None and reply.prompt_hash is None:
            return _error(reply.error)
        if kind == "responses" and not request.stream:
            events = await server.events(reply)
            while not events and not reply.done:
                await reply.changed()
            created = wire.fold_responses(key, events[:1], "queued")
            return JSONResponse({**created, "status": "queued"})
        if request.stream:
            return _stream(server, reply, -1)
        return await _whole(server, reply)

    async def reattach(server: Any, reply: Reply, raw: Request, starting_after: Optional[str], stream: bool) -> Any:
        try:
            after = _position(raw, starting_after)
        except ValueError as exc:
            return _bad(str(exc), "starting_after")
        if stream:
            return _stream(server, reply, after)
        if reply.kind == "responses":
            return JSONResponse(wire.fold_responses(reply.key, await server.events(reply), reply.status))
        if not reply.stream and reply.status == "in_progress" and raw.method == "POST":
            return await _whole(server, reply)
        return JSONResponse(wire.fold_completion(reply.kind, reply.key, reply.created, await server.events(reply),
                                                 reply.status, reply.text))

    @router.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)])
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await create("chat", "chatcmpl-", request, raw_request)

    @router.post("/v1/completions", dependencies=[Depends(validate_json_request)])
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await create("completion", "cmpl-", request, raw_request)

    @router.post("/v1/responses", dependencies=[Depends(validate_json_request)])
    async def create_responses(request: ResponsesRequest, raw_request: Request):
        return await create("responses", "", request, raw_request)

    async def get(kind: str, key: str, raw: Request, stream: Optional[str], starting_after: Optional[str]) -> Any:
        server = raw.app.state.kvj_server
        reply = server.replies.get(key)
        if reply is None or reply.kind != kind:
            return _error(wire.not_found(key, "response_id" if kind == "responses" else "completion_id"))
        if reply.status == "handoff":
            return _moved(reply)
        return await reattach(server, reply, raw, starting_after, (stream or "").lower() in ("true", "1"))

    @router.get("/v1/chat/completions/{completion_id}")
    async def get_chat_completion(completion_id: str, raw_request: Request, stream: Optional[str] = None,
                                  starting_after: Optional[str] = None):
        return await get("chat", completion_id, raw_request, stream, starting_after)

    @router.get("/v1/completions/{completion_id}")
    async def get_completion(completion_id: str, raw_request: Request, stream: Optional[str] = None,
                             starting_after: Optional[str] = None):
        return await get("completion", completion_id, raw_request, stream, starting_after)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_responses(response_id: str, raw_request: Request, stream: Optional[str] = None,
                                 starting_after: Optional[str] = None):
        return await get("responses", response_id, raw_request, stream, starting_after)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_responses(response_id: str, raw_request: Request):
        server = raw_request.app.state.kvj_server
        reply = server.replies.get(response_id)
        if reply is None or reply.kind != "responses":
            return _error(wire.not_found(response_id))
        if not await server.cancel(reply) and reply.status != "cancelled":
            return _bad(f"Response with id '{response_id}' has finished ({reply.status}): it cannot be cancelled",
                        "response_id")
        return JSONResponse(wire.fold_responses(reply.key, await server.events(reply), "cancelled"))

    @router.post("/v1/kvj/replies/{reply_id}/abandon")
    async def abandon(reply_id: str, raw_request: Request):
        server = raw_request.app.state.kvj_server
        if not _admin(raw_request):
            return _error(wire.error_body("kvj's admin routes answer loopback clients only (or set --api-key)",
                                          HTTPStatus.FORBIDDEN))
        reply = server.replies.get(reply_id)
        if reply is None:
            return _error(wire.not_found(reply_id, "reply_id"))
        await server.cancel(reply)
        server.forget(reply, "abandoned")
        return JSONResponse({"id": reply_id, "status": "abandoned", "tokens": len(reply.tokens)})

    @router.post("/v1/kvj/handoff")
    async def handoff(raw_request: Request, mode: str = "abort"):
        """``kvj handoff --url``: hand the running replies off (no vLLM dev mode, no pause)."""
        from kvj.ops.armed import armed_target

        server = raw_request.app.state.kvj_server
        if not _admin(raw_request):
            return _error(wire.error_body("kvj's admin routes answer loopback clients only (or set --api-key)",
                                          HTTPStatus.FORBIDDEN))
        running = sum(1 for r in server.replies.values() if r.end is None)
        if mode == "finish":
            return JSONResponse({"mode": "finish", "running": running, "accepting": True,
                                 "message": f"kvj serve lets its {running} running replies finish here and keeps "
                                            "accepting new requests: nothing is handed off"})
        to = armed_target(server.journal)
        if mode != "abort" or to is None:
            return _bad("arm the handoff first (kvj handoff -j JOURNAL --to NAME --url URL arms it and calls this); "
                        "mode is abort or finish", "mode")
        moved = await server.hand_off(to)
        return JSONResponse({"mode": "abort", "to": to, "moved": moved, "accepting": True,
                             "message": f"{len(moved)} running replies handed off to {to}; kvj serve keeps "
                                        "accepting new requests"})

    @router.get("/v1/kvj/status")
    async def kvj_status(raw_request: Request):
        return JSONResponse(raw_request.app.state.kvj_server.status())

    return router


def _moved(reply: Reply) -> JSONResponse:
    """A reply handed off to another engine: 410, naming it (its clients re-attach there)."""
    to = (reply.end or {}).get("to")
    body = wire.error_body(f"reply {reply.key} was handed off to {to}: re-attach there with the same id",
                           HTTPStatus.GONE, "id", "moved")
    body["error"]["moved_to"] = to
    return _error(body)


def _admin(raw: Request) -> bool:
    """kvj's admin routes: behind vLLM's --api-key (it guards /v1), else for loopback clients only."""
    args = getattr(raw.app.state, "args", None)
    if getattr(args, "api_key", None):
        return True
    host = raw.client.host if raw.client is not None else ""
    return host in ("127.0.0.1", "::1", "localhost")


def attach(app: FastAPI) -> None:
    """Add kvj serve's routes to vLLM's app, keeping vLLM's POST endpoints to delegate to."""
    from fastapi.routing import APIRoute

    originals: Originals = {}
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path in DURABLE_POSTS and "POST" in route.methods:
            originals[("POST", route.path)] = route.endpoint
    missing = [p for p in DURABLE_POSTS if ("POST", p) not in originals]
    if missing:
        raise KvjError(f"kvj serve: vLLM's app has no POST {missing[0]} (a vLLM kvj serve does not know)")
    app.include_router(make_router(originals))
