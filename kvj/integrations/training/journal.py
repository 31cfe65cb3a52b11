"""Journaling training saves: a checkpoint every ``full_every`` steps, XOR deltas between.

A delta XORs each stream against the last checkpoint (never chained: recovery reads one of
each), which the codec stores small when values moved a little; small streams travel inside
the save's document (kvj-segment(5) TRAINING STATE). Saves are stored on a background
thread: the training loop waits neither for the disk nor for the copy.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Mapping, Optional, Tuple, Union

import msgspec
import torch

from kvj.errors import FormatError
from kvj.integrations.training.delta import xor, xorable
from kvj.integrations.training.host import FORMAT, Capture, StateBuffers
from kvj.segments.tensors import dtype_name

if TYPE_CHECKING:
    from kvj.integrations.training.recover import RecoveredState
    from kvj.journal.journal import Journal

FULL_FORMAT = "kvj-train-full/1"
DELTA_FORMAT = "kvj-train-xor/1"
#: The record keys of a save's document and of its streams' segments ("s:<name>").
TREE = "tree"
STREAM_PREFIX = "s:"
#: Streams this small travel inside the document: a segment would cost a file and an fsync.
INLINE_BYTES = 64 << 10


@dataclass
class Tally:
    """Saves of one kind: how many, and their bytes before (raw) and after the codec (stored)."""

    count: int = 0
    raw: int = 0
    stored: int = 0


@dataclass
class SaveStats:
    """Bytes written by checkpoints and deltas, in total and per stream (``whole``: streams a
    delta stored whole, their XOR not paying)."""

    full: Tally = field(default_factory=Tally)
    delta: Tally = field(default_factory=Tally)
    per_stream: Dict[str, Dict[str, int]] = field(default_factory=dict)

    def add(self, name: str, full: bool, whole: bool, info: Any) -> None:
        """Count stream ``name``'s segment ``info`` in a full save or a delta."""
        entry = self.per_stream.setdefault(name, {"full_stored": 0, "delta_stored": 0, "xor": 0, "whole": 0})
        tally = self.full if full else self.delta
        tally.raw += info.raw_size
        tally.stored += info.stored_size
        entry["full_stored" if full else "delta_stored"] += info.stored_size
        if not full:
            entry["whole" if whole else "xor"] += 1

    def to_dict(self) -> Dict[str, Any]:
        return {"fulls": self.full.count, "full_raw": self.full.raw, "full_stored": self.full.stored,
                "deltas": self.delta.count, "delta_raw": self.delta.raw, "delta_stored": self.delta.stored,
                "per_stream": {n: dict(v) for n, v in self.per_stream.items()}}


class StateJournal:
    """Journals training state: a checkpoint every ``full_every`` steps, a delta otherwise.

    ``save`` captures the state on the caller's thread and queues it (at most ``max_pending``)
    for one background thread, which stores the segments, then appends the record durably:
    the commit point (``durable_step``). A delta stores a stream whole when its XOR does not
    store smaller, learnt without trial compressions: the 1st, 2nd, 4th, 8th... delta on a
    base tries the XOR against the stream's last whole size, deltas between repeat the choice.
    A save whose streams differ from the base's is a full one. Resuming, pass the
    ``RecoveredState``; pass the ``optimizer`` so that on a GPU only its next step waits.
    """

    def __init__(self, journal: "Journal", full_every: int, *, model: str,
                 resume: Optional["RecoveredState"] = None, max_pending: int = 2,
                 optimizer: Optional[torch.optim.Optimizer] = None):
        if full_every < 1:
            raise FormatError("full_every must be at least 1")
        if max_pending < 1:
            raise FormatError("max_pending must be at least 1")
        self.journal = journal
        self.full_every = full_every
        self.model = model
        self.stats = SaveStats()
        self._buffers = StateBuffers(max_pending, optimizer)
        # The last full save's streams, in host memory of its own: what deltas are XORed against.
        self._base: Optional[Tuple[int, Dict[str, torch.Tensor]]] = None
        self._base_owned = False  # whether the base's buffers are ours to overwrite
        if resume is not None:
            self._base = (resume.base_step, dict(resume.base.streams))
        self._base_signature = resume.base.signature() if resume is not None else None
        # Whether a stream's XOR paid, its stored size when last whole (unknown after a resume:
        # XOR), and the deltas taken against the current base.
        self._xor_pays: Dict[str, bool] = {}
        self._whole_size: Dict[str, int] = {}
        self._deltas_on_base = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvj-train-save")
        self._io = ThreadPoolExecutor(4, thread_name_prefix="kvj-train-put")
        self._slots = threading.Semaphore(max_pending)
        self._pending: List["Future[None]"] = []
        self._lock = threading.Lock()
        self._durable: Optional[int] = resume.step if resume is not None else None
        self._appended: Deque[Tuple[int, int]] = deque()  # (step, LSN) of records maybe not yet durable
        self._failure: Optional[BaseException] = None  # the first save that failed

    def save(self, step: int, state: Union[Mapping[str, Any], Capture]) -> "Future[None]":
        """Journal ``state`` (e.g. ``training_state(...)``) as the state after ``step``; the caller
        may go on at once (``StateBuffers`` orders its stream). After a save failed, every later
        one raises that failure: nothing after it is durable."""
        self._slots.acquire()
        try:
            if self._failure is not None:
                raise self._failure
            snap = state if isinstance(state, Capture) else self._buffers.capture(state)
        except BaseException:
            self._slots.release()
            raise
        signature = snap.signature()
        full = step % self.full_every == 0 or signature != self._base_signature
        if full:
            self._base_signature = signature  # the thread installs the base itself once durable
        fut = self._pool.submit(self._write, step, snap, full)
        fut.add_done_callback(lambda _: self._slots.release())
        self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def _layout(self, fmt: str, name: str, t: torch.Tensor, **extra: Any) -> Dict[str, Any]:
        return {"format": fmt, "model": self.model, "name": name, "dtype": str(t.dtype).replace("torch.", ""),
                "numel": t.numel(), **extra}

    def _put(self, name: str, t: torch.Tensor, full: bool) -> Tuple[Any, bool]:
        """Store one stream of a save; (its SegmentInfo, whether a delta stored it whole)."""
        store = self.journal.store
        n = self._deltas_on_base
        can_xor = xorable(t)
        trial = not full and can_xor and (n & (n - 1) == 0 or name not in self._xor_pays)
        if trial or (not full and can_xor and self._xor_pays[name]):
            base_step, base = self._base  # type: ignore[misc]
            layout = self._layout(DELTA_FORMAT, name, t, base_step=base_step)
            info = store.put(xor(t, base[name]), layout=layout)
            if trial:
                whole = self._whole_size.get(name)
                self._xor_pays[name] = whole is None or info.stored_size < whole
            return info, False
        info = store.put(t, layout=self._layout(FULL_FORMAT, name, t))
        self._whole_size[name] = info.stored_size
        return info, not full

    def _write(self, step: int, snap: Capture, full: bool) -> None:
        landed = False
        try:
            snap.wait()  # the device-to-host copies may still be running
            landed = True
            self._store(step, snap, full)
        except BaseException as exc:
            with self._lock:
                self._failure = self._failure or exc
            raise
        finally:
            snap.release(landed)

    def _store(self, step: int, snap: Capture, full: bool) -> None:
        self._deltas_on_base = 0 if full else self._deltas_on_base + 1
        names = [n for n, t in snap.streams.items() if t.numel() * t.element_size() > INLINE_BYTES]
        inline = {n: [dtype_name(t.dtype), t.view(torch.uint8).numpy().tobytes()]
                  for n, t in snap.streams.items() if n not in names}
        document = {**snap.document, "inline": inline} if inline else snap.document
        doc = torch.frombuffer(bytearray(msgspec.msgpack.encode(document)), dtype=torch.uint8)
        # Segments are stored concurrently, so their fsyncs overlap; the record follows them all.
        doc_put = self._io.submit(self.journal.store.put, doc, layout=self._layout(FORMAT, TREE, doc))
        results = list(self._io.map(lambda name: self._put(name, snap.streams[name], full), names))
        keys: Dict[str, str] = {TREE: doc_put.result().key}
        whole: List[str] = []
        for name, (info, stored_whole) in zip(names, results):
            keys[STREAM_PREFIX + name] = info.key
            self.stats.add(name, full, stored_whole, info)
            if stored_whole:
                whole.append(name)
        # Durable at once (not after the group-commit delay): a crash loses only what is queued.
        if full:
            lsn = self.journal.checkpoint(step, keys, {"format": FORMAT, "model": self.model}, durable=True)
            self._keep_base(step, snap)
            self.stats.full.count += 1
        else:
            lsn = self.journal.delta(step, self._base[0], keys,  # type: ignore[index]
                                     {"format": FORMAT, "model": self.model, "whole": whole}, durable=True)
            self.stats.delta.count += 1
        with self._lock:
            self._appended.append((step, lsn))

    def _keep_base(self, step: int, snap: Capture) -> None:
        """Copy the full save ``snap`` into the base buffers (reused while the streams keep their
        sizes; a resumed base is the caller's, never overwritten)."""
        old = self._base[1] if self._base is not None and self._base_owned else {}
        base = {}
        for name, t in snap.streams.items():
            keep = old.get(name)
            if keep is None or keep.dtype != t.dtype or keep.numel() != t.numel():
                keep = torch.empty(t.numel(), dtype=t.dtype)
            base[name] = keep.copy_(t)
        self._base, self._base_owned = (step, base), True

    @property
    def durable_step(self) -> Optional[int]:
        """The newest step whose save is durable: where a crash now would resume (None before the
        first)."""
        durable_lsn = self.journal.durable_lsn
        with self._lock:
            while self._appended and self._appended[0][1] <= durable_lsn:
                self._durable = self._appended.popleft()[0]
            return self._durable

    def __enter__(self) -> "StateJournal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every save (re-raising the first failure) and stop the threads."""
        try:
            for fut in self._pending:
                fut.exception()
            if self._failure is not None:
                raise self._failure
        finally:
            self._buffers.close()
            self._pool.shutdown(wait=True)
            self._io.shutdown(wait=True)

