"""Crash-safe training: what a run needs to continue, journaled every step, small.

What is journaled is exactly the state training needs (``training_state``): the trainable
parameters only (for a PEFT model, the adapter; frozen base weights never), the optimizer's
whole ``state_dict()`` (any ``torch.optim`` optimizer: AdamW, SGD with momentum, Adafactor,
fused or capturable variants), the LR scheduler, the gradient scaler, the RNG streams
(Python, NumPy, torch CPU and CUDA), the step and the caller's data position. Any nested
structure of tensors and plain values works, in any mix of dtypes.

``capture`` takes it off the device: each tensor is copied once, straight into its slice of
a host buffer (pinned for CUDA), through ``kvj.segments.device`` (the flusher's copy: kvj's
side stream, after the work that produced the state; the loop's next step waits for it on
the GPU, not on the host), and the tensors of one role and dtype share a buffer (a *stream*:
the model's float32 weights, Adam's ``exp_avg``...). Everything else (the structure, numbers,
the RNG tuples) is one msgpack document, which also carries the streams of at most
``INLINE_BYTES`` (a file and an fsync each would cost more than they hold). Every
``full_every`` steps each other stream is stored as a segment and the save is journaled as
a checkpoint; at other steps such a stream is XORed, as raw bits, against the last
full state and stored through the automatic codec when that pays (a value that moved a
little keeps its sign and exponent, so the XOR's high planes are nearly all zeros), whole
otherwise. Deltas are against the last full state, not chained: recovery reads one
checkpoint and one delta, and a damaged delta falls back to the one before it.

``StateJournal`` saves on a background thread, so the loop waits only for the copy.
``kvj.integrations.hf_trainer`` (Hugging Face ``Trainer``) and the demo's trainer use it.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Mapping, Optional, Tuple, Union

import msgpack
import numpy as np
import torch

from kvj.errors import FormatError, SegmentCorrupt, SegmentMissing
from kvj.journal.state import JournalState
from kvj.segments import device as cuda
from kvj.segments.tensors import DTYPES, dtype_name

if TYPE_CHECKING:
    from kvj.journal.journal import Journal
    from kvj.segments.store import SegmentStore

FORMAT = "kvj-train/2"
FULL_FORMAT = "kvj-train-full/1"
DELTA_FORMAT = "kvj-train-xor/1"
#: The record key of the document segment (structure and plain values); streams are "s:<name>".
TREE = "tree"
STREAM_PREFIX = "s:"
#: Streams this small (a step counter, the RNG states) travel inside the save's document
#: instead of a segment of their own, which would cost a file and an fsync per save.
INLINE_BYTES = 64 << 10

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as a same-sized integer tensor (a view, no copy)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise XOR of two same-shaped tensors' raw bits, as an integer tensor."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise FormatError(f"XOR of {tuple(a.shape)} {a.dtype} with {tuple(b.shape)} {b.dtype}")
    return torch.bitwise_xor(_bits(a), _bits(b))


def unxor(base: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Undo ``xor``: the tensor whose bits XORed with ``base``'s give ``bits``."""
    if bits.dtype != _INT_OF_SIZE[base.element_size()] or bits.shape != base.shape:
        raise FormatError(f"delta of {tuple(bits.shape)} {bits.dtype} does not fit {tuple(base.shape)} {base.dtype}")
    return torch.bitwise_xor(_bits(base), bits).view(base.dtype)


# -- what training needs ---------------------------------------------------------------------


def trainable_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The parameters that train (``requires_grad``), by name: a PEFT model's adapter, never
    its frozen base weights."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> Dict[str, Any]:
    """Python's, NumPy's and torch's (CPU and every initialised CUDA device) RNG states."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": list(cuda)}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Install an ``rng_state()``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                   scheduler: Any = None, scaler: Any = None, data: Any = None, rng: bool = True) -> Dict[str, Any]:
    """What training needs to continue after ``step``, for ``StateJournal.save``: trainable
    parameters, the optimizer's ``state_dict()``, the scheduler's and scaler's, the RNG
    states and ``data`` (the caller's data position: epoch, sampler state, samples seen)."""
    return {"step": step, "model": trainable_state_dict(model), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_state() if rng else None, "data": data}


def restore_training_state(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           scheduler: Any = None, scaler: Any = None, rng: bool = True) -> int:
    """Install a recovered ``training_state`` (``RecoveredState.state``); returns its step.

    Optimizer state goes in through ``optimizer.load_state_dict``, so each value lands where
    that optimizer keeps it (for fused or capturable AdamW, ``step`` on the parameter's device)."""
    load_trainable(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    if rng and state.get("rng") is not None:
        set_rng_state(state["rng"])
    return int(state["step"])


def load_trainable(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy saved trainable parameters into ``model`` (every trainable one must be there)."""
    params = trainable_state_dict(model)
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise FormatError(f"saved trainable parameters do not match the model: missing {missing[:5]}, "
                          f"unexpected {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])


# -- capture: off the device, into host streams and one document ------------------------------


class Snapshot:
    """Host copies of a training state: ``streams`` (one flat tensor per role and dtype),
    ``document`` (the structure and plain values) and the CUDA events after which the
    copies hold their values (none when every tensor was on the CPU).

    The copies are ``kvj.segments.device`` downloads: they run after the work queued so far
    (they read the state as the step left it), and the caller's later work (the next step's
    in-place updates) waits for them on the GPU. The saver thread waits for ``ready``.
    """

    def __init__(self, streams: Dict[str, torch.Tensor], document: Dict[str, Any], ready: Tuple[Any, ...] = ()):
        self.streams = streams
        self.document = document  #: the parsed document: format, tree, leaves (and "inline" when stored)
        self.ready = ready

    @property
    def doc(self) -> bytes:
        """The document, msgpack-encoded (packed by the saver thread, not by ``capture``)."""
        return msgpack.packb(self.document, use_bin_type=True)

    def wait(self) -> None:
        """Block until the copies have landed (blocking events: no core spins meanwhile)."""
        for event in self.ready:
            cuda.CUDA.wait(event)

    def signature(self) -> Dict[str, Tuple[str, int]]:
        """Stream name -> (dtype, numel): a delta needs the same as its base."""
        return {n: (str(t.dtype), t.numel()) for n, t in self.streams.items()}


def _stream_name(path: Tuple[Any, ...], dtype: torch.dtype) -> str:
    """Tensors of one role share a stream: the optimizer's per-parameter state by its key
    (``exp_avg``, ``momentum_buffer``...), anything else by its top-level part."""
    role = str(path[0]) if path else "state"
    if len(path) >= 4 and path[0] == "optimizer" and path[1] == "state":
        role = f"optimizer.{path[3]}"
    return f"{role}.{str(dtype).replace('torch.', '')}"


_PLAIN = (int, float, bool, str, bytes, type(None))


def _encode(value: Any, path: Tuple[Any, ...], leaves: List[Tuple[Tuple[Any, ...], Any]]) -> Any:
    """``value`` as a msgpack-safe tagged tree; tensors and arrays become leaf indices."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if isinstance(value, torch.Tensor):
        leaves.append((path, value))
        return {"t": len(leaves) - 1}
    if isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        leaves.append((path, value))
        return {"n": len(leaves) - 1}
    if kind is dict or isinstance(value, Mapping):
        return {"d": [[_encode(k, path, leaves), _encode(v, path + (k,), leaves)] for k, v in value.items()]}
    if isinstance(value, (tuple, list)):
        tag = "u" if isinstance(value, tuple) else "l"
        if all(type(v) in _PLAIN for v in value):  # Python's RNG state: 625 ints, no recursion
            return {tag: list(value)}
        return {tag: [_encode(v, path + (i,), leaves) for i, v in enumerate(value)]}
    raise FormatError(f"cannot journal a {type(value).__name__} at {'/'.join(map(str, path)) or 'top level'}")


def _decode(node: Any, leaves: List[Any]) -> Any:
    if isinstance(node, dict):
        (tag, body), = node.items()
        if tag in ("t", "n"):
            return leaves[body]
        if tag == "d":
            return {_decode(k, leaves): _decode(v, leaves) for k, v in body}
        if tag == "u":
            return tuple(_decode(v, leaves) for v in body)
        if tag == "l":
            return [_decode(v, leaves) for v in body]
        raise FormatError(f"unknown node {tag!r} in a training state document")
    return node


def capture(state: Mapping[str, Any]) -> Snapshot:
    """Host copies of ``state`` (any nested mapping of tensors, arrays and plain values),
    queued on the caller's thread; see ``Snapshot``. No device memory is allocated.

    A stream whose tensors are all on the CPU is filled by one concatenation into its
    buffer; device tensors are downloaded one by one into their slices."""
    leaves: List[Tuple[Tuple[Any, ...], Any]] = []
    tree = _encode(state, (), leaves)
    groups: Dict[str, List[torch.Tensor]] = {}
    places = []
    sizes: Dict[str, int] = {}
    on_device = set()  # the streams with a device tensor
    for path, value in leaves:
        t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value.detach()
        name = _stream_name(path, t.dtype)
        if cuda.CUDA.is_device_tensor(t):
            on_device.add(name)
        offset = sizes.get(name, 0)
        places.append([name, offset, list(t.shape), "n" if isinstance(value, np.ndarray) else "t"])
        sizes[name] = offset + t.numel()
        groups.setdefault(name, []).append(t)
    streams: Dict[str, torch.Tensor] = {}
    events: Dict[torch.device, Any] = {}
    for name, members in groups.items():
        buf = streams[name] = _host_buffer(sizes[name], members[0].dtype, bool(on_device))
        if name not in on_device:
            torch.cat([t.reshape(-1) for t in members], out=buf)
            continue
        offset = 0
        for t in members:
            dest = buf[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
            if not cuda.CUDA.is_device_tensor(t):
                dest.copy_(t)
            elif t.numel():
                # One d2h stream per device runs its copies in order: the last event covers them all.
                events[cuda.CUDA.device_of(t)] = cuda.CUDA.download(t, dest)
    return Snapshot(streams, {"format": FORMAT, "tree": tree, "leaves": places}, tuple(events.values()))


def _host_buffer(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A flat host tensor for one stream; page-locked when device copies land in it."""
    if not pinned:
        return torch.empty(numel, dtype=dtype)
    return cuda.CUDA.pinned(numel * dtype.itemsize).view(dtype)


def materialize(doc: Union[bytes, Mapping[str, Any]], streams: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """The nested state a ``Snapshot``'s document (encoded or parsed) and streams describe
    (CPU tensors that are views of ``streams``; NumPy arrays copied)."""
    try:
        parsed = _parse(doc) if isinstance(doc, (bytes, bytearray)) else doc
        if parsed.get("format") != FORMAT:
            raise FormatError(f"training state document of format {parsed.get('format')!r}, expected {FORMAT}")
        leaves: List[Any] = []
        for name, offset, shape, kind in parsed["leaves"]:
            numel = int(np.prod(shape)) if shape else 1
            t = streams[name][offset:offset + numel].view(shape)
            leaves.append(t.numpy().copy() if kind == "n" else t)
        return _decode(parsed["tree"], leaves)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"bad training state document: {exc}") from None


def _parse(doc: bytes) -> Dict[str, Any]:
    try:
        parsed = msgpack.unpackb(doc, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData) as exc:
        raise FormatError(f"bad training state document: {exc}") from None
    if not isinstance(parsed, dict):
        raise FormatError("bad training state document: not a map")
    return parsed


@dataclass
class SaveStats:
    """Bytes written by full checkpoints and by deltas (raw = before the codec), in total and
    per stream; ``whole`` counts streams a delta stored whole (their XOR did not pay)."""

    fulls: int = 0
    full_raw: int = 0
    full_stored: int = 0
    deltas: int = 0
    delta_raw: int = 0
    delta_stored: int = 0
    per_stream: Dict[str, Dict[str, int]] = field(default_factory=dict)

    def add(self, name: str, full: bool, whole: bool, info: Any) -> None:
        entry = self.per_stream.setdefault(name, {"full_stored": 0, "delta_stored": 0, "xor": 0, "whole": 0})
        if full:
            self.full_raw += info.raw_size
            self.full_stored += info.stored_size
            entry["full_stored"] += info.stored_size
        else:
            self.delta_raw += info.raw_size
            self.delta_stored += info.stored_size
            entry["delta_stored"] += info.stored_size
            entry["whole" if whole else "xor"] += 1

    def to_dict(self) -> Dict[str, Any]:
        return {"fulls": self.fulls, "full_raw": self.full_raw, "full_stored": self.full_stored,
                "deltas": self.deltas, "delta_raw": self.delta_raw, "delta_stored": self.delta_stored,
                "per_stream": {n: dict(v) for n, v in self.per_stream.items()}}


class StateJournal:
    """Journals training state: a checkpoint every ``full_every`` steps, a delta otherwise.

    ``save`` captures the state (host copies, on the caller's thread) and hands it to one
    background thread (at most ``max_pending`` saves queue; more block the caller), which
    stores the segments durably and then appends the checkpoint or delta record, durably: the
    record is the commit point (``durable_step`` tells how far that has come). A delta stores
    each stream as its XOR against the last full save when that is stored smaller than the
    stream itself, else whole (``meta.whole`` lists those). Which pays is learnt from what was
    stored, without trial compressions: the 1st, 2nd, 4th, 8th... delta on a base stores the
    XOR and compares its stored size with the stream's last whole one (the full save's, until a
    delta stores it whole); deltas between repeat that choice. A save whose streams differ
    from the base's (the optimizer's state appears at its first step) is a full one. ``close``
    (or leaving a ``with`` block) waits for every save. Resuming, pass the ``RecoveredState``
    so the next deltas are taken against its base.
    """

    def __init__(self, journal: "Journal", full_every: int, *, model: str,
                 resume: Optional["RecoveredState"] = None, max_pending: int = 2):
        if full_every < 1:
            raise FormatError("full_every must be at least 1")
        self.journal = journal
        self.full_every = full_every
        self.model = model
        self.stats = SaveStats()
        self._base: Optional[Tuple[int, Snapshot]] = (resume.base_step, resume.base) if resume is not None else None
        self._base_signature = self._base[1].signature() if self._base is not None else None
        # Whether a stream's XOR paid, and the deltas taken against the current base: the
        # choice is tried again at the 1st, 2nd, 4th, 8th... delta (as values drift), against
        # the stream's stored size when last stored whole (unknown after a resume: XOR).
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

    def save(self, step: int, state: Union[Mapping[str, Any], Snapshot]) -> "Future[None]":
        """Journal ``state`` (e.g. ``training_state(...)``) as the state after ``step``. The
        host copy is queued before this returns, so the caller may update its tensors at once."""
        self._slots.acquire()
        try:
            snap = state if isinstance(state, Snapshot) else capture(state)
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
        trial = not full and (n & (n - 1) == 0 or name not in self._xor_pays)
        if not full and (trial or self._xor_pays[name]):
            base_step, base = self._base  # type: ignore[misc]
            layout = self._layout(DELTA_FORMAT, name, t, base_step=base_step)
            info = store.put(xor(t, base.streams[name]), layout=layout)
            if trial:
                whole = self._whole_size.get(name)
                self._xor_pays[name] = whole is None or info.stored_size < whole
            return info, False
        info = store.put(t, layout=self._layout(FULL_FORMAT, name, t))
        self._whole_size[name] = info.stored_size
        return info, not full

    def _write(self, step: int, snap: Snapshot, full: bool) -> None:
        snap.wait()  # the device-to-host copies may still be running
        self._deltas_on_base = 0 if full else self._deltas_on_base + 1
        names = [n for n, t in snap.streams.items() if t.numel() * t.element_size() > INLINE_BYTES]
        inline = {n: [dtype_name(t.dtype), t.view(torch.uint8).numpy().tobytes()]
                  for n, t in snap.streams.items() if n not in names}
        document = {**snap.document, "inline": inline} if inline else snap.document
        doc = torch.frombuffer(bytearray(msgpack.packb(document, use_bin_type=True)), dtype=torch.uint8)
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
            self._base = (step, snap)
            self.stats.fulls += 1
        else:
            lsn = self.journal.delta(step, self._base[0], keys,  # type: ignore[index]
                                     {"format": FORMAT, "model": self.model, "whole": whole}, durable=True)
            self.stats.deltas += 1
        with self._lock:
            self._appended.append((step, lsn))

    @property
    def durable_step(self) -> Optional[int]:
        """The newest step whose save is durable, so where a crash now would resume (None
        before the first). It trails the step just saved by the saves still queued or being
        stored and the journal's group-commit delay."""
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
                fut.result()
        finally:
            self._pool.shutdown(wait=True)
            self._io.shutdown(wait=True)


@dataclass
class RecoveredState:
    """Training state rebuilt from the journal: ``state`` is what was saved (the nested
    structure, CPU tensors) after ``step``; ``base`` the full save the deltas are against."""

    step: int
    state: Dict[str, Any]
    base_step: int
    base: Snapshot
    fallback: Optional[str] = None  #: why a newer delta listed in the journal was not used


def _inline_streams(parsed: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """The streams a stored document carries itself (CPU tensors)."""
    try:
        return {n: (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8))
                .view(DTYPES[dtype]) for n, (dtype, data) in (parsed.get("inline") or {}).items()}
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"bad training state document: {exc}") from None


def _load(store: "SegmentStore", keys: Mapping[str, str],
          device: Union[str, torch.device]) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """A save's document (parsed), its streams stored as segments, and those inside the document."""
    if TREE not in keys:
        raise FormatError("training record has no state document: written by kvj 0.1.0's flat format, "
                          "which this kvj does not resume (finish that run with kvj 0.1.0)")
    doc = _parse(store.get(keys[TREE]).numpy().tobytes())
    streams = {k[len(STREAM_PREFIX):]: store.get(v, device=device) for k, v in keys.items() if k.startswith(STREAM_PREFIX)}
    inline = {n: t.to(device) for n, t in _inline_streams(doc).items()}
    return doc, streams, inline


def recover_training(source: Union[JournalState, Mapping[str, Any]], store: "SegmentStore",
                     device: Union[str, torch.device] = "cpu") -> Optional[RecoveredState]:
    """The newest training state the journal can rebuild: its checkpoint XOR its newest
    readable delta. ``source`` is ``kvj.replay`` state or the ``training`` part of a recovery
    manifest (``{"checkpoint": {...}, "deltas": [...]}``). None when nothing was checkpointed."""
    if isinstance(source, JournalState):
        checkpoint, deltas = source.checkpoint, source.deltas
    else:
        checkpoint, deltas = source.get("checkpoint"), source.get("deltas") or []
    if not checkpoint:
        return None
    base_step = checkpoint["step"]
    base_doc, base_stored, base_inline = _load(store, checkpoint["keys"], device)
    base_streams = {**base_stored, **base_inline}
    base = Snapshot(base_streams, base_doc)
    fallback = None
    for delta in sorted((d for d in deltas if d["base_step"] == base_step), key=lambda d: -d["step"]):
        try:
            doc, stored, inline = _load(store, delta["keys"], device)
        except (SegmentMissing, SegmentCorrupt) as exc:
            fallback = f"delta of step {delta['step']} unreadable ({exc})"
            continue
        whole = set((delta.get("meta") or {}).get("whole", []))
        if set(stored) | set(inline) != set(base_streams):
            raise FormatError(f"delta of step {delta['step']} holds streams {sorted({*stored, *inline})}, "
                              f"its base {sorted(base_streams)}")
        streams = {n: t if n in whole else unxor(base_streams[n], t) for n, t in stored.items()}
        return RecoveredState(delta["step"], materialize(doc, {**streams, **inline}), base_step, base, fallback)
    streams = {n: t.clone() for n, t in base_streams.items()}
    return RecoveredState(base_step, materialize(base_doc, streams), base_step, base, fallback)
