"""Crash-safe fine-tuning: full model and AdamW state every K steps, XOR deltas in between.

The training state is three flat tensors (parameters, AdamW ``exp_avg`` and ``exp_avg_sq``,
in parameter order) and the step count. Every ``full_every`` steps the three are stored
as segments and journaled as a checkpoint. At every other step each is XORed, as raw
bits, against the last full state and stored through the store's automatic codec: a value
that moved a little keeps its sign and exponent, so the XOR's high byte planes are almost
all zeros and compress to nearly nothing. Each delta is against the last full state (not
chained), so recovery reads one checkpoint and one delta, and a damaged delta falls back
to the one before it.

Saving runs on a background thread (``StateJournal``), so the training loop waits only
for the copy of its state, never for the disk. With deterministic data (a function of
the step), no dropout and a fixed thread count, a run killed at any step and resumed from
its journal ends with parameters bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from kvj.errors import FormatError, SegmentCorrupt, SegmentMissing
from kvj.journal.state import JournalState
from kvj.segments.codecs import auto_codec

if TYPE_CHECKING:
    from kvj.journal.journal import Journal
    from kvj.segments.store import SegmentStore

#: Names of the flat state tensors, in the order they are stored.
STATE_NAMES = ("params", "exp_avg", "exp_avg_sq")
FULL_FORMAT = "kvj-train-full/1"
DELTA_FORMAT = "kvj-train-xor/1"
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


class Snapshot(dict):
    """Named host (CPU) copies of training state, and the CUDA event after which they hold
    their values (none when every source was on the CPU).

    The copies are queued on the producing device's current stream, so they read the state
    as the step left it; the next step's in-place updates, queued after them on the same
    stream, cannot overwrite the state before it is copied. The saver thread waits for
    ``ready`` before it reads a byte.
    """

    ready: Tuple[Any, ...] = ()

    def wait(self) -> None:
        """Block until the copies have landed (blocking events: no core spins meanwhile)."""
        for event in self.ready:
            event.synchronize()


def _host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def _finish(snap: Snapshot, sources: Sequence[torch.Tensor]) -> Snapshot:
    """Record, on each source device's current stream, the event that follows the copies."""
    events = []
    for device in {t.device for t in sources if t.device.type == "cuda"}:
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    snap.ready = tuple(events)
    return snap


def snapshot(state: Mapping[str, torch.Tensor]) -> Snapshot:
    """Host copies of ``state``'s tensors, queued on the caller's thread (see ``Snapshot``)."""
    if isinstance(state, Snapshot):
        return state
    sources = [t.detach() for t in state.values()]
    pin = any(t.device.type == "cuda" for t in sources)
    snap = Snapshot()
    for name, t in zip(state, sources):
        host = _host_buffer(t.numel(), t.dtype, pin and t.device.type == "cuda").view(t.shape)
        host.copy_(t, non_blocking=pin)
        snap[name] = host
    return _finish(snap, sources)


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
    """Parameters and AdamW moments as three flat host tensors, zeros before step 1.

    Each tensor is copied straight into its slice of a host buffer: no concatenated copy
    of the state is ever made on the device.
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    dtype = params[0].dtype if params else torch.float32
    pin = any(p.device.type == "cuda" for p in params)
    snap = Snapshot({name: _host_buffer(total, dtype, pin) for name in STATE_NAMES})
    offset = 0
    for p in params:
        n = p.numel()
        sources = {"params": p.detach()}
        for name in STATE_NAMES[1:]:
            sources[name] = optimizer.state[p][name] if p in optimizer.state else None
        for name, src in sources.items():
            dest = snap[name][offset:offset + n]
            if src is None:
                dest.zero_()
            else:
                dest.copy_(src.reshape(-1), non_blocking=pin)
        offset += n
    return _finish(snap, params)


def load_flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    state: Mapping[str, torch.Tensor]) -> None:
    """Install a ``flat_state`` taken after ``step`` optimizer steps into model and optimizer.

    The optimizer state goes in through ``optimizer.load_state_dict``, so each value lands
    where that optimizer keeps it (for fused or capturable AdamW, ``step`` on the
    parameter's device)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    for name in STATE_NAMES:
        if state[name].numel() != total:
            raise FormatError(f"state {name} holds {state[name].numel()} values, the model has {total}")
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    per_param: Dict[int, Dict[str, torch.Tensor]] = {}
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(state["params"][offset:offset + n].view_as(p))
            if step > 0 and id(p) in index:
                per_param[index[id(p)]] = {
                    "step": torch.tensor(float(step), dtype=torch.float32),
                    "exp_avg": state["exp_avg"][offset:offset + n].view_as(p).clone(),
                    "exp_avg_sq": state["exp_avg_sq"][offset:offset + n].view_as(p).clone()}
            offset += n
    sd = optimizer.state_dict()
    sd["state"] = per_param
    optimizer.load_state_dict(sd)


@dataclass
class SaveStats:
    """Bytes written by full checkpoints and by deltas (raw = before the codec), in total and
    per state tensor; ``whole`` counts tensors a delta stored whole (their XOR did not pay)."""

    fulls: int = 0
    full_raw: int = 0
    full_stored: int = 0
    deltas: int = 0
    delta_raw: int = 0
    delta_stored: int = 0
    per_tensor: Dict[str, Dict[str, int]] = field(
        default_factory=lambda: {n: {"full_stored": 0, "delta_stored": 0, "xor": 0, "whole": 0} for n in STATE_NAMES})

    def add(self, name: str, full: bool, whole: bool, info: Any) -> None:
        entry = self.per_tensor[name]
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
                "per_tensor": {n: dict(v) for n, v in self.per_tensor.items()}}


_SAMPLE_SLICES, _SAMPLE_BYTES = 4, 64 << 10


def estimate_stored(t: torch.Tensor, is_float: bool) -> int:
    """Bytes the automatic codec turns a sample of ``t`` (at most 256 KiB, from four places)
    into: a cheap way to compare two encodings of the same state."""
    buf = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
    if len(buf) > _SAMPLE_SLICES * _SAMPLE_BYTES:
        step = (len(buf) - _SAMPLE_BYTES) // (_SAMPLE_SLICES - 1) // t.element_size() * t.element_size()
        buf = memoryview(b"".join(buf[i * step:i * step + _SAMPLE_BYTES] for i in range(_SAMPLE_SLICES)))
    return len(auto_codec(buf, t.element_size(), is_float).encode(buf, t.element_size()))


class StateJournal:
    """Journals training state: a checkpoint every ``full_every`` steps, a delta otherwise.

    ``save`` hands the state to one background thread (at most ``max_pending`` saves
    queue; more block the caller) which stores the segments durably and then appends the
    checkpoint or delta record. In a delta, a tensor whose XOR would not compress better
    than the tensor itself (Adam's first moment moves ~10% a step) is stored whole, and
    the record's ``meta.whole`` lists it. ``close`` (or leaving a ``with`` block) waits
    for every save. Resuming, pass the recovered base (``RecoveredState.base_step`` and
    ``base_state``) so the next deltas are taken against it.
    """

    def __init__(self, journal: "Journal", full_every: int, *, model: str,
                 base: Optional[Tuple[int, Mapping[str, torch.Tensor]]] = None, max_pending: int = 2):
        if full_every < 1:
            raise FormatError("full_every must be at least 1")
        self.journal = journal
        self.full_every = full_every
        self.model = model
        self.stats = SaveStats()
        self._base = (base[0], {n: t.cpu() for n, t in base[1].items()}) if base is not None else None
        self._has_base = base is not None  # a full save is scheduled or done (the thread sets _base)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvj-train-save")
        self._io = ThreadPoolExecutor(len(STATE_NAMES), thread_name_prefix="kvj-train-put")
        self._slots = threading.Semaphore(max_pending)
        self._pending: List["Future[None]"] = []

    def save(self, step: int, state: Mapping[str, torch.Tensor]) -> "Future[None]":
        """Journal the state after ``step``. Host copies are queued before this returns (a
        ``flat_state`` already is one), so the caller may update the tensors at once."""
        full = step % self.full_every == 0 or not self._has_base
        self._has_base = True
        self._slots.acquire()
        try:
            snap = snapshot(state)  # on the caller's thread: later in-place updates cannot reach it
        except BaseException:
            self._slots.release()
            raise
        fut = self._pool.submit(self._write, step, snap, full)
        fut.add_done_callback(lambda _: self._slots.release())
        self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def _layout(self, fmt: str, name: str, t: torch.Tensor, **extra: Any) -> Dict[str, Any]:
        return {"format": fmt, "model": self.model, "name": name, "dtype": str(t.dtype).replace("torch.", ""),
                "numel": t.numel(), **extra}

    def _put(self, name: str, t: torch.Tensor, full: bool) -> Tuple[Any, bool]:
        """Store one tensor of a save; (its SegmentInfo, whether a delta stored it whole)."""
        store = self.journal.store
        if full:
            return store.put(t, layout=self._layout(FULL_FORMAT, name, t)), False
        base_step, base = self._base  # type: ignore[misc]
        bits = xor(t, base[name])
        if estimate_stored(bits, False) < estimate_stored(t, t.is_floating_point()):
            return store.put(bits, layout=self._layout(DELTA_FORMAT, name, t, base_step=base_step)), False
        return store.put(t, layout=self._layout(FULL_FORMAT, name, t)), True

    def _write(self, step: int, state: Snapshot, full: bool) -> None:
        state.wait()  # the device-to-host copies were queued on the producing stream
        # The tensors are stored concurrently, so their fsyncs overlap; the record follows all three.
        results = list(self._io.map(lambda name: self._put(name, state[name], full), STATE_NAMES))
        keys: Dict[str, str] = {}
        whole: List[str] = []
        for name, (info, stored_whole) in zip(STATE_NAMES, results):
            keys[name] = info.key
            self.stats.add(name, full, stored_whole, info)
            if stored_whole:
                whole.append(name)
        if full:
            self.journal.checkpoint(step, keys, {"model": self.model})
            self._base = (step, state)
            self.stats.fulls += 1
        else:
            self.journal.delta(step, self._base[0], keys, {"model": self.model, "whole": whole})  # type: ignore[index]
            self.stats.deltas += 1

    def __enter__(self) -> "StateJournal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every save (re-raising the first failure) and stop the thread."""
        try:
            for fut in self._pending:
                fut.result()
        finally:
            self._pool.shutdown(wait=True)
            self._io.shutdown(wait=True)


@dataclass
class RecoveredState:
    """Training state rebuilt from the journal."""

    step: int
    state: Dict[str, torch.Tensor]
    base_step: int
    base_state: Dict[str, torch.Tensor]
    fallback: Optional[str] = None  #: why a newer delta listed in the journal was not used


def _load(store: "SegmentStore", keys: Mapping[str, str], device: Union[str, torch.device]) -> Dict[str, torch.Tensor]:
    missing = [n for n in STATE_NAMES if n not in keys]
    if missing:
        raise FormatError(f"training record lacks tensors {missing}")
    return {name: store.get(keys[name], device=device) for name in STATE_NAMES}


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
    base = _load(store, checkpoint["keys"], device)
    fallback = None
    for delta in sorted((d for d in deltas if d["base_step"] == base_step), key=lambda d: -d["step"]):
        try:
            stored = _load(store, delta["keys"], device)
        except (SegmentMissing, SegmentCorrupt) as exc:
            fallback = f"delta of step {delta['step']} unreadable ({exc})"
            continue
        whole = set((delta.get("meta") or {}).get("whole", []))
        state = {n: stored[n] if n in whole else unxor(base[n], stored[n]) for n in STATE_NAMES}
        return RecoveredState(delta["step"], state, base_step, base, fallback)
    return RecoveredState(base_step, {n: t.clone() for n, t in base.items()}, base_step, base, fallback)
