"""Events as a function of the tokens: ``created`` and vLLM's random item ids taken from the reply.

vLLM's serving handlers stamp events with ``int(time.time())`` and ids from ``random_uuid()``,
module globals of their modules. Those globals are replaced, once, by stand-ins that answer as
vLLM's own outside a drive and, inside one (the ``DRIVE`` context variable, set in the task
that drives a reply through vLLM's handler), with the reply's ``created`` and
``blake3(key/n)[:16]`` for its n-th id. Run again over the same tokens, vLLM's generators then
yield the same events, byte for byte (``kvj.serve.engine`` feeds them one output per token).
"""

from __future__ import annotations

import contextvars
import importlib
import time as _time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import blake3

if TYPE_CHECKING:
    from kvj.serve.replies import Reply

#: vLLM 0.32's modules whose ``time`` and ``random_uuid`` globals stamp what kvj serve makes durable.
PATCHED: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("vllm.entrypoints.openai.chat_completion.serving", ("time",)),
    ("vllm.entrypoints.openai.chat_completion.protocol", ("time", "random_uuid")),
    ("vllm.entrypoints.openai.completion.serving", ("time",)),
    ("vllm.entrypoints.openai.completion.protocol", ("time", "random_uuid")),
    ("vllm.entrypoints.openai.responses.serving", ("time", "random_uuid")),
    ("vllm.entrypoints.openai.responses.protocol", ("time", "random_uuid")),
    ("vllm.entrypoints.openai.responses.streaming_events", ("random_uuid",)),
    ("vllm.entrypoints.openai.responses.utils", ("random_uuid",)),
    ("vllm.entrypoints.openai.responses.context", ("random_uuid",)),
)


@dataclass(eq=False)
class Drive:
    """One run of vLLM's handler for a reply: live (the engine), or again from its tokens."""

    reply: "Reply"
    mode: str  #: "live": tokens from the engine after the reply's known ones; "replay": its tokens only
    ids: int = 0  #: ids handed out so far in this run


#: The drive of the task that runs a reply's handler (None outside one: vLLM's own behaviour).
DRIVE: contextvars.ContextVar[Optional[Drive]] = contextvars.ContextVar("kvj_serve_drive", default=None)


class _Clock:
    """Stands for the ``time`` module: ``time()`` is the reply's ``created`` inside a drive."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)

    def time(self) -> float:
        drive = DRIVE.get()
        return float(drive.reply.created) if drive is not None else _time.time()


def _random_uuid(original: Any) -> Any:
    def random_uuid() -> str:
        drive = DRIVE.get()
        if drive is None:
            return original()
        drive.ids += 1
        return blake3.blake3(f"{drive.reply.key}/{drive.ids}".encode()).hexdigest()[:16]

    random_uuid.kvj_original = original  # type: ignore[attr-defined]
    return random_uuid


def missing() -> List[str]:
    """The names ``install`` would replace that this vLLM lacks (empty: it can run)."""
    gone = []
    for name, attrs in PATCHED:
        try:
            module = importlib.import_module(name)
        except ImportError:
            gone.append(name)
            continue
        gone += [f"{name}.{attr}" for attr in attrs if not hasattr(module, attr)]
    return gone


def install() -> None:
    """Replace the globals (once; idempotent). Call ``missing()`` first: a name gone is a vLLM
    kvj serve does not know, and it refuses to start rather than serve events that differ."""
    clock = _Clock()
    for name, attrs in PATCHED:
        module = importlib.import_module(name)
        if "time" in attrs and not isinstance(module.time, _Clock):
            module.time = clock
        if "random_uuid" in attrs and not hasattr(module.random_uuid, "kvj_original"):
            module.random_uuid = _random_uuid(module.random_uuid)
