"""kvj serve's wire: SSE framing and positions, the folds a poll answers with, and the determinism
shims (``created`` and vLLM's ids per reply, under two interleaved drives): fast, no engine."""

from __future__ import annotations

import asyncio
import contextvars
import json
import time

import pytest

from kvj.serve import frames as wire
from kvj.serve.replies import Reply


def chunk(content=None, finish=None, usage=None, role=None):
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    body = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body = {**body, "choices": [], "usage": usage}
    return f"data: {json.dumps(body)}\n\n"


def test_positions_are_integers_from_minus_one_and_a_bad_one_says_why():
    assert wire.parse_position(None, "x") is None and wire.parse_position("", "x") is None
    assert wire.parse_position("-1", "x") == -1 and wire.parse_position("41", "x") == 41
    for bad, why in (("abc", "must be an integer"), ("-2", "must be -1 or more"), ("1.5", "must be an integer")):
        with pytest.raises(ValueError, match=why):
            wire.parse_position(bad, "starting_after")


def test_frames_carry_their_event_number_and_errors_have_openai_s_shape():
    assert wire.on_wire(7, "data: {}\n\n") == "id: 7\ndata: {}\n\n"
    body = wire.not_found("resp_x")
    assert body["error"]["code"] == 404 and body["error"]["param"] == "response_id" and "resp_x" in body["error"]["message"]
    assert set(wire.error_body("m", 400)["error"]) == {"message", "type", "param", "code"}


def test_a_chat_poll_folds_the_content_so_far_and_the_finish():
    frames = [chunk(role="assistant", content=""), chunk("Hel"), chunk("lo"), chunk("", finish="length"),
              chunk(usage={"prompt_tokens": 3, "completion_tokens": 2}), "data: [DONE]\n\n"]
    mid = wire.fold_completion("chat", "chatcmpl-x", 5, frames[:3], "in_progress", "")
    assert mid["status"] == "in_progress" and mid["choices"][0]["message"]["content"] == "Hello"
    assert mid["choices"][0]["finish_reason"] is None and mid["object"] == "chat.completion"
    end = wire.fold_completion("chat", "chatcmpl-x", 5, frames, "incomplete", "")
    assert end["choices"][0]["finish_reason"] == "length" and end["usage"]["completion_tokens"] == 2
    running = wire.fold_completion("chat", "chatcmpl-x", 5, [], "in_progress", "so far")  # non-stream, running
    assert running["choices"][0]["message"]["content"] == "so far"
    whole = {"id": "chatcmpl-x", "object": "chat.completion", "choices": [{"message": {"content": "all"}}]}
    assert wire.fold_completion("chat", "chatcmpl-x", 5, [f"data: {json.dumps(whole)}\n\n"], "completed", "") == \
        {**whole, "status": "completed"}


def test_a_responses_poll_is_in_progress_with_its_output_so_far_then_the_completed_response():
    created = {"type": "response.created", "sequence_number": 0,
               "response": {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}}
    added = {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
             "item": {"id": "msg_1", "type": "message", "content": [], "status": "in_progress"}}
    part = {"type": "response.content_part.added", "sequence_number": 3, "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": ""}}
    deltas = [{"type": "response.output_text.delta", "sequence_number": 4 + i, "output_index": 0,
               "content_index": 0, "delta": d} for i, d in enumerate(["Hi", " there"])]
    events = [created, added, part, *deltas]
    frames = [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]
    poll = wire.fold_responses("resp_1", frames, "in_progress")
    assert poll["status"] == "in_progress" and poll["id"] == "resp_1"
    assert poll["output"][0]["content"][0]["text"] == "Hi there"
    done = {"type": "response.completed", "sequence_number": 9, "response": {"id": "resp_1", "status": "completed"}}
    frames.append(f"event: response.completed\ndata: {json.dumps(done)}\n\n")
    assert wire.fold_responses("resp_1", frames, "completed") == done["response"]
    assert wire.fold_responses("resp_1", frames[:-1], "cancelled")["status"] == "cancelled"


def test_the_shims_give_each_drive_its_reply_s_created_and_ids_and_vllm_its_own_outside():
    """Two replies driven at once, interleaved at every await: each sees its own ``created`` and the
    same ids whenever it runs again; outside a drive vLLM's own clock and random ids."""
    import vllm.entrypoints.openai.chat_completion.serving as chat
    import vllm.entrypoints.openai.responses.streaming_events as events

    from kvj.serve import determinism

    assert determinism.missing() == []
    determinism.install()
    determinism.install()  # idempotent

    async def drive(reply: Reply, out: list) -> None:
        for _ in range(3):
            out.append((int(chat.time.time()), events.random_uuid()))
            await asyncio.sleep(0)

    async def both() -> tuple:
        results = ([], [])
        tasks = []
        for reply, out in zip((Reply("resp_a", "responses", {}, 111, True), Reply("resp_b", "responses", {}, 222, True)),
                              results):
            context = contextvars.copy_context()
            context.run(determinism.DRIVE.set, determinism.Drive(reply, "live"))
            tasks.append(asyncio.get_running_loop().create_task(drive(reply, out), context=context))
        await asyncio.gather(*tasks)
        return results

    first, again = asyncio.run(both()), asyncio.run(both())
    assert first == again
    a, b = first
    assert {t for t, _ in a} == {111} and {t for t, _ in b} == {222}
    assert len({i for _, i in a + b}) == 6 and all(len(i) == 16 for _, i in a)
    outside = {events.random_uuid() for _ in range(3)}
    assert len(outside) == 3 and not outside & {i for _, i in a + b}
    assert abs(chat.time.time() - time.time()) < 5
