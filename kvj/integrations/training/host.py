"""Capture: training state off the device into host streams and one document, and back.

The tensors of one role and dtype share a *stream* (the model's float32 weights, Adam's
``exp_avg``...), everything else is one msgpack document (kvj-segment(5) TRAINING STATE).
On a GPU each stream is gathered on kvj's side stream into a device buffer kept for the run
and leaves in one device-to-host copy, without the host waiting; ``materialize`` rebuilds the
nested state from a document and its streams.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import msgspec
import numpy as np
import torch

from kvj.errors import FormatError
from kvj.segments import device as cuda
from kvj.segments.tensors import DTYPE_NAMES

#: The format of a save's document (structure and plain values).
FORMAT = "kvj-train/2"


class Capture:
    """Host copies of a training state: ``streams`` (one flat tensor per role and dtype) and
    ``document`` (the structure and plain values). Copies into ``streams`` may still run:
    ``wait`` before reading them, then ``release`` the buffer for the next capture. Until
    ``wait`` returns the device tensors read stay referenced, so their memory is not reused
    while kvj's stream reads it (``record_stream`` without an allocator call per tensor)."""

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
        return msgspec.msgpack.encode(self.document)

    def wait(self) -> None:
        """Block until the copies have landed (``Cuda.finish``: no core spins, a failure settles the stream)."""
        for event, stream in self._ready:
            cuda.CUDA.finish(event, stream)
        self._ready, self._sources = (), ()

    def release(self, landed: bool = True) -> None:
        """Give the host buffer back for the next capture; dropped instead unless ``landed`` (a
        copy may still write into it)."""
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
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, _PLAIN):  # a subclass: an IntEnum, a str...
        return value
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
    """The memory training state leaves the device through, allocated once and reused: per
    device one gather buffer (allocated and used only on kvj's side stream), on the host up to
    ``sets`` buffers (pinned for device tensors) that captures take turns in.

    With ``optimizer``, only its next ``step`` waits on the GPU for a gather of the state's
    ``model`` and ``optimizer`` parts (a step pre-hook), which nothing else changes in place;
    the rest (the scaler's scale, the caller's data) is gathered first and the caller's
    stream waits for that at once, as for the whole gather without ``optimizer``."""

    def __init__(self, sets: int = 2, optimizer: Optional[torch.optim.Optimizer] = None):
        self.sets = sets
        self._lock = threading.Lock()
        self._free: List[torch.Tensor] = []  # host buffers no capture holds
        self._gather: Dict[torch.device, torch.Tensor] = {}
        self._guard: Dict[torch.device, Any] = {}  # the gathers the next optimizer step waits for
        self._hook = (_innermost(optimizer).register_step_pre_hook(self._before_step)
                      if optimizer is not None else None)

    def close(self) -> None:
        """Remove the optimizer step pre-hook (the captures' ``wait`` orders what comes later)."""
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
        """Host copies of ``state`` (any nested mapping of tensors, arrays and plain values),
        queued on the caller's thread without waiting for the GPU."""
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
        """Gather ``device``'s part of each stream (those the optimizer step does not guard
        first) and queue one copy of each to the host, on kvj's side stream after the caller's
        queued work; returns (the copies' event, the side stream)."""
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
    """Host copies of ``state`` in fresh buffers, for a one-off save."""
    return StateBuffers(1).capture(state)


def materialize(doc: Union[bytes, Mapping[str, Any]], streams: Mapping[str, torch.Tensor],
                on_device: Optional[Mapping[str, Tuple[int, torch.Tensor]]] = None) -> Dict[str, Any]:
    """The nested state a document (encoded or parsed) and its streams describe: tensors are
    views of ``streams`` or, from the offset ``on_device`` maps a stream to, of the device
    part it gives; NumPy arrays are copies."""
    try:
        parsed = parse_document(doc) if isinstance(doc, (bytes, bytearray)) else doc
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


def parse_document(doc: bytes) -> Dict[str, Any]:
    """A save's msgpack document, parsed; ``FormatError`` for anything but a map."""
    try:
        parsed = msgspec.msgpack.decode(doc)
    except (ValueError, TypeError, RecursionError, msgspec.DecodeError) as exc:
        raise FormatError(f"bad training state document: {exc}") from None
    if not isinstance(parsed, dict):
        raise FormatError("bad training state document: not a map")
    return parsed
