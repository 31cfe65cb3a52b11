"""The reply journal (``JOURNAL/replies/``) and each reply's state in the API process.

One kvj journal, written by the ``kvj serve`` API process only (the engine journal has its own
writer, the connector's worker). Per client request (a *reply*, keyed ``chatcmpl-ID``,
``cmpl-ID`` or ``resp_ID``): a START whose meta holds the request's body, ``created`` and kind;
TOKENS records with the tokens released to clients; a REPLY record once it finished (durable
before its terminal events go out); an END when its retention passed, its byte budget evicted
it or an operator abandoned it. Events are never stored: they are a function of the body,
``created``, the key and the tokens (``kvj.serve.determinism``), derived again on demand.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import blake3
import numpy as np

import kvj
from kvj.journal.config import CommitPolicy
from kvj.journal.records import RecordType

#: The reply journal's START ``meta.format``.
REPLY_FORMAT = "kvj-serve-reply/1"
KINDS = ("chat", "completion", "responses")
#: REPLY statuses after which the reply has all its tokens (its terminal events exist).
COMPLETE = ("completed", "incomplete")
#: Group commit of the reply journal: tokens records stay cheap, the window stays small.
POLICY = CommitPolicy(max_delay=0.02, file_size_limit=8 << 20)


def prompt_digest(token_ids: List[int]) -> str:
    """BLAKE3 of a prompt's token ids (little-endian uint32): a restored reply renders to the same prompt."""
    return blake3.blake3(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


@dataclass(eq=False)
class Reply:
    """One client request's reply: what the journal holds of it, and its events while they are kept."""

    key: str
    kind: str  #: chat, completion or responses
    body: Dict[str, Any]  #: the request as validated (its request_id fixed)
    created: int  #: Unix seconds: vLLM's ``created`` of every event
    stream: bool
    admission: str = "arrival"
    prompt_hash: Optional[str] = None
    engine_id: Optional[str] = None  #: the request id vLLM's handler gave the engine
    journaled: int = 0  #: tokens the reply journal holds (its START and TOKENS records)
    tokens: List[int] = field(default_factory=list)  #: tokens released to clients, in order
    known: List[int] = field(default_factory=list)  #: tokens a restored reply has before asking the engine
    end: Optional[Dict[str, Any]] = None  #: its REPLY record's fields, once finished
    text: str = ""  #: its text so far (kvj's detokenizer)
    frames: Optional[List[str]] = None  #: its events so far; None: dropped, derived again on demand
    done: bool = False  #: the events kept are all it will have in this process
    error: Optional[Dict[str, Any]] = None  #: an OpenAI error body, when its request failed
    status_code: int = 200
    task: Optional["asyncio.Task[Any]"] = None
    opened: Optional["asyncio.Future[None]"] = None  #: set once its START is appended (durable: durable)
    readers: int = 0
    last_read: float = field(default_factory=time.monotonic)
    restored: Optional[str] = None  #: how it came back at start-up (resume, scratch, held), if it did
    _changed: Optional[asyncio.Event] = None

    @property
    def finished(self) -> bool:
        """It has its REPLY record: completed, incomplete, cancelled, failed or handed off."""
        return self.end is not None

    @property
    def status(self) -> str:
        """completed, incomplete, cancelled, failed or handoff once finished; else in_progress."""
        return self.end["status"] if self.end is not None else "in_progress"

    def notify(self) -> None:
        """Wake the readers waiting for more of its events."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def changed(self) -> None:
        """Wait until ``notify``."""
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    def held_bytes(self) -> int:
        """What it costs the reply budget: its tokens' records and its body."""
        return 4 * len(self.tokens) + len(str(self.body))

    def meta(self) -> Dict[str, Any]:
        """Its START record's meta."""
        return {"format": REPLY_FORMAT, "kind": self.kind, "body": self.body, "created": self.created,
                "stream": self.stream, "engine_id": self.engine_id, "admission": self.admission}

    @classmethod
    def from_state(cls, req: "kvj.RequestState") -> "Reply":
        """A reply as its journal left it (its START's meta, tokens and REPLY)."""
        meta = req.meta
        return cls(req.id, meta["kind"], dict(meta["body"]), int(meta["created"]), bool(meta["stream"]),
                   str(meta.get("admission") or "arrival"), req.prompt_hash, meta.get("engine_id"),
                   journaled=len(req.output), tokens=list(req.output), known=list(req.output),
                   end=dict(req.reply) if req.reply is not None else None)


class ReplyLog:
    """The reply journal, opened for writing by the API process; durability awaited off the event loop."""

    def __init__(self, journal: "kvj.Journal"):
        self.journal = journal
        self.path = journal.path
        self.failed: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._waiters: List[tuple] = []  # (lsn, future, loop)
        self._want = 0
        self._closing = False
        self._thread = threading.Thread(target=self._wait_loop, name="kvj-serve-durable", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, path: str) -> "ReplyLog":
        """Open (creating) the reply journal at ``path`` for writing: its writer lock, its torn tail cut."""
        return cls(kvj.Journal.open(path, policy=POLICY))

    def opened(self, reply: Reply) -> int:
        """START: the request, before the engine sees it."""
        return self._lsn(self.journal.start(reply.key, reply.prompt_hash, None, reply.meta()))

    def released(self, reply: Reply, tokens: List[int]) -> int:
        """TOKENS: tokens released to clients, after those the journal holds."""
        lsn = self._lsn(self.journal.tokens(reply.key, reply.journaled, tokens))
        reply.journaled += len(tokens)
        return lsn

    def finished(self, reply: Reply, end: Dict[str, Any]) -> int:
        """REPLY: how it finished (durable before its terminal events: ``durable``)."""
        payload = {"id": reply.key, **{k: v for k, v in end.items() if v not in (None, 0) or k == "count"}}
        return self.journal.append(RecordType.REPLY, payload)

    def ended(self, key: str, status: str) -> int:
        """END: expired, evicted or abandoned; the journal forgets it at the next compaction."""
        return self._lsn(self.journal.end(key, status))

    @staticmethod
    def _lsn(lsn: Any) -> int:
        return lsn if isinstance(lsn, int) else lsn.result()  # a future only while a request's flushes run

    async def durable(self, lsn: int) -> None:
        """Return once record ``lsn`` is durable (a failed fsync raises, here and for good)."""
        if self.failed is not None:
            raise self.failed
        if self.journal.durable_lsn >= lsn:
            return
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            self._waiters.append((lsn, future, asyncio.get_running_loop()))
            self._want = max(self._want, lsn)
            self._cond.notify()
        await future

    def _wait_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and self._want <= self.journal.durable_lsn:
                    self._cond.wait()
                if self._closing and not self._waiters:
                    return
                want = self._want
            error: Optional[BaseException] = None
            try:
                self.journal.writer.wait_durable(want)
            except BaseException as exc:  # a failed fsync is final: every waiter learns it
                error = self.failed = exc
            with self._cond:
                durable = self.journal.durable_lsn
                ready = [w for w in self._waiters if error is not None or w[0] <= durable]
                self._waiters = [w for w in self._waiters if w not in ready]
                if error is not None:
                    self._want = 0
            for _lsn, future, loop in ready:
                loop.call_soon_threadsafe(_settle, future, error)
            if error is not None:
                return

    def sync(self) -> None:
        """Everything appended so far is durable."""
        self.journal.sync()

    def close(self) -> None:
        """Make everything durable, stop the waiter, release the writer lock."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        try:
            self.journal.close()
        finally:
            self._thread.join(timeout=5)


def _settle(future: "asyncio.Future[None]", error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
