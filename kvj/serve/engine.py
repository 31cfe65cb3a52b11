"""The one choke point into the engine: ``engine_client.generate``, for a durable reply one output per token.

vLLM's serving handlers (chat, completions, responses) all call ``engine_client.generate``;
``Engine`` replaces it (an instance attribute). Outside a drive (``kvj.serve.determinism.DRIVE``)
it is vLLM's own. Inside one it feeds vLLM's handler exactly one ``RequestOutput`` per token:
first the tokens the reply already has (restored from the journals, or all of them when its
events are derived again), then, live, the engine's, split per token. The text of each comes
from kvj's own ``IncrementalDetokenizer`` (vLLM's class) over the original prompt, so event
boundaries and text are a function of the tokens, whatever the engine merged or where a
restart cut the reply. A continuation is submitted as prompt + known tokens with the rest of the
budget; the connector loads its durable KV and replays a seeded sampler's draws.

Each token is journaled (TOKENS) as it is released; with ``--admission durable`` it is released
only once durable. The last token is released only after the reply's REPLY record is durable,
so a terminal event a client saw is never undone. A stop string kvj finds before the engine
does (one that spans a resume point) ends the reply, and the engine request is aborted with the
cancel marker. A client that goes away never aborts the engine: the drive is kvj's task.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, AsyncIterator, List, Optional, Set, Tuple

from kvj.errors import KvjError
from kvj.fileio import makedirs_durable
from kvj.serve.determinism import DRIVE
from kvj.serve.paths import cancel_marker
from kvj.serve.replies import COMPLETE, Reply, prompt_digest

if TYPE_CHECKING:
    from kvj.serve.server import Server

Finish = Optional[Tuple[Optional[str], Any]]  # (finish_reason, stop_reason) of a reply's last token


class Halt(BaseException):
    """Ends a drive after a cancelled, failed or handed-off reply's last token: no terminal event.
    (A BaseException: vLLM's generators turn an Exception into an error event.)"""


class PromptChanged(Exception):
    """A restored reply's body renders to other prompt tokens (another template or tokenizer)."""


class Engine:
    """``engine_client.generate`` for kvj serve (module docstring)."""

    def __init__(self, engine_client: Any, server: "Server"):
        self.client = engine_client
        self.server = server
        self._generate = engine_client.generate
        self.tokenizer = engine_client.renderer.tokenizer
        engine_client.generate = self.generate

    def stop_ids(self, params: Any) -> Set[int]:
        """The tokens vLLM stops this request on (its EOS unless ignored, and stop_token_ids)."""
        p = params.clone()
        p.update_from_generation_config(self.client.input_processor.generation_config_fields,
                                        self.client.renderer.get_eos_token_id())
        return ({p.eos_token_id} if p.eos_token_id is not None else set()) | set(p.stop_token_ids or ())

    async def generate(self, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """vLLM's ``generate`` for a drive's reply: its known tokens, then the engine's, one output each."""
        drive = DRIVE.get()
        if drive is None or not isinstance(prompt, dict) or "prompt_token_ids" not in prompt or \
                drive.reply.engine_id not in (None, request_id):
            async for out in self._generate(prompt, params, request_id, *args, **kwargs):
                yield out
            return
        reply, live = drive.reply, drive.mode == "live"
        ids = [int(t) for t in prompt["prompt_token_ids"]]
        split = _Split(self, reply, ids, prompt.get("prompt"), params, request_id, live)
        if reply.prompt_hash is None:  # a new request: journaled before the engine sees it
            reply.engine_id, reply.prompt_hash = request_id, prompt_digest(ids)
            await self.server.opened(reply)
        elif prompt_digest(ids) != reply.prompt_hash:
            raise PromptChanged(f"reply {reply.key}: its request renders to other prompt tokens than when it was "
                                "accepted (another chat template or tokenizer): it cannot continue")
        end = reply.end if not live else None
        have = reply.tokens[:end["count"]] if end is not None else list(reply.known)
        stops = self.stop_ids(params) if live and have else set()
        for i, t in enumerate(have):
            if end is not None:
                last = i == len(have) - 1 and end["status"] in COMPLETE
                finish: Finish = (end["finish_reason"], end["stop_reason"]) if last else None
            else:
                finish = split.stop_token(t, stops)
            out = await split.token(t, finish)
            if out is not None:
                yield out
            if split.finished:
                return
        if not live or end is not None:
            raise Halt()
        async for out in self._continue(split, prompt, params, request_id, have, args, kwargs):
            yield out

    async def _continue(self, split: "_Split", prompt: Any, params: Any, request_id: str, have: List[int],
                        args: Any, kwargs: Any) -> AsyncIterator[Any]:
        """The engine's tokens after ``have``: prompt + ``have`` with the rest of the budget."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = params.clone()
        p.output_kind = RequestOutputKind.DELTA
        extra = {**(p.extra_args or {}), "kvj_client": split.reply.key}
        if have:  # a continuation: the connector journals the original request and replays the draws
            p.max_tokens = params.max_tokens - len(have)
            p.min_tokens = max(0, (params.min_tokens or 0) - len(have))
            extra.update(kvj_prompt_len=len(split.ids), kvj_max_tokens=params.max_tokens, kvj_draws=len(have))
            prompt = TokensPrompt(prompt_token_ids=split.ids + have)
        p.extra_args = extra
        source = self._generate(prompt, p, request_id, *args, **kwargs)
        early = False
        try:
            async for out in source:
                o = out.outputs[0]
                n = len(o.token_ids)
                for j, t in enumerate(o.token_ids):
                    last = out.finished and j == n - 1
                    finish: Finish = (o.finish_reason, o.stop_reason) if last else None
                    if last and o.finish_reason == "abort":
                        raise KvjError(f"the engine aborted reply {split.reply.key}")
                    res = await split.token(int(t), finish, out.num_cached_tokens or 0)
                    if res is not None:
                        yield res
                    if split.finished:
                        early = not last
                        break
                if split.finished:
                    break
        finally:
            if early:  # kvj found the end first (a stop string across a resume point): stop the engine
                await self.cancel_engine(split.reply, source)

    async def cancel_engine(self, reply: Reply, source: Any) -> None:
        """Abort a reply's engine request on purpose: its cancel marker first (END "cancelled", not parked)."""
        mark_cancel(self.server.journal, reply.key)
        await source.aclose()


def mark_cancel(journal: str, key: str) -> None:
    """Make reply ``key``'s cancel marker (the connector removes it when it journals the END)."""
    path = cancel_marker(journal, key)
    makedirs_durable(os.path.dirname(path))
    with open(path, "a"):
        pass


class _Split:
    """One drive's per-token outputs: kvj's detokenizer, the journal, the finish."""

    def __init__(self, engine: Engine, reply: Reply, ids: List[int], prompt_text: Optional[str], params: Any,
                 request_id: str, live: bool):
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        self.engine, self.reply, self.ids, self.prompt_text, self.params = engine, reply, ids, prompt_text, params
        self.request_id, self.live = request_id, live
        self.final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        request = SimpleNamespace(request_id=request_id, prompt_token_ids=ids, prompt_embeds=None,
                                  sampling_params=params)
        self.detok = IncrementalDetokenizer.from_new_request(engine.tokenizer, request)
        self.count = 0
        self.text = ""
        self.finished = False
        self.max_len = engine.client.model_config.max_model_len

    def stop_token(self, t: int, stops: Set[int]) -> Finish:
        """Whether known token ``t`` ended the request, as vLLM's ``check_stop`` decides."""
        n = self.count + 1
        if t in stops:
            return "stop", (t if t in (self.params.stop_token_ids or ()) else None)
        if n >= self.params.max_tokens or len(self.ids) + n >= self.max_len:
            return "length", None
        return None

    async def token(self, t: int, finish: Finish, cached: int = 0) -> Any:
        """The output of the reply's next token (None for a FINAL_ONLY consumer until the last)."""
        from vllm.outputs import CompletionOutput, RequestOutput

        reply = self.reply
        reason, stop = finish if finish is not None else (None, None)
        found = self.detok.update([t], reason == "stop" and not isinstance(stop, str))
        if found is not None and reason is None:  # kvj's detokenizer saw a stop string first
            reason, stop = "stop", found
        self.finished = reason is not None
        text = self.detok.get_next_output_text(self.finished, delta=True)
        index = self.count
        self.count += 1
        self.text += text
        if self.live:
            if index >= reply.journaled:  # not one the journal holds already (a restored reply's)
                await self.engine.server.released(reply, [t])
            reply.text += text
            if self.finished:
                await self.engine.server.finish(reply, {
                    "status": "incomplete" if reason == "length" else "completed", "count": self.count,
                    "finish_reason": reason, "stop_reason": stop, "cached_tokens": cached, "at": time.time()})
        if self.final_only and not self.finished:
            return None
        out = CompletionOutput(index=0, text=self.text if self.final_only else text,
                               token_ids=list(self.detok.token_ids) if self.final_only else [t],
                               cumulative_logprob=None, logprobs=None, finish_reason=reason, stop_reason=stop)
        return RequestOutput(self.request_id, self.prompt_text, self.ids, None, [out], self.finished,
                             num_cached_tokens=0)
