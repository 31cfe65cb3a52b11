"""Events on the wire and what a poll says: SSE frames with ``id:``, and the folds of a reply's events.

A chat or completion event is the ``data: ...`` frame vLLM's generator yields; a Responses event
is ``event: TYPE`` + ``data: JSON`` as vLLM's route writes it. On the wire each is preceded by
``id: K``, K its index in the reply (for Responses, vLLM's ``sequence_number``): a client that
lost its stream sends ``Last-Event-ID: K`` (or ``?starting_after=K``) and gets events K+1... A
poll folds the events into the reply so far: a Responses object ``in_progress`` with its output
so far (or the one ``response.completed`` carries), a chat or text completion with the content
so far and ``status`` (kvj's extension).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, Dict, List, Optional

from kvj.errors import InvalidArgument

#: Error types, as OpenAI names them.
INVALID, NOT_FOUND = "invalid_request_error", "not_found_error"


def error_body(message: str, status: int, param: Optional[str] = None, err_type: str = INVALID) -> Dict[str, Any]:
    """An error in OpenAI's shape, as vLLM's ``ErrorResponse`` writes it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": int(status)}}


def not_found(key: str, param: str = "response_id") -> Dict[str, Any]:
    """The 404 of an id no reply has (unknown, or ended and compacted away)."""
    return error_body(f"No reply with id '{key}' (unknown, or its retention passed).", HTTPStatus.NOT_FOUND, param,
                      NOT_FOUND)


def responses_frame(event: Any) -> str:
    """A Responses event as vLLM's route writes it (``event:`` and ``data:``)."""
    return f"event: {getattr(event, 'type', 'unknown')}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


def on_wire(index: int, frame: str) -> str:
    """A frame with its SSE ``id:``."""
    return f"id: {index}\n{frame}"


def error_frame(error: Dict[str, Any]) -> str:
    """An SSE error event (no ``id:``: it is not one of the reply's events)."""
    return f"event: error\ndata: {json.dumps(error)}\n\n"


def parse_position(value: Optional[str], name: str) -> Optional[int]:
    """A ``starting_after`` or ``Last-Event-ID`` value: an integer >= -1, or None when absent.
    Raises ``InvalidArgument`` (a ``ValueError``) with the message a 400 carries."""
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except ValueError:
        raise InvalidArgument(f"{name} must be an integer event number, not {value!r}") from None
    if n < -1:
        raise InvalidArgument(f"{name} must be -1 or more, not {n}")
    return n


def _data(frame: str) -> Optional[Any]:
    """The JSON of a frame's ``data:`` line (None for ``[DONE]``)."""
    line = next((ln for ln in frame.split("\n") if ln.startswith("data: ")), None)
    if line is None or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


def fold_responses(key: str, frames: List[str], status: str) -> Dict[str, Any]:
    """A Responses object from its events: ``response.completed``'s, or the output so far."""
    events = [e for e in (_data(f) for f in frames) if isinstance(e, dict)]
    for e in events:
        if e.get("type") in ("response.completed", "response.incomplete", "response.failed"):
            return e["response"]
    base: Dict[str, Any] = dict(events[0]["response"]) if events else {"id": key, "object": "response"}
    items: Dict[int, Dict[str, Any]] = {}
    for e in events:
        kind = e.get("type")
        if kind in ("response.output_item.added", "response.output_item.done"):
            items[e["output_index"]] = dict(e["item"])
        elif kind == "response.content_part.added":
            item = items.setdefault(e["output_index"], {"content": []})
            item["content"] = list(item.get("content") or []) + [dict(e["part"])]
        elif kind == "response.output_text.delta":
            part = items.get(e["output_index"], {}).get("content", [])[e["content_index"]]
            part["text"] = part.get("text", "") + e["delta"]
        elif kind in ("response.content_part.done", "response.output_text.done") and "part" in e:
            item = items.get(e["output_index"])
            if item is not None:
                item["content"][e["content_index"]] = dict(e["part"])
    return {**base, "status": status, "output": [items[i] for i in sorted(items)]}


def fold_completion(kind: str, key: str, created: int, frames: List[str], status: str, text: str) -> Dict[str, Any]:
    """A chat or text completion from its events: the whole one (non-stream), or the content so far."""
    chunks = [d for d in (_data(f) for f in frames) if isinstance(d, dict)]
    if len(chunks) == 1 and chunks[0].get("object") in ("chat.completion", "text_completion"):
        return {**chunks[0], "status": status}  # a non-stream reply: its one event is the whole reply
    content, finish, usage, model = "", None, None, None
    for c in chunks:
        model = c.get("model", model)
        usage = c.get("usage") or usage
        for choice in c.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text")
            content += piece or ""
            finish = choice.get("finish_reason") or finish
    if not chunks and text:
        content = text  # a non-stream reply still running: kvj's text so far
    if kind == "chat":
        choice: Dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": content, "finish_reason": finish}, "text_completion"
    return {"id": key, "object": obj, "created": created, "model": model, "status": status, "choices": [choice],
            **({"usage": usage} if usage else {})}
