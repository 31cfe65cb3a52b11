"""Crash-safe training: what a run needs to continue, journaled every step, small.

What is journaled is exactly the state training needs (``training_state``): the trainable
parameters only (for a PEFT model, the adapter; frozen base weights never), the optimizer's
whole ``state_dict()`` (any ``torch.optim`` optimizer: AdamW, SGD with momentum, Adafactor,
fused or capturable variants), the LR scheduler, the gradient scaler, the RNG streams
(Python, NumPy, torch CPU and CUDA), the step and the caller's data position. Any nested
structure of tensors and plain values works, in any mix of dtypes.

``StateBuffers.capture`` takes it off the device without the host waiting for the GPU.
The tensors of one role and dtype share a *stream* (the model's float32 weights, Adam's
``exp_avg``...); on a GPU each stream's tensors are gathered, on kvj's side stream, into one
device buffer kept for the run, and copied with one device-to-host copy into host buffers
kept for the run (pinned, one per save in flight), all through ``kvj.segments.device``; only
the optimizer's next step waits for the gather, on the GPU (a step pre-hook). On the CPU the
tensors are stacked straight into the host buffers. Everything else (the structure, numbers,
the RNG tuples) is one msgpack document, which also carries the streams of at most
``INLINE_BYTES`` (a file and an fsync each would cost more than they hold). Every
``full_every`` steps each other stream is stored as a segment and the save is journaled as
a checkpoint; at other steps such a stream is XORed, as raw bits, against the last
full state and stored through the automatic codec when that pays (a value that moved a
little keeps its sign and exponent, so the XOR's high planes are nearly all zeros), whole
otherwise. Deltas are against the last full state, not chained: recovery reads one
checkpoint and one delta, and a damaged delta falls back to the one before it.

``StateJournal`` stores on a background thread: the loop waits neither for the disk nor
for the copy.
``kvj.integrations.hf_trainer`` (Hugging Face ``Trainer``) and the demo's trainer use it.
"""

from __future__ import annotations

import random
import threading
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Mapping, Optional, Tuple, Union

import msgpack
import numpy as np
import torch

from kvj.errors import FormatError, SegmentCorrupt, SegmentMissing
from kvj.journal.state import JournalState
from kvj.segments import device as cuda
from kvj.segments.tensors import DTYPE_NAMES, DTYPES, dtype_name

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
    # A copy of its own: torch.set_rng_state crashes (SIGSEGV, torch 2.13) on a tensor at a
    # storage offset, which is what a view of a capture's stream is.
    torch.set_rng_state(state["torch"].clone())
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def optimizer_shapes(optimizer: torch.optim.Optimizer) -> List[List[List[int]]]:
    """The shapes of the parameters ``optimizer`` holds, group by group (each group as
    ``[ranks, dims]``: every parameter's number of dimensions, then all dimensions in one
    list, which costs the save next to nothing): what its state was made for. Journaled
    beside that state, so a resume can refuse state made for parameters of other shapes
    (``load_state_dict`` takes it, and a fused kernel reads and writes past its end)."""
    return [[[p.dim() for p in group["params"]], list(chain.from_iterable(p.shape for p in group["params"]))]
            for group in optimizer.param_groups]


def _journaled_shapes(record: Any) -> List[List[Tuple[int, ...]]]:
    """``optimizer_shapes``' record back as one shape per parameter, group by group."""
    if not isinstance(record, list):
        raise FormatError("the journaled optimizer state does not say which parameter shapes it was made for "
                          "(optimizer_shapes, as training_state journals it)")
    groups = []
    for entry in record:
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, list) for x in entry)
                and sum(entry[0]) == len(entry[1])):
            raise FormatError(f"bad optimizer_shapes entry in the journaled state: {entry!r:.80}")
        ranks, dims = entry
        at, shapes = 0, []
        for rank in ranks:
            shapes.append(tuple(dims[at:at + rank]))
            at += rank
        groups.append(shapes)
    return groups


def scaler_state(scaler: Any) -> Optional[Dict[str, Any]]:
    """``scaler.state_dict()`` without its host synchronisation: ``state_dict()`` reads the
    scale and the growth tracker with ``.item()``, which waits for the GPU at every save.
    Here they are the scaler's own tensors (as a model's ``state_dict()`` holds its
    parameters); ``StateBuffers`` reads them before the caller's stream goes on, and
    ``load_scaler`` installs the result."""
    if scaler is None:
        return None
    if not scaler.is_enabled() or scaler._scale is None:  # disabled, or before its first scale(): no tensors
        return scaler.state_dict()
    return {"scale": scaler._scale, "growth_factor": scaler._growth_factor, "backoff_factor": scaler._backoff_factor,
            "growth_interval": scaler._growth_interval, "_growth_tracker": scaler._growth_tracker}


def load_scaler(scaler: Any, state: Mapping[str, Any]) -> None:
    """Install a ``scaler_state()`` (or a ``state_dict()``) into ``scaler``."""
    scaler.load_state_dict({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in state.items()})


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                   scheduler: Any = None, scaler: Any = None, data: Any = None, rng: bool = True) -> Dict[str, Any]:
    """What training needs to continue after ``step``, for ``StateJournal.save``: trainable
    parameters, the optimizer's ``state_dict()`` (and the shapes of the parameters it is
    for), the scheduler's and scaler's state, the RNG states and ``data`` (the caller's data
    position: epoch, sampler state, samples seen). Nothing here waits for the GPU."""
    return {"step": step, "model": trainable_state_dict(model), "optimizer": optimizer.state_dict(),
            "optimizer_shapes": optimizer_shapes(optimizer),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler_state(scaler), "rng": rng_state() if rng else None, "data": data}


def restore_training_state(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           scheduler: Any = None, scaler: Any = None, rng: bool = True) -> int:
    """Install a recovered ``training_state`` (``RecoveredState.state``); returns its step.

    Everything is checked before anything is copied: a parameter or optimizer state that
    does not fit (a changed LoRA rank, target modules, dtype or parameter grouping) is a
    ``FormatError`` naming it. Optimizer settings that differ from the journaled ones (a new
    learning rate...) are named in one warning: the journaled ones are what continues.
    Optimizer state goes in through ``optimizer.load_state_dict``, so each value lands where
    that optimizer keeps it (for fused or capturable AdamW, ``step`` on the parameter's device)."""
    check_trainable(model, state.get("model"))
    check_optimizer_state(optimizer, state.get("optimizer"), state.get("optimizer_shapes"), model)
    warn_changed_settings(optimizer, state["optimizer"])
    _copy_trainable(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        load_scaler(scaler, state["scaler"])
    if rng and state.get("rng") is not None:
        set_rng_state(state["rng"])
    return int(state["step"])


def load_trainable(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy saved trainable parameters into ``model``: every trainable one must be there, of
    its shape and dtype (``check_trainable``), or nothing is copied."""
    check_trainable(model, tensors)
    _copy_trainable(model, tensors)


def _copy_trainable(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in trainable_state_dict(model).items():
            p.copy_(tensors[name])


def _described(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _refuse(what: str, problems: List[str]) -> None:
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise FormatError(f"{what}: {'; '.join(problems[:8])}{more}")


def check_trainable(model: torch.nn.Module, tensors: Any) -> None:
    """``FormatError`` unless ``tensors`` holds exactly ``model``'s trainable parameters, each
    a tensor of the parameter's shape and dtype (``copy_`` would broadcast a smaller one and
    convert another dtype without a word)."""
    if not isinstance(tensors, Mapping):
        raise FormatError(f"the journaled trainable parameters are a {type(tensors).__name__}, not a mapping")
    params = trainable_state_dict(model)
    problems = [f"{name} is missing from the journal" for name in params if name not in tensors]
    problems += [f"{name} is journaled but is not a trainable parameter of this model" for name in tensors
                 if name not in params]
    for name, p in params.items():
        t = tensors.get(name)
        if name in tensors and not isinstance(t, torch.Tensor):
            problems.append(f"{name} is journaled as a {type(t).__name__}")
        elif t is not None and (t.shape != p.shape or t.dtype != p.dtype):
            problems.append(f"{name} is journaled as {_described(t)}, the model's is {_described(p)}")
    _refuse("the journaled trainable parameters do not fit this model (a changed LoRA rank, target modules "
            "or dtype?), nothing was copied", problems)


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, shapes: Any,
                          model: Optional[torch.nn.Module] = None) -> None:
    """``FormatError`` unless the journaled optimizer ``state_dict`` ``saved`` was made for
    parameters of the shapes ``optimizer`` holds, group by group (``shapes``: what
    ``optimizer_shapes`` journaled beside it). ``load_state_dict`` checks only the counts,
    and a fused kernel given state of another size writes past its end. ``model`` names
    the parameters in the message."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), Mapping):
        raise FormatError("the journaled optimizer state is not an optimizer state_dict")
    journaled = _journaled_shapes(shapes)
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    groups, live = saved["param_groups"], optimizer.param_groups
    problems = []
    if not len(groups) == len(journaled) == len(live):
        problems.append(f"the journal holds {len(groups)} parameter groups ({len(journaled)} with shapes), "
                        f"this optimizer {len(live)}")
    for g, (group, was, here) in enumerate(zip(groups, journaled, live)):
        ids = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(ids, list) or not len(ids) == len(was) == len(here["params"]):
            count = len(ids) if isinstance(ids, list) else "no"
            problems.append(f"group {g} holds {count} parameters in the journal ({len(was)} with shapes), "
                            f"{len(here['params'])} in this optimizer")
            continue
        for i, (shape, p) in enumerate(zip(was, here["params"])):
            if shape != tuple(p.shape):
                name = names.get(id(p), f"parameter {i}")
                problems.append(f"{name} (group {g}): the journaled state is for {shape}, "
                                f"the parameter is {_described(p)}")
    known = {i for group in groups if isinstance(group, Mapping) for i in group.get("params") or []}
    problems += [f"the journal holds state for parameter {k}, which no group lists" for k in saved["state"]
                 if k not in known]
    _refuse("the journaled optimizer state does not fit this optimizer, nothing was copied", problems)


class ResumeMismatch(UserWarning):
    """A resumed run was configured differently from the journaled one (learning rate,
    dataset size...); the journaled values are what continues."""


#: Param group entries that are not settings. (With a scheduler attached, ``lr`` is not one
#: either: it is where the schedule has taken the learning rate, ``initial_lr`` the setting.)
_NOT_SETTINGS = ("params", "param_names")


def changed_settings(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> List[str]:
    """The optimizer settings (learning rate, betas, weight decay, ``fused``...) in which
    ``optimizer`` differs from the journaled ``state_dict`` ``saved``, one line each."""
    out = []
    for g, (journaled, here) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        scheduled = "initial_lr" in journaled and "initial_lr" in here
        for key in sorted(set(journaled) | set(here), key=str):
            if key in _NOT_SETTINGS or (key == "lr" and scheduled):
                continue
            a, b = _plain(journaled.get(key)), _plain(here.get(key))
            if a != b:
                what = f"learning rate ({key}, group {g})" if key in ("lr", "initial_lr") else f"{key} (group {g})"
                out.append(f"{what}: journaled {a!r}, this run {b!r}")
    return out


def _plain(value: Any) -> Any:
    """A setting as a comparable value (a tensor learning rate as its number)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def warn_changed_settings(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """One warning naming every optimizer setting this run changed against the journal: the
    journaled values are what ``load_state_dict`` keeps."""
    changed = changed_settings(optimizer, saved)
    if changed:
        warnings.warn(f"resuming with optimizer settings that differ from the journal's; the journaled ones are "
                      f"kept: {'; '.join(changed)}", ResumeMismatch, stacklevel=3)


# -- capture: off the device, into host streams and one document ------------------------------


class Capture:
    """Host copies of a training state: ``streams`` (one flat tensor per role and dtype) and
    ``document`` (the structure and plain values).

    Device tensors reach ``streams`` through ``kvj.segments.device`` copies that may still
    be running: ``wait`` before reading them (the saver thread does), then ``release`` them,
    so the next capture can reuse their buffer (``StateBuffers``). Until ``wait`` returns,
    the capture keeps the device tensors the copies read referenced, so their memory is not
    handed out again while kvj's stream still reads it (what ``record_stream`` would buy,
    without an allocator call per tensor).
    """

    def __init__(self, streams: Dict[str, torch.Tensor], document: Dict[str, Any],
                 ready: Tuple[Tuple[Any, Any], ...] = (), *, sources: Tuple[torch.Tensor, ...] = (),
                 owner: Optional["StateBuffers"] = None, buffer: Optional[torch.Tensor] = None):
        self.streams = streams
        self.document = document  #: the parsed document: format, tree, leaves (and "inline" when stored)
        self._ready = ready  # (event, stream): the copies into ``streams`` are done after each event
        self._sources = sources
        self._owner, self._buffer = owner, buffer

    @property
    def doc(self) -> bytes:
        """The document, msgpack-encoded (packed by the saver thread, not by ``capture``)."""
        return msgpack.packb(self.document, use_bin_type=True)

    def wait(self) -> None:
        """Block until the copies have landed (blocking events: no core spins meanwhile); if
        waiting fails, their stream is settled before the error goes up (``Cuda.finish``)."""
        for event, stream in self._ready:
            cuda.CUDA.finish(event, stream)
        self._ready, self._sources = (), ()

    def release(self, landed: bool = True) -> None:
        """Give the host buffer back for the next capture; with ``landed`` False (``wait``
        failed: a copy may still write into it) it is dropped instead."""
        owner, buffer, self._owner, self._buffer = self._owner, self._buffer, None, None
        if owner is not None and buffer is not None and landed:
            owner.give_back(buffer)

    def signature(self) -> Dict[str, Tuple[str, int]]:
        """Stream name -> (dtype, numel): a delta needs the same as its base."""
        return {n: (str(t.dtype), t.numel()) for n, t in self.streams.items()}


def _stream_name(path: Tuple[Any, ...], dtype: torch.dtype) -> str:
    """Tensors of one role share a stream: the optimizer's per-parameter state by its key
    (``exp_avg``, ``momentum_buffer``...), anything else by its top-level part."""
    if len(path) >= 4 and path[0] == "optimizer" and path[1] == "state":
        role = f"optimizer.{path[3]}"
    else:
        role = str(path[0]) if path else "state"
    return f"{role}.{DTYPE_NAMES.get(dtype) or str(dtype).replace('torch.', '')}"


_PLAIN = (int, float, bool, str, bytes, type(None))


def _encode(value: Any, path: Tuple[Any, ...], leaves: List[Tuple[Tuple[Any, ...], Any]]) -> Any:
    """``value`` as a msgpack-safe tagged tree; tensors and arrays become leaf indices."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is dict:  # the common case first: a save walks thousands of nodes on the training thread
        return {"d": [[k if type(k) in _PLAIN else _encode(k, path, leaves), _encode(v, path + (k,), leaves)]
                      for k, v in value.items()]}
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
    if isinstance(value, Mapping):
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


#: Byte alignment of each stream's slice of a buffer (every dtype's element size divides it).
ALIGN = 64

#: Where a stream's members live: None for the CPU, else their device.
_Where = Optional[torch.device]
#: The parts of a ``training_state`` that nothing but the optimizer's step changes in place.
_STEP_GUARDED = ("model", "optimizer")
#: A stream's members in one place: runs of same-shaped tensors (shape, leaf indices).
_Groups = List[Tuple[torch.Size, List[int]]]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step`` runs, inside wrappers such as accelerate's
    ``AcceleratedOptimizer`` (which runs no step hooks of its own)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _stack_into(flat: torch.Tensor, groups: _Groups, tensors: List[torch.Tensor]) -> None:
    """Fill the front of ``flat`` with the tensors of ``groups``, in order: one
    ``torch.stack`` per run of same-shaped tensors."""
    at = 0
    for shape, members in groups:
        numel = shape.numel() * len(members)
        if numel:
            torch.stack([tensors[i] for i in members], out=flat[at:at + numel].view(len(members), *shape))
        at += numel


class StateBuffers:
    """The memory training state leaves the device through, allocated once and reused.

    Per device one gather buffer, on the device; on the host up to ``sets`` buffers (pinned
    when the state has device tensors) that consecutive captures take turns in, so a
    capture still being stored is never overwritten (``StateJournal`` holds at most
    ``max_pending`` captures and keeps that many). A capture gathers each stream's device
    tensors into its slice of the gather buffer on kvj's side stream (one ``torch.stack``
    per run of same-shaped tensors, not a copy per tensor) and copies each slice to the host
    with one device-to-host copy. The gather buffer is allocated on that side stream and used
    only there, so it needs no ``record_stream``.

    The live tensors may change again once the gather has read them. With ``optimizer``,
    its next ``step`` waits for that on the GPU (a step pre-hook): the next forward and
    backward run alongside the gather and the copy; only the step, which updates the state in
    place, waits. That holds for the state's ``model`` and ``optimizer`` parts (as
    ``training_state`` makes them), which nothing but that step may change in place; the
    rest (the scaler's scale, the caller's data...) is gathered first and the caller's stream
    waits for that small gather at once, as it waits for the whole gather without ``optimizer``.
    """

    def __init__(self, sets: int = 2, optimizer: Optional[torch.optim.Optimizer] = None):
        self.sets = sets
        self._lock = threading.Lock()
        self._free: List[torch.Tensor] = []  # host buffers no capture holds
        self._gather: Dict[torch.device, torch.Tensor] = {}
        self._guard: Dict[torch.device, Any] = {}  # the gathers the next optimizer step waits for
        self._hook = (_innermost(optimizer).register_step_pre_hook(self._before_step)
                      if optimizer is not None else None)

    def close(self) -> None:
        """Remove the optimizer step pre-hook. (The captures' ``wait`` is what orders later
        changes to the tensors they read: ``StateJournal.close`` returns after every save's.)"""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guard, self._guard = self._guard, {}
        for device, gathered in guard.items():
            cuda.CUDA.gpu_wait(cuda.CUDA.current_stream(device), gathered)

    def give_back(self, buffer: torch.Tensor) -> None:
        """A host buffer no copy writes into any more and no reader holds: free for reuse."""
        with self._lock:
            if len(self._free) < self.sets:
                self._free.append(buffer)

    def _host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A free host buffer of at least ``nbytes``; one too small or of the other kind is
        dropped, so at most ``sets`` stay allocated."""
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if buf.numel() >= nbytes and cuda.CUDA.is_pinned(buf) == pinned:
                    return buf
        return cuda.CUDA.pinned(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)

    def _gather_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """``device``'s gather buffer, grown to ``nbytes``; called on kvj's side stream."""
        buf = self._gather.get(device)
        if buf is None or buf.numel() < nbytes:
            buf = self._gather[device] = cuda.CUDA.empty((nbytes,), torch.uint8, device)
        return buf

    def capture(self, state: Mapping[str, Any]) -> Capture:
        """Host copies of ``state`` (any nested mapping of tensors, arrays and plain
        values), queued on the caller's thread without waiting for the GPU; see ``Capture``."""
        leaves: List[Tuple[Tuple[Any, ...], Any]] = []
        tree = _encode(state, (), leaves)
        tensors: List[torch.Tensor] = []
        # stream -> where -> shape -> leaf indices. A stream holds its CPU members first, then
        # each device's, so that each device's part is one slice; same shapes run together.
        runs: Dict[Tuple[str, _Where, torch.Size], List[int]] = {}
        dtypes: Dict[str, torch.dtype] = {}
        guarded = set()  # the streams the optimizer step guards
        is_device = cuda.CUDA.is_device_tensor
        for i, (path, value) in enumerate(leaves):
            t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
            name = _stream_name(path, t.dtype)
            key = (name, cuda.CUDA.device_of(t) if is_device(t) else None, t.shape)
            run = runs.get(key)
            if run is None:
                run = runs[key] = []
                dtypes[name] = t.dtype
                if path and path[0] in _STEP_GUARDED:
                    guarded.add(name)
            run.append(i)
            tensors.append(t)
        plan: Dict[str, Dict[_Where, Dict[torch.Size, List[int]]]] = {}
        for (name, where, shape), run in runs.items():
            plan.setdefault(name, {}).setdefault(where, {})[shape] = run
        places: List[Any] = [None] * len(leaves)
        parts: Dict[_Where, List[Tuple[str, int, int, _Groups]]] = {}  # where -> (stream, start, numel, groups)
        on_device: Dict[str, int] = {}  # stream -> where its device part starts
        numels: Dict[str, int] = {}
        for name, by_where in plan.items():
            offset = 0
            for where in sorted(by_where, key=lambda w: -1 if w is None else w.index or 0):
                start = offset
                for shape, members in by_where[where].items():
                    numel, dims = shape.numel(), list(shape)
                    for i in members:
                        places[i] = [name, offset, dims, "n" if isinstance(leaves[i][1], np.ndarray) else "t"]
                        offset += numel
                parts.setdefault(where, []).append((name, start, offset - start, list(by_where[where].items())))
                if where is not None:
                    on_device.setdefault(name, start)
            numels[name] = offset
        host = self._host(sum(_aligned(numels[n] * dtypes[n].itemsize) for n in plan),
                          pinned=any(where is not None for where in parts))
        streams: Dict[str, torch.Tensor] = {}
        at = 0
        for name in plan:
            nbytes = numels[name] * dtypes[name].itemsize
            streams[name] = host[at:at + nbytes].view(dtypes[name])
            at += _aligned(nbytes)
        with torch.no_grad():  # parameters are stacked as they are, not detached one by one
            for name, start, _, groups in parts.get(None, []):
                _stack_into(streams[name][start:], groups, tensors)
            # A failure from here on drops ``host`` with the capture never made: a copy may run into it.
            ready = tuple(self._download(where, device_parts, streams, tensors, guarded)
                          for where, device_parts in parts.items() if where is not None)
        document = {"format": FORMAT, "tree": tree, "leaves": places}
        if on_device:
            document["device"] = on_device
        return Capture(streams, document, ready, sources=tuple(tensors) if ready else (), owner=self, buffer=host)

    def _download(self, device: torch.device, parts: List[Tuple[str, int, int, _Groups]],
                  streams: Dict[str, torch.Tensor], tensors: List[torch.Tensor], guarded: set) -> Tuple[Any, Any]:
        """Gather ``device``'s part of each stream into its gather buffer and queue one copy
        of each part to the host, on kvj's side stream after the caller's queued work (the
        streams the optimizer step does not guard first). Returns (the copies' event, the
        side stream)."""
        if self._hook is not None:
            parts = sorted(parts, key=lambda part: part[0] in guarded)
        # The parts before ``first`` are read before the caller's stream goes on; the rest
        # before the optimizer's next step.
        first = next((k for k, part in enumerate(parts) if self._hook is not None and part[0] in guarded), len(parts))
        side, current = cuda.CUDA.side_stream(device, "d2h"), cuda.CUDA.current_stream(device)
        cuda.CUDA.gpu_wait_stream(side, current)  # the gather reads the state as the queued step leaves it
        with cuda.CUDA.enqueue_on(side):
            spans, total = [], 0
            for name, _, numel, _ in parts:
                spans.append(total)
                total += _aligned(numel * streams[name].element_size())
            gather = self._gather_buffer(device, total)
            slices, early = [], None
            for k, ((name, start, numel, groups), span) in enumerate(zip(parts, spans)):
                if k == first and k:
                    early = cuda.CUDA.record(side)
                dtype = streams[name].dtype
                region = gather[span:span + numel * dtype.itemsize].view(dtype)
                _stack_into(region, groups, tensors)
                slices.append((streams[name][start:start + numel], region))
            gathered = cuda.CUDA.record(side)
            for dest, region in slices:
                if region.numel():
                    cuda.CUDA.copy(dest, region)
            landed = cuda.CUDA.record(side)
        if first == len(parts):
            cuda.CUDA.gpu_wait(current, gathered)
        else:
            if early is not None:
                cuda.CUDA.gpu_wait(current, early)
            self._guard[device] = gathered
        return landed, side


def capture(state: Mapping[str, Any]) -> Capture:
    """``StateBuffers(1).capture(state)``: host copies in fresh buffers, for a one-off save
    (a loop that saves every step keeps its buffers: ``StateJournal`` does)."""
    return StateBuffers(1).capture(state)


def materialize(doc: Union[bytes, Mapping[str, Any]], streams: Mapping[str, torch.Tensor],
                on_device: Optional[Mapping[str, Tuple[int, torch.Tensor]]] = None) -> Dict[str, Any]:
    """The nested state a ``Capture``'s document (encoded or parsed) and streams describe
    (tensors that are views of ``streams``; NumPy arrays copied). ``on_device`` maps a
    stream to (offset, its part from that offset on, on a device): the leaves in that part
    are views of it instead."""
    try:
        parsed = _parse(doc) if isinstance(doc, (bytes, bytearray)) else doc
        if parsed.get("format") != FORMAT:
            raise FormatError(f"training state document of format {parsed.get('format')!r}, expected {FORMAT}")
        leaves: List[Any] = []
        for name, offset, shape, kind in parsed["leaves"]:
            numel = int(np.prod(shape)) if shape else 1
            part = on_device.get(name) if on_device else None
            if part is not None and offset >= part[0]:
                t = part[1][offset - part[0]:offset - part[0] + numel].view(shape)
            else:
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
    so the next deltas are taken against its base. Pass the ``optimizer`` whose state is
    saved, and on a GPU only its next step waits for a save's gather (``StateBuffers``).
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
        # The last full save's streams, in host memory of the journal's own (the capture's
        # buffer goes back to the next capture): what deltas are XORed against.
        self._base: Optional[Tuple[int, Dict[str, torch.Tensor]]] = None
        self._base_owned = False  # whether the base's buffers are ours to overwrite
        if resume is not None:
            self._base = (resume.base_step, dict(resume.base.streams))
        self._base_signature = resume.base.signature() if resume is not None else None
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
        self._failure: Optional[BaseException] = None  # the first save that failed

    def save(self, step: int, state: Union[Mapping[str, Any], Capture]) -> "Future[None]":
        """Journal ``state`` (e.g. ``training_state(...)``) as the state after ``step``. The
        host copy is queued before this returns, so the caller may go on at once: the next
        ``optimizer.step`` (given an ``optimizer``), or else any later work on the caller's
        stream, waits on the GPU until the copy has read the state (``StateBuffers``). After
        a save failed, every later one raises that failure: nothing after it is durable."""
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
        xorable = t.element_size() in _INT_OF_SIZE  # 16-byte elements (complex128) have no integer to XOR as
        trial = not full and xorable and (n & (n - 1) == 0 or name not in self._xor_pays)
        if trial or (not full and xorable and self._xor_pays[name]):
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
            self._keep_base(step, snap)
            self.stats.fulls += 1
        else:
            lsn = self.journal.delta(step, self._base[0], keys,  # type: ignore[index]
                                     {"format": FORMAT, "model": self.model, "whole": whole}, durable=True)
            self.stats.deltas += 1
        with self._lock:
            self._appended.append((step, lsn))

    def _keep_base(self, step: int, snap: Capture) -> None:
        """Copy the full save ``snap`` into the base buffers (reused while the streams keep
        their sizes; a resumed base is the caller's, never overwritten)."""
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
                fut.exception()
            if self._failure is not None:
                raise self._failure
        finally:
            self._buffers.close()
            self._pool.shutdown(wait=True)
            self._io.shutdown(wait=True)


@dataclass
class RecoveredState:
    """Training state rebuilt from the journal: ``state`` is what was saved (the nested
    structure, its tensors on the device recovery was asked for) after ``step``; ``base``
    the full save the deltas are against (on the CPU)."""

    step: int
    state: Dict[str, Any]
    base_step: int
    base: Capture
    fallback: Optional[str] = None  #: why a newer delta listed in the journal was not used


def _inline_streams(parsed: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """The streams a stored document carries itself (CPU tensors)."""
    try:
        return {n: (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8))
                .view(DTYPES[dtype]) for n, (dtype, data) in (parsed.get("inline") or {}).items()}
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"bad training state document: {exc}") from None


def _load(store: "SegmentStore", keys: Mapping[str, str]) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor],
                                                                   Dict[str, torch.Tensor]]:
    """A save's document (parsed), its streams stored as segments, and those inside the
    document, all on the CPU."""
    if TREE not in keys:
        raise FormatError("training record has no state document: written by kvj 0.1.0's flat format, "
                          "which this kvj does not resume (finish that run with kvj 0.1.0)")
    doc = _parse(store.get(keys[TREE]).numpy().tobytes())
    streams = {k[len(STREAM_PREFIX):]: store.get(v) for k, v in keys.items() if k.startswith(STREAM_PREFIX)}
    return doc, streams, _inline_streams(doc)


def _placed(doc: Mapping[str, Any], streams: Mapping[str, torch.Tensor],
            device: Union[str, torch.device]) -> Dict[str, Any]:
    """The state ``doc`` describes, from host ``streams``: the leaves captured on a device on
    ``device`` (one upload per stream, through kvj's h2d copies, done when this returns), the
    others (RNG states, a CPU ``step``...) on the CPU, as views of ``streams``."""
    target = cuda.CUDA.resolve(device)
    starts = (doc.get("device") or {}) if target.type != "cpu" else {}
    if not (isinstance(starts, dict) and all(n in streams and isinstance(s, int) for n, s in starts.items())):
        raise FormatError(f"bad training state document: device {starts!r:.80}")
    on_device: Dict[str, Tuple[int, torch.Tensor]] = {}
    last = None
    for name, start in starts.items():
        part = streams[name][start:]
        if target.type != "cuda":
            on_device[name] = (start, part.to(target))
            continue
        uploaded, last = cuda.CUDA.upload(part, target)
        on_device[name] = (start, uploaded)
    if last is not None:  # one h2d stream runs the uploads in order: the last event covers them all
        cuda.CUDA.finish(last, cuda.CUDA.side_stream(target, "h2d"))
    return materialize(doc, streams, on_device)


def recover_training(source: Union[JournalState, Mapping[str, Any]], store: "SegmentStore",
                     device: Union[str, torch.device] = "cpu") -> Optional[RecoveredState]:
    """The newest training state the journal can rebuild: its checkpoint XOR its newest
    readable delta, with its tensors on ``device`` (the base stays on the CPU). ``source`` is
    ``kvj.replay`` state or the ``training`` part of a recovery manifest (``{"checkpoint":
    {...}, "deltas": [...]}``). None when nothing was checkpointed."""
    if isinstance(source, JournalState):
        checkpoint, deltas = source.checkpoint, source.deltas
    else:
        checkpoint, deltas = source.get("checkpoint"), source.get("deltas") or []
    if not checkpoint:
        return None
    base_step = checkpoint["step"]
    base_doc, base_stored, base_inline = _load(store, checkpoint["keys"])
    base_streams = {**base_stored, **base_inline}
    base = Capture(base_streams, base_doc)
    fallback = None
    for delta in sorted((d for d in deltas if d["base_step"] == base_step), key=lambda d: -d["step"]):
        try:
            doc, stored, inline = _load(store, delta["keys"])
        except (SegmentMissing, SegmentCorrupt) as exc:
            fallback = f"delta of step {delta['step']} unreadable ({exc})"
            continue
        whole = set((delta.get("meta") or {}).get("whole", []))
        if set(stored) | set(inline) != set(base_streams):
            raise FormatError(f"delta of step {delta['step']} holds streams {sorted({*stored, *inline})}, "
                              f"its base {sorted(base_streams)}")
        streams = {n: t if n in whole else unxor(base_streams[n], t) for n, t in stored.items()}
        return RecoveredState(delta["step"], _placed(doc, {**streams, **inline}, device), base_step, base, fallback)
    # The state gets copies: a restored optimizer may keep the tensors it is given, and its
    # steps must not change the base the next deltas are XORed against.
    streams = {n: t.clone() for n, t in base_streams.items()}
    return RecoveredState(base_step, _placed(base_doc, streams, device), base_step, base, fallback)
