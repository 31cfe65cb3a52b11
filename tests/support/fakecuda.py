"""A strict CPU stand-in for CUDA: tensors on ``cuda:0``/``cuda:1`` that fail where CUDA would.

Install it (the ``gpu`` fixture below, or ``FakeCuda(devices).install(monkeypatch)``) and torch
on this CPU-only build behaves, for the ops kvj uses, like torch on a machine with that many
GPUs. Nothing in kvj is replaced: the real ``kvj.segments.device.Cuda`` runs, so kvj's own waits
are what the tests exercise (delete one and a test fails: ``tests/segments/test_mutations.py``).

Design. A device tensor is a :class:`FakeCudaTensor`, a wrapper subclass whose ``device`` is
``cuda:i`` (so ``t.is_cuda``, ``t.device.type == "cuda"`` and kvj's real branches hold) holding an
inner CPU tensor; ``__torch_dispatch__`` routes every aten op on it here. Device tensors are
born in Python kernels registered for torch's CUDA ``empty``/``empty_strided`` (so factories
with ``device="cuda"``, ``.to("cuda")``, ``.cuda()`` and C++ paths such as indexing with a list
work unpatched), with a do-nothing CUDA device guard compiled from ``fakecuda_guard.cpp`` (a
C++ compiler, ``c++`` or ``$CXX``, is needed; torch ships the headers). ``pin_memory=True``, ``Tensor.is_pinned`` /
``.pin_memory`` and ``torch.cuda`` (``Stream``, ``Event``, ``current_stream``, ``stream()``,
``synchronize``, ``set_device``, ``_sleep``, the RNG state functions...) are patched on the
modules, not through a TorchFunctionMode: modes are per thread, and kvj copies from worker
threads. Autograd's backward pass runs on these tensors only in a process started with
:func:`autograd_env` (torch's engine asks CUDA hooks for the gradients' streams: that library
registers some before torch starts), and then on each thread's current stream, not on the
stream its forward op ran on as CUDA's engine does: run training on the default stream.

What CUDA does that this enforces:

- **devices**: an op mixing a device tensor with a CPU tensor raises CUDA's "Expected all tensors
  to be on the same device" (except ``copy_``/``to``, 0-dim CPU scalars, and CPU index tensors
  of advanced indexing, which CUDA accepts); ``cuda:0`` and ``cuda:1`` do not mix either.
  ``.numpy()`` raises; ``.item()``, ``.tolist()``, ``.cpu()`` and ops returning Python values
  synchronize the host with the current stream (counted in ``syncs``).
- **streams**: every op is enqueued on the current stream of its device and runs *later*: only
  when the host synchronizes with something after it (``Event.synchronize``, a true
  ``Event.query``, ``Stream.synchronize``, ``torch.cuda.synchronize``, a host read), and then
  only with the work it depends on (stream order plus the waits that were enqueued). So a
  non-blocking copy's source is read at that late moment (reusing it changes what arrives) and
  a download's pinned destination holds poison (0xA5) until then.
- **hazards**: each op's reads and writes (byte ranges of device allocations and pinned
  buffers) are checked against earlier ones of other streams with vector clocks that
  ``wait_event``/``wait_stream`` and host synchronizations advance: touching memory another
  stream wrote (or, to write, read) past what this stream waited for raises :class:`Hazard`.
- a non-blocking copy from or into unpinned host memory is synchronous for the host, as on
  CUDA (the source is read, or the destination written, before ``copy_`` returns);
- **allocator**: memory allocated on one stream, used on another and dropped without
  ``record_stream`` while that use may still run (neither the allocating stream nor the
  dropping thread waited for it) is reported in ``violations``;
- several devices are distinct (their own default streams, memory and checks);
- **stream pool**: ``torch.cuda.Stream()`` hands out streams from a pool per device and priority,
  round-robin (``stream_pool`` of them, 32 as torch's), so a stream kvj asks for may be one that
  other code (vLLM's compute stream) holds;
- **host waits**, per thread (``host_waits(thread)``): every call that blocks the calling host
  thread: event, stream and device synchronizations, host reads, blocking copies from or into
  pageable memory, pinned allocations (milliseconds on CUDA), and waits on a
  ``threading.Condition`` (a lock, queue, future or semaphore another thread must release:
  ``Future.result``, ``Event.wait``, a full staging pool; not the start of a new thread), so a
  test can show that a thread (vLLM's serving thread) never waited.

The host's knowledge is per thread: a thread that waited on an event knows that work is done,
another learns it only through a ``concurrent.futures`` result the first thread set afterwards
(the handoff kvj's thread pools use; other Python synchronization is not seen).
Simplifications, all on the lenient side: a strided view is tracked by the byte range it spans;
an op without a meta kernel (data-dependent shapes) runs when enqueued after the work it
depends on; at most 256 earlier accesses are remembered per allocation.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import os
import subprocess
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.utils._device

POISON = 0xA5
aten = torch.ops.aten

_ACTIVE: Optional["FakeCuda"] = None
_MAX_ACCESSES = 256


class StandInError(RuntimeError):
    """Something that goes wrong (or is undefined) on a real GPU."""


class Hazard(StandInError):
    """Two streams touch the same memory with no wait ordering them (a race on a GPU)."""


def _sim() -> "FakeCuda":
    if _ACTIVE is None:
        raise StandInError("the CUDA stand-in is not installed")
    return _ACTIVE


# -- streams and events --------------------------------------------------------------------


class FakeStream:
    """``torch.cuda.Stream``: a queue of ops that run late, and a vector clock of what it waited for."""

    _count = 0

    def __new__(cls, device: Any = None, priority: int = 0, *, name: Optional[str] = None) -> "FakeStream":
        if name is None:  # torch.cuda.Stream(): one of the pool's (FakeCuda.pooled_stream)
            return _sim().pooled_stream(device, priority)
        return super().__new__(cls)

    def __init__(self, device: Any = None, priority: int = 0, *, name: Optional[str] = None):
        if "seq" in self.__dict__:  # a pooled stream handed out again
            return
        sim = self._sim = _sim()  # a stream (and an event) belongs to the stand-in that made it
        FakeStream._count += 1
        self.device = sim.resolve("cuda" if device is None else device)
        self.name = name or f"stream{FakeStream._count}"
        self.seq = 0  #: ops enqueued so far
        self.done = 0  #: ops run so far
        self.clock: Dict["FakeStream", int] = {}  #: the last op of each stream this one waited for
        self.queue: "collections.deque[_Op]" = collections.deque()
        with sim.lock:
            sim.streams.append(self)

    @property
    def device_index(self) -> int:
        return self.device.index

    def wait_event(self, event: "FakeEvent") -> None:
        self._sim._wait(self, event.clock)

    def wait_stream(self, stream: "FakeStream") -> None:
        self._sim._wait(self, dict(stream.clock))

    def record_event(self, event: Optional["FakeEvent"] = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._sim._host_wait(dict(self.clock), "stream")

    def query(self) -> bool:
        return self._sim._query(dict(self.clock))

    def __repr__(self) -> str:
        return f"<stream {self.name} of {self.device}>"


class FakeEvent:
    """``torch.cuda.Event``: the clock of the stream it was recorded on, at that point."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.blocking = blocking
        self.clock: Dict[FakeStream, int] = {}  #: empty until recorded: waits on it return at once
        self.stream: Optional[FakeStream] = None
        sim = self._sim = _sim()
        with sim.lock:
            sim.events.append(self)

    def record(self, stream: Optional[FakeStream] = None) -> None:
        sim = self._sim
        stream = stream or sim.current_stream()
        with sim.lock:
            sim._inject("record")
            sim._join_host(stream)
            self.clock, self.stream = dict(stream.clock), stream

    def synchronize(self) -> None:
        sim = self._sim
        with sim.lock:
            sim._inject("synchronize")
        sim._host_wait(self.clock, "event")

    def query(self) -> bool:
        return self._sim._query(self.clock)

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        (stream or self._sim.current_stream()).wait_event(self)

    def __repr__(self) -> str:
        return f"<event on {self.stream!r} at {self.clock.get(self.stream) if self.stream else 'unrecorded'}>"


@dataclass
class _Op:
    stream: FakeStream
    seq: int
    deps: Dict[FakeStream, int]
    run: Callable[[], None]
    label: str


@dataclass
class _Access:
    stream: FakeStream
    seq: int
    lo: int
    hi: int
    write: bool
    label: str


class _Memory:
    """One allocation: a device tensor's inner storage, or a pinned host buffer."""

    def __init__(self, sim: "FakeCuda", label: str, device: Optional[torch.device], alloc: Optional[FakeStream]):
        self.sim = sim
        self.label = label
        self.device = device
        self.alloc = alloc  #: the stream it was allocated on (device memory)
        self.accesses: List[_Access] = []
        self.cross: Dict[FakeStream, int] = {}  #: last use by each stream other than ``alloc``
        self.recorded: set = set()  #: streams ``record_stream`` named
        self.refs = 0  #: live FakeCudaTensor wrappers


@dataclass(frozen=True)
class _Out:
    """A new tensor an op returns: what its meta kernel said about it."""

    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype


@dataclass
class CopyRecord:
    """One host/device copy as enqueued: ``kind`` "h2d" or "d2h", ``asynchronous`` when it ran late."""

    kind: str
    stream: FakeStream
    host: torch.Tensor
    asynchronous: bool


# -- device tensors ------------------------------------------------------------------------


class FakeCudaTensor(torch.Tensor):
    """A tensor on a simulated CUDA device: metadata on the wrapper, bytes in ``_inner`` (CPU)."""

    _inner: torch.Tensor
    _mem: _Memory

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=device, requires_grad=requires_grad)
        t._inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in _flatten((args, kwargs))[0]:
            if isinstance(x, FakeCudaTensor):  # the stand-in that made the tensor runs its ops
                return x._mem.sim._dispatch(func, args, kwargs)
        return _sim()._dispatch(func, args, kwargs)

    # a traceable wrapper: nn.Module.to("cuda") swaps its parameters for these instead of
    # pointing them at a wrapper's data (which would make a plain tensor claiming to be on cuda)
    def __tensor_flatten__(self) -> Tuple[List[str], Tuple[torch.device, _Memory]]:
        return ["_inner"], (self.device, self._mem)

    @staticmethod
    def __tensor_unflatten__(inner: Dict[str, torch.Tensor], ctx: Tuple[torch.device, _Memory],
                             outer_size: Any, outer_stride: Any) -> "FakeCudaTensor":
        return _sim()._wrap(inner["_inner"], ctx[0], ctx[1])

    def __del__(self) -> None:
        # not a weakref.finalize: nn.Module.to() swaps parameters, which refuses weakrefs
        mem = self.__dict__.get("_mem")
        if mem is not None and _join is not None:  # None: the interpreter is shutting down
            mem.sim._dropped_wrapper(mem)

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
                        "copy the tensor to host memory first.")

    def tolist(self) -> Any:
        return self.cpu().tolist()

    def record_stream(self, stream: FakeStream) -> None:
        self._mem.sim._record_stream(self, stream)

    def untyped_storage(self) -> torch.UntypedStorage:
        # the inner tensor's (a wrapper has none): code that tells tensors apart by storage
        # pointer (safetensors, PEFT's save_pretrained) works; its device says cpu
        return self._inner.untyped_storage()

    # torch turns a list index into a device tensor with the Python key masked, which a CPU
    # build cannot run; CUDA takes CPU index tensors, so the list becomes one
    def __getitem__(self, index: Any) -> Any:
        return torch.Tensor.__getitem__(self, _cpu_index(index))

    def __setitem__(self, index: Any, value: Any) -> None:
        torch.Tensor.__setitem__(self, _cpu_index(index), value)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"FakeCudaTensor({list(self.shape)}, {self.dtype}, {self.device})"


_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecuda_guard.cpp")
_backend: Optional[torch.library.Library] = None


def _cuda_empty(size: Sequence[int], dtype: Optional[torch.dtype] = None, layout: Any = None,
                device: Optional[torch.device] = None, pin_memory: Optional[bool] = None,
                memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
    inner = torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
    return _sim()._empty(inner, device)


def _cuda_empty_strided(size: Sequence[int], stride: Sequence[int], dtype: Optional[torch.dtype] = None,
                        layout: Any = None, device: Optional[torch.device] = None,
                        pin_memory: Optional[bool] = None) -> torch.Tensor:
    return _sim()._empty(torch.empty_strided(size, stride, dtype=dtype), device)


def _build_guard(path: str = _GUARD) -> str:
    """The guard (or another of these C++ sources) as a shared library, compiled with the
    system's C++ compiler against torch's headers, cached per source and torch version
    (``$XDG_CACHE_HOME/kvj-fakecuda``)."""
    from torch.utils import cpp_extension

    with open(path, "rb") as f:
        source = f.read()
    tag = hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvj-fakecuda")
    name = "guard" if path == _GUARD else os.path.splitext(os.path.basename(path))[0]
    lib = os.path.join(cache, f"{name}-{tag}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(cache, exist_ok=True)
    tmp = f"{lib}.{os.getpid()}.tmp"
    cmd = [os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-O1", "-std=c++17",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{d}" for d in cpp_extension.include_paths()), path, "-o", tmp,
           *(f"-L{d}" for d in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise StandInError(f"could not compile the CUDA stand-in's device guard ({' '.join(cmd)}):\n{done.stderr}")
    os.replace(tmp, lib)  # concurrent builds: the last complete one wins
    return lib


def _register_backend() -> None:
    """Make this CPU-only torch able to hold "cuda" tensors, once per process: a do-nothing CUDA
    device guard (C++, compiled once per machine in seconds) and Python kernels for the
    CUDA ``empty``/``empty_strided``, where every device tensor (factories, ``to``, indexing
    with lists) starts; every other op on one reaches ``FakeCudaTensor.__torch_dispatch__``."""
    global _backend
    if _backend is not None:
        return
    if torch.version.cuda is not None:
        pytest.skip("the CUDA stand-in runs on CPU-only torch builds (this one has CUDA)")
    torch.ops.load_library(_build_guard())
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _cuda_empty, "CUDA")
    lib.impl("empty_strided", _cuda_empty_strided, "CUDA")
    _backend = lib


_AUTOGRAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecuda_autograd.cpp")


def autograd_env(devices: int = 1) -> Dict[str, str]:
    """Environment variables for a new process in which autograd's backward pass runs on device
    tensors of a stand-in with ``devices`` devices (install it there as usual). torch's
    autograd engine asks the CUDA hooks for the accelerator of a "cuda" gradient, and a CPU-only
    build has none: ``fakecuda_autograd.cpp`` registers some, which works only before torch
    first asks, so that library is preloaded into the process (``LD_PRELOAD``)."""
    from torch.utils import cpp_extension

    preload = [_build_guard(_AUTOGRAD), *filter(None, os.environ.get("LD_PRELOAD", "").split(":"))]
    libraries = [*cpp_extension.library_paths(), *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
    return {"LD_PRELOAD": ":".join(preload), "LD_LIBRARY_PATH": ":".join(libraries),
            "KVJ_FAKECUDA_AUTOGRAD": str(int(devices))}


def _context_device() -> Optional[torch.device]:
    """The device of an enclosing ``with torch.device(...)``, if any (not torch.get_default_device,
    which makes a tensor to find out)."""
    from torch.overrides import _get_current_function_mode_stack

    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, torch.utils._device.DeviceContext)]
    return modes[-1].device if modes else None


def _flatten(obj: Any) -> Tuple[List[Any], Any]:
    """The leaves of ``obj`` (nested tuples, lists and dicts) and a spec to rebuild it."""
    leaves: List[Any] = []
    return leaves, _walk(obj, leaves)


def _walk(x: Any, leaves: List[Any]) -> Any:
    # module-level, not a recursive closure: such a closure is a reference cycle that would
    # keep the leaves (device tensors) alive until the garbage collector runs
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_walk(v, leaves) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _walk(v, leaves)) for k, v in x.items()))
    leaves.append(x)
    return None


def _unflatten(leaves: Sequence[Any], spec: Any) -> Any:
    return _build(iter(leaves), spec)


def _build(it: Iterator[Any], spec: Any) -> Any:
    if spec is None:
        return next(it)
    kind, items = spec
    if kind is dict:
        return {k: _build(it, v) for k, v in items}
    return kind(_build(it, v) for v in items)


def _tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    leaves, spec = _flatten(obj)
    return _unflatten([fn(x) for x in leaves], spec)


def _cpu_index(index: Any) -> Any:
    if isinstance(index, list):
        return torch.tensor(index)
    if isinstance(index, tuple):
        return tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)
    return index


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes of its storage that ``t`` (a CPU tensor) can touch."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    return lo, lo + extent * size


def _poison(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    if t.dtype == torch.bool:
        t.fill_(True)
        return
    pattern = torch.full((t.element_size(),), POISON, dtype=torch.uint8).view(t.dtype)[0]
    t.fill_(pattern)


def _join(into: Dict[FakeStream, int], other: Dict[FakeStream, int]) -> None:
    for s, n in other.items():
        if into.get(s, 0) < n:
            into[s] = n


#: Ops that return views of their input (no data touched) though their schema does not say so.
_VIEWS = {aten._unsafe_view.default, aten._reshape_alias.default} if hasattr(aten, "_reshape_alias") else {
    aten._unsafe_view.default}
#: Ops whose CPU index tensors CUDA accepts (advanced indexing copies them over).
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
#: Factories whose device results a CPU build cannot make in place (see ``FakeCuda._factory``).
_MADE_ON_CPU = ("tensor", "as_tensor", "arange", "linspace", "randperm", "eye")
#: Ops returning Python values that only look at metadata.
_METADATA = {aten.is_pinned.default, aten.is_same_size.default}


class FakeCuda:
    """The simulated CUDA runtime: streams, events, memory and the ops' late execution."""

    def __init__(self, devices: int = 2):
        self.n_devices = devices
        self.lock = threading.RLock()
        self._tls = threading.local()
        self._defaults: Dict[int, FakeStream] = {}
        self.streams: List[FakeStream] = []  #: every stream made (the defaults too)
        self._pinned: Dict[int, _Memory] = {}
        #: (allocation, what was known done when one of its tensors died), reaped under the lock
        self._dropped: "collections.deque[Tuple[_Memory, Dict[FakeStream, int]]]" = collections.deque()
        self.violations: List[str] = []
        self.syncs: "collections.Counter[str]" = collections.Counter()  #: host synchronizations by kind
        self.copies: List[CopyRecord] = []
        self.events: List[FakeEvent] = []
        self.pinned_allocs = 0
        self.allocated: Dict[int, int] = collections.defaultdict(int)  #: live device bytes per device
        self.memory_limit: Dict[int, int] = {}  #: device index -> bytes; beyond it allocation fails
        self.fail_next: Optional[str] = None  #: "record", "synchronize" or "pin": that call raises once
        self._meta_cache: Dict[Tuple[Any, ...], Any] = {}
        self.stream_pool = 32  #: streams per device and priority that torch.cuda.Stream() hands out
        self._pools: Dict[Tuple[int, int], List[FakeStream]] = {}
        self._handed: "collections.Counter[Tuple[int, int]]" = collections.Counter()
        self._waits: Dict[int, "collections.Counter[str]"] = collections.defaultdict(collections.Counter)
        self._waits_lock = threading.Lock()

    # -- installing ------------------------------------------------------------------------

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
        """Patch torch (and give kvj a fresh ``device.CUDA``, whose streams are this one's)."""
        from kvj.segments import device, load as segload

        _register_backend()
        monkeypatch.setattr(sys.modules[__name__], "_ACTIVE", self)
        cuda = torch.cuda
        for name, value in {
            "Stream": FakeStream, "Event": FakeEvent, "is_available": lambda: True,
            "is_initialized": lambda: True, "device_count": lambda: self.n_devices,
            "current_device": self.current_device, "set_device": self.set_device, "device": self._device_ctx,
            "current_stream": self.current_stream, "default_stream": self.default_stream,
            "stream": self.use, "synchronize": self.synchronize, "get_device_name": lambda d=None: "cuda stand-in",
            "memory_allocated": lambda d=None: self.allocated[self.resolve("cuda" if d is None else d).index],
            "empty_cache": lambda: None, "_sleep": self.sleep, **self._rng_functions(),
        }.items():
            monkeypatch.setattr(cuda, name, value)
        torch.utils._device._device_constructors()  # cached before the patches: "with torch.device(...)"
        # adds the device to the real factories, which the patched ones call
        for name in ("empty", "zeros", "ones", "full", "empty_strided", "empty_like", "zeros_like", *_MADE_ON_CPU):
            monkeypatch.setattr(torch, name, self._factory(getattr(torch, name)))
        for name, method in self._tensor_methods().items():
            monkeypatch.setattr(torch.Tensor, name, method)
        for name, method in self._future_methods().items():
            monkeypatch.setattr(concurrent.futures.Future, name, method)
        monkeypatch.setattr(threading.Condition, "wait", self._counted_wait(threading.Condition.wait))
        monkeypatch.setattr(threading.Thread, "start", self._uncounted_start(threading.Thread.start))
        monkeypatch.setattr(device, "CUDA", device.Cuda())
        monkeypatch.setattr(segload, "_default_staging", None)  # pinned memory of no other "machine"
        return self

    def pooled_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        """``torch.cuda.Stream()``: the next stream of the device's pool for that priority class,
        round-robin (made on first use), as torch hands them out: not necessarily a new one."""
        dev = self.resolve("cuda" if device is None else device)
        key = (dev.index, -1 if priority < 0 else 0)
        with self.lock:
            pool = self._pools.setdefault(key, [])
            n = self._handed[key]
            self._handed[key] += 1
            if len(pool) < self.stream_pool:
                pool.append(FakeStream(dev, priority, name=f"pool{len(pool)}@{dev}"))
                return pool[-1]
            return pool[n % self.stream_pool]

    # -- host waits, per thread ------------------------------------------------------------

    def _note_wait(self, kind: str) -> None:
        with self._waits_lock:
            self._waits[threading.get_ident()][kind] += 1

    def host_waits(self, thread: Optional[int] = None) -> "collections.Counter[str]":
        """The host waits of thread ``thread`` (an ident; default the caller) so far, by kind."""
        with self._waits_lock:
            return collections.Counter(self._waits.get(threading.get_ident() if thread is None else thread, {}))

    def _counted_wait(self, orig: Callable[..., bool]) -> Callable[..., bool]:
        """``threading.Condition.wait``, counted as a host wait of the calling thread."""
        sim = self

        def wait(cond: threading.Condition, timeout: Optional[float] = None) -> bool:
            if (timeout is None or timeout > 0) and not getattr(sim._tls, "starting", False):
                sim._note_wait("lock wait")
            return orig(cond, timeout)
        return wait

    def _uncounted_start(self, orig: Callable[..., None]) -> Callable[..., None]:
        """``threading.Thread.start``, whose wait for the new thread to run (microseconds, on no
        other thread's work: a thread pool's first jobs start threads) is not counted."""
        sim = self

        def start(thread: threading.Thread) -> None:
            sim._tls.starting = True
            try:
                orig(thread)
            finally:
                sim._tls.starting = False
        return start

    def sleep(self, cycles: int) -> None:
        """``torch.cuda._sleep``: a kernel that only takes time, on the current stream. Every op
        here runs late anyway (when the host waits for something after it): it does nothing."""
        self._enqueue(self.current_stream(), [], lambda: None, f"_sleep({int(cycles)})")

    def _rng_functions(self) -> Dict[str, Callable[..., Any]]:
        """``torch.cuda``'s RNG state functions, per device. Random ops on device tensors draw
        from the CPU generator (they run on the inner CPU tensors), so these states are only
        kept and given back, as a checkpoint of them would be (CUDA's: 16 bytes, seed and offset)."""
        states: Dict[int, torch.Tensor] = {}

        def seeded(seed: int) -> torch.Tensor:
            return torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)

        def index(device: Any) -> int:
            return self.resolve("cuda" if device is None else device).index

        def get(device: Any = "cuda") -> torch.Tensor:
            return states.get(index(device), seeded(0)).clone()

        def put(state: torch.Tensor, device: Any = "cuda") -> None:
            states[index(device)] = state.clone()

        def seed_all(seed: int) -> None:
            states.update({i: seeded(int(seed)) for i in range(self.n_devices)})

        return {"get_rng_state": get, "set_rng_state": put,
                "get_rng_state_all": lambda: [get(i) for i in range(self.n_devices)],
                "set_rng_state_all": lambda all_states: [put(st, i) for i, st in enumerate(all_states)],
                "manual_seed": lambda seed: put(seeded(int(seed)), "cuda"), "manual_seed_all": seed_all}

    def check(self) -> None:
        """At the end of a test: let the GPU finish and raise on any violation (allocations in
        reference cycles are checked only once a collection frees them)."""
        self.advance()
        with self.lock:
            self._reap()
            if self.violations:
                raise StandInError("CUDA stand-in violations:\n  " + "\n  ".join(self.violations))

    # -- devices and current streams (per thread, as CUDA's) -------------------------------

    def resolve(self, device: Any) -> torch.device:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            return dev
        index = self.current_device() if dev.index is None else dev.index
        if not 0 <= index < self.n_devices:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return torch.device("cuda", index)

    def current_device(self) -> int:
        return getattr(self._tls, "device", 0)

    def set_device(self, device: Any) -> None:
        self._tls.device = self.resolve(device).index

    @contextmanager
    def _device_ctx(self, device: Any) -> Iterator[None]:
        before = self.current_device()
        if device is not None and not (isinstance(device, int) and device < 0):
            self.set_device(device)
        try:
            yield
        finally:
            self._tls.device = before

    def default_stream(self, device: Any = None) -> FakeStream:
        dev = self.resolve("cuda" if device is None else device)
        with self.lock:
            if dev.index not in self._defaults:
                self._defaults[dev.index] = FakeStream(dev, name=f"default@{dev}")
            return self._defaults[dev.index]

    def current_stream(self, device: Any = None) -> FakeStream:
        dev = self.resolve("cuda" if device is None else device)
        current = getattr(self._tls, "streams", {}).get(dev.index)
        return current if current is not None else self.default_stream(dev)

    @contextmanager
    def use(self, stream: Optional[FakeStream]) -> Iterator[None]:
        """``torch.cuda.stream(s)``: ``s`` is the current stream (and its device the current one)."""
        if stream is None:
            yield
            return
        streams = self._tls.__dict__.setdefault("streams", {})
        before, before_dev = streams.get(stream.device.index), self.current_device()
        streams[stream.device.index] = stream
        self._tls.device = stream.device.index
        try:
            yield
        finally:
            streams[stream.device.index] = before
            self._tls.device = before_dev

    def _host(self) -> Dict[FakeStream, int]:
        """What the calling thread knows is done."""
        clock = getattr(self._tls, "clock", None)
        if clock is None:
            clock = self._tls.clock = {}
        return clock

    # -- synchronization -------------------------------------------------------------------

    def _inject(self, where: str) -> None:
        if self.fail_next == where:
            self.fail_next = None
            raise RuntimeError(f"CUDA error (injected by the stand-in): {where} failed")

    def _join_host(self, stream: FakeStream) -> None:
        _join(stream.clock, self._host())

    def _wait(self, stream: FakeStream, clock: Dict[FakeStream, int]) -> None:
        with self.lock:
            self._join_host(stream)
            _join(stream.clock, clock)

    def _run_upto(self, stream: FakeStream, seq: int) -> None:
        while stream.queue and stream.queue[0].seq <= seq:
            op = stream.queue[0]
            for other, n in op.deps.items():
                if other is not stream:
                    self._run_upto(other, n)
            if stream.queue and stream.queue[0] is op:
                stream.queue.popleft()
                op.run()
                stream.done = op.seq

    def _run(self, clock: Dict[FakeStream, int]) -> None:
        for stream, n in list(clock.items()):
            self._run_upto(stream, n)

    def _host_wait(self, clock: Dict[FakeStream, int], kind: str) -> None:
        """The host blocks until ``clock``'s work has run, and knows it has."""
        with self.lock:
            self._reap()
            self._run(clock)
            _join(self._host(), clock)
            self.syncs[kind] += 1
        self._note_wait(kind)

    def _query(self, clock: Dict[FakeStream, int]) -> bool:
        """True once the work has run (the GPU here runs only when asked: see ``advance``)."""
        with self.lock:
            if all(s.done >= n for s, n in clock.items()):
                _join(self._host(), clock)
                return True
            return False

    def synchronize(self, device: Any = None) -> None:
        """``torch.cuda.synchronize``: every stream of the device."""
        dev = self.resolve("cuda" if device is None else device)
        with self.lock:
            clock: Dict[FakeStream, int] = {}
            for stream in self.streams:
                if stream.device == dev:
                    _join(clock, {stream: stream.seq})
        self._host_wait(clock, "device")

    def advance(self) -> None:
        """The GPU catches up: every queued op runs (the host learns nothing from it)."""
        with self.lock:
            for stream in list(self.streams):
                self._run_upto(stream, stream.seq)

    def waited(self, stream: FakeStream, event: FakeEvent) -> bool:
        """Whether ``stream``'s later work is ordered after ``event`` (it waited for it)."""
        with self.lock:
            return all(stream.clock.get(s, 0) >= n for s, n in event.clock.items())

    def in_flight(self, host: torch.Tensor) -> bool:
        """Whether a queued op still reads or writes any byte of pinned ``host``."""
        with self.lock:
            mem = self._pinned_mem(host)
            if mem is None:
                return False
            lo, hi = _span(host)
            return any(a.stream.done < a.seq and a.lo < hi and lo < a.hi for a in mem.accesses)

    # -- memory ----------------------------------------------------------------------------

    def _register_pinned(self, t: torch.Tensor) -> torch.Tensor:
        with self.lock:
            if self.fail_next == "pin":  # as cudaHostAlloc fails: torch raises a plain RuntimeError
                self.fail_next = None
                raise RuntimeError("CUDA error: out of memory (pinned host memory, injected by the stand-in)")
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self.lock:
            self._pinned[key] = _Memory(self, f"pinned buffer of {storage.nbytes()} bytes", None, None)
            self.pinned_allocs += 1
        self._note_wait("pinned allocation")
        weakref.finalize(storage, self._pinned.pop, key, None)
        return t

    def _pinned_mem(self, t: torch.Tensor) -> Optional[_Memory]:
        if isinstance(t, FakeCudaTensor) or t.device.type != "cpu":
            return None
        return self._pinned.get(t.untyped_storage().data_ptr())

    def _allocate(self, inner: torch.Tensor, device: torch.device, label: str) -> FakeCudaTensor:
        """A new device allocation holding ``inner``'s storage, made on the current stream."""
        storage = inner.untyped_storage()
        nbytes = storage.nbytes()
        with self.lock:
            self._reap()
            limit = self.memory_limit.get(device.index)
            if limit is not None and self.allocated[device.index] + nbytes > limit:
                raise torch.cuda.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {nbytes} bytes on {device} (stand-in limit {limit})")
            self.allocated[device.index] += nbytes
            mem = _Memory(self, f"{label} ({nbytes} bytes on {device})", device, self.current_stream(device))
        weakref.finalize(storage, self._free_bytes, device.index, nbytes)
        return self._wrap(inner, device, mem)

    def _free_bytes(self, index: int, nbytes: int) -> None:
        self.allocated[index] -= nbytes

    def _wrap(self, inner: torch.Tensor, device: torch.device, mem: _Memory) -> FakeCudaTensor:
        requires_grad = inner.requires_grad
        t = FakeCudaTensor(inner.detach() if requires_grad else inner, device, requires_grad)
        t._mem = mem
        with self.lock:
            mem.refs += 1
        return t

    def _dropped_wrapper(self, mem: _Memory) -> None:
        # runs wherever the last reference died: take no lock; note what this thread knew and
        # what the allocating stream had waited for then (its later allocations reuse the memory)
        known = dict(self._host())
        if mem.alloc is not None:
            _join(known, dict(mem.alloc.clock))
        self._dropped.append((mem, known))

    def _reap(self) -> None:
        """Allocations whose last tensor died: report cross-stream uses nothing fenced."""
        while self._dropped:
            mem, known = self._dropped.popleft()
            mem.refs -= 1
            if mem.refs or mem.alloc is None:
                continue
            for stream, seq in mem.cross.items():
                if stream in mem.recorded or known.get(stream, 0) >= seq:
                    continue
                self.violations.append(
                    f"{mem.label}, allocated on {mem.alloc!r}, was used on {stream!r} (op {seq}) and freed "
                    "without record_stream while that use may still run: the allocator could hand it out again")

    def _record_stream(self, t: FakeCudaTensor, stream: FakeStream) -> None:
        with self.lock:
            if stream.device != t.device:
                raise RuntimeError(f"record_stream: stream {stream!r} is not on the tensor's device {t.device}")
            t._mem.recorded.add(stream)

    # -- enqueueing ------------------------------------------------------------------------

    def _enqueue(self, stream: FakeStream, accesses: Sequence[Tuple[_Memory, torch.Tensor, bool]],
                 run: Callable[[], None], label: str) -> _Op:
        """Put ``run`` on ``stream`` after checking its accesses (memory, CPU view, write) for races."""
        with self.lock:
            self._reap()
            self._join_host(stream)
            spans = [(mem, *_span(view), write) for mem, view, write in accesses]
            for mem, lo, hi, write in spans:
                self._check(stream, mem, lo, hi, write, label)
            stream.seq += 1
            seq = stream.seq
            stream.clock[stream] = seq
            op = _Op(stream, seq, dict(stream.clock), run, f"{label} (op {seq} on {stream.name})")
            for mem, lo, hi, write in spans:
                self._note(mem, _Access(stream, seq, lo, hi, write, op.label))
            stream.queue.append(op)
            return op

    def _check(self, stream: FakeStream, mem: _Memory, lo: int, hi: int, write: bool, label: str) -> None:
        for a in mem.accesses:
            if a.stream is stream or not (write or a.write) or not (a.lo < hi and lo < a.hi):
                continue
            if stream.clock.get(a.stream, 0) < a.seq:
                msg = (f"{label} on {stream!r} {'writes' if write else 'reads'} {mem.label} that "
                       f"{a.label} {'writes' if a.write else 'reads'}, with no wait between them "
                       "(a missing wait_stream/wait_event)")
                self.violations.append(msg)
                raise Hazard(msg)

    def _note(self, mem: _Memory, access: _Access) -> None:
        kept = [a for a in mem.accesses
                if not (a.stream is access.stream and access.lo <= a.lo and a.hi <= access.hi
                        and (access.write or not a.write))]
        kept.append(access)
        mem.accesses = kept[-_MAX_ACCESSES:]
        if mem.alloc is not None and access.stream is not mem.alloc:
            mem.cross[access.stream] = access.seq

    # -- dispatch --------------------------------------------------------------------------

    def _dispatch(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if func is aten.copy_.default:
            return self._copy(*args, **kwargs)
        if func is aten._to_copy.default:
            return self._to_copy(*args, **kwargs)
        if func in _METADATA:
            return func(*_tree_map(self._meta_arg, args), **_tree_map(self._meta_arg, kwargs))
        if func is aten.detach_.default:
            return args[0]
        returns = func._schema.returns
        if returns and not any(isinstance(r.type, (torch.TensorType, torch.ListType, torch.OptionalType))
                               for r in returns):
            return self._host_read(func, args, kwargs)
        if func.is_view or func in _VIEWS:
            return self._view(func, args, kwargs)
        return self._kernel(func, args, kwargs)

    @staticmethod
    def _meta_arg(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            inner = x._inner if isinstance(x, FakeCudaTensor) else x
            return torch.empty_strided(inner.shape, inner.stride(), dtype=inner.dtype, device="meta")
        if isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("meta")
        return x

    def _device_of(self, func: Any, flat: List[Any], allowed_cpu: Sequence[torch.Tensor] = ()) -> torch.device:
        """The one device of the op's tensors; CUDA's error if they are on several."""
        device: Optional[torch.device] = None
        for x in flat:
            if isinstance(x, FakeCudaTensor):
                if device is None:
                    device = x.device
                elif x.device != device:
                    self._mismatch(func, device, x.device)
        assert device is not None
        for x in flat:
            if (isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor) and x.dim() > 0
                    and not any(x is a for a in allowed_cpu)):
                self._mismatch(func, device, x.device)
        return device

    @staticmethod
    def _mismatch(func: Any, a: torch.device, b: torch.device) -> None:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{a} and {b}! (in {func}, CUDA stand-in)")

    def _unwrap(self, x: Any) -> Any:
        if isinstance(x, FakeCudaTensor):
            return x._inner
        if isinstance(x, torch.Tensor):
            return x.clone()  # a CPU scalar or index: CUDA takes its value at launch
        if isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("cpu")
        return x

    def _view(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        flat, _ = _flatten((args, kwargs))
        device = self._device_of(func, flat)
        owners = {x._inner.untyped_storage().data_ptr(): x._mem for x in flat if isinstance(x, FakeCudaTensor)}
        out = func(*_tree_map(self._unwrap, args), **_tree_map(self._unwrap, kwargs))

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            mem = owners.get(t.untyped_storage().data_ptr())
            if mem is None:
                raise StandInError(f"{func} returned a tensor that views none of its inputs")
            return self._wrap(t, device, mem)
        return _tree_map(wrap, out)

    def _mutated(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The tensors the op writes in place, by alias set (``self`` of ``add_``, ``out=``...)."""
        written: Dict[str, Any] = {}
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            if value is not None:
                written[next(iter(info.before_set), arg.name)] = value
        return written

    def _kernel(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        flat, _ = _flatten((args, kwargs))
        written_flat = [t for t in _flatten(list(self._mutated(func, args, kwargs).values()))[0]
                        if isinstance(t, torch.Tensor)]
        allowed: List[torch.Tensor] = []
        if func in _INDEXING:
            allowed = [t for t in _flatten(args[1])[0] if isinstance(t, torch.Tensor)]
        device = self._device_of(func, flat, allowed)
        for t in written_flat:
            if not isinstance(t, FakeCudaTensor):
                self._mismatch(func, device, t.device)
        shape = self._out_shape(func, args, kwargs, flat, written_flat)
        if shape is None:
            return self._eager(func, args, kwargs, device)
        out_leaves, spec, returns_written = shape
        outputs: List[Any] = []
        fresh: List[Tuple[int, FakeCudaTensor]] = []
        for i, leaf in enumerate(out_leaves):
            if returns_written is not None and i < len(returns_written) and returns_written[i] is not None:
                outputs.append(written_flat[returns_written[i]])
            elif isinstance(leaf, _Out):
                out = self._allocate(torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype), device,
                                     f"output of {func}")
                fresh.append((i, out))
                outputs.append(out)
            else:
                outputs.append(leaf)
        inner_args, inner_kwargs = _tree_map(self._unwrap, args), _tree_map(self._unwrap, kwargs)
        fresh_inner = [(i, o._inner) for i, o in fresh]

        def run() -> None:
            result = func(*inner_args, **inner_kwargs)
            if fresh_inner:
                result_flat = _flatten(result)[0]
                for i, inner in fresh_inner:
                    inner.copy_(result_flat[i])

        written_ids = {id(t) for t in written_flat}
        accesses = [(x._mem, x._inner, id(x) in written_ids) for x in flat if isinstance(x, FakeCudaTensor)]
        accesses += [(o._mem, o._inner, True) for _, o in fresh]
        self._enqueue(self.current_stream(device), accesses, run, str(func))
        return _unflatten(outputs, spec)

    def _out_shape(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], flat: List[Any],
                   written: List[torch.Tensor]) -> Optional[Tuple[List[Any], Any, Optional[List[Optional[int]]]]]:
        """What the op returns, from its meta kernel (cached by the inputs' shapes): the output
        leaves (``_Out`` for a new tensor), their spec, and for each leaf the index in
        ``written`` of the argument it returns (in-place and ``out=`` ops). None: no meta kernel."""
        key = self._meta_key(func, flat)
        cached = self._meta_cache.get(key) if key is not None else None
        if cached is not None:
            return cached
        metas: Dict[int, torch.Tensor] = {}

        def meta(x: Any) -> Any:
            m = self._meta_arg(x)
            if isinstance(x, torch.Tensor):
                metas[id(x)] = m
            return m
        meta_args, meta_kwargs = _tree_map(meta, args), _tree_map(meta, kwargs)
        try:
            meta_out = func(*meta_args, **meta_kwargs)
        except NotImplementedError:
            return None
        if any(metas[id(t)].shape != t.shape for t in written):
            raise StandInError(f"{func} resizes a device tensor in place, which the stand-in cannot do")
        leaves, spec = _flatten(meta_out)
        by_meta = {id(metas[id(t)]): i for i, t in enumerate(written)}
        returns_written = [by_meta.get(id(m)) if isinstance(m, torch.Tensor) else None for m in leaves]
        out_leaves = [_Out(tuple(m.shape), tuple(m.stride()), m.dtype) if isinstance(m, torch.Tensor)
                      and by_meta.get(id(m)) is None else m for m in leaves]
        result = (out_leaves, spec, returns_written)
        if key is not None:
            self._meta_cache[key] = result
        return result

    @staticmethod
    def _meta_key(func: Any, flat: List[Any]) -> Optional[Tuple[Any, ...]]:
        parts: List[Any] = [func]
        for x in flat:
            if isinstance(x, torch.Tensor):
                inner = x._inner if isinstance(x, FakeCudaTensor) else x
                parts.append((tuple(inner.shape), inner.stride(), inner.dtype, isinstance(x, FakeCudaTensor)))
            elif isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                                torch.layout)):
                parts.append((type(x), x))
            else:
                return None
        return tuple(parts)

    def _eager(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], device: torch.device) -> Any:
        """An op with a data-dependent result shape: it runs now, after what it depends on (on
        CUDA such ops synchronize the host too)."""
        stream = self.current_stream(device)
        flat, _ = _flatten((args, kwargs))
        written = {id(t) for t in _flatten(list(self._mutated(func, args, kwargs).values()))[0]}
        accesses = [(x._mem, x._inner, id(x) in written) for x in flat if isinstance(x, FakeCudaTensor)]
        self._enqueue(stream, accesses, lambda: None, str(func))
        self._host_wait(dict(stream.clock), "data-dependent op")
        out = func(*_tree_map(self._unwrap, args), **_tree_map(self._unwrap, kwargs))
        return _tree_map(lambda t: self._allocate(t, device, f"output of {func}") if isinstance(t, torch.Tensor)
                        and not any(t is getattr(x, "_inner", None) for x in flat) else t, out)

    def _host_read(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """``item()``, ``equal``...: a value the host gets by waiting for the current stream."""
        flat, _ = _flatten((args, kwargs))
        device = self._device_of(func, flat)
        stream = self.current_stream(device)
        accesses = [(x._mem, x._inner, False) for x in flat if isinstance(x, FakeCudaTensor)]
        self._enqueue(stream, accesses, lambda: None, str(func))
        self._host_wait(dict(stream.clock), "host read")
        return func(*_tree_map(self._unwrap, args), **_tree_map(self._unwrap, kwargs))

    # -- copies ----------------------------------------------------------------------------

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        to_dev, from_dev = isinstance(dst, FakeCudaTensor), isinstance(src, FakeCudaTensor)
        if to_dev and from_dev:
            stream = self.current_stream(dst.device)
            if src.device != dst.device:  # a peer copy orders itself after the source device's stream
                self._wait(stream, dict(self.current_stream(src.device).clock))
            inner_dst, inner_src = dst._inner, src._inner
            self._enqueue(stream, [(src._mem, inner_src, False), (dst._mem, inner_dst, True)],
                          lambda: inner_dst.copy_(inner_src), "copy_ (device to device)")
            return dst
        if to_dev:
            return self._upload(dst, src, non_blocking)
        return self._download(dst, src, non_blocking)

    def _upload(self, dst: FakeCudaTensor, src: torch.Tensor, non_blocking: bool) -> FakeCudaTensor:
        stream = self.current_stream(dst.device)
        mem = self._pinned_mem(src)
        late = non_blocking and mem is not None
        source = src if late else src.clone()  # pageable memory is staged before copy_ returns
        inner = dst._inner
        accesses = [(dst._mem, inner, True)] + ([(mem, src, False)] if late else [])
        with self.lock:
            self._enqueue(stream, accesses, lambda: inner.copy_(source), "copy_ (host to device)")
            self.copies.append(CopyRecord("h2d", stream, src, late))
        if not non_blocking:
            self._host_wait(dict(stream.clock), "blocking copy")
        return dst

    def _download(self, dst: torch.Tensor, src: FakeCudaTensor, non_blocking: bool) -> torch.Tensor:
        stream = self.current_stream(src.device)
        mem = self._pinned_mem(dst)
        late = non_blocking and mem is not None
        inner = src._inner
        accesses = [(src._mem, inner, False)] + ([(mem, dst, True)] if late else [])
        with self.lock:
            if late:  # earlier queued copies of these host bytes run before the poison lands
                lo, hi = _span(dst)
                for a in list(mem.accesses):
                    if a.lo < hi and lo < a.hi:
                        self._run_upto(a.stream, a.seq)
            self._enqueue(stream, accesses, lambda: dst.copy_(inner), "copy_ (device to host)")
            self.copies.append(CopyRecord("d2h", stream, dst, late))
            if late:
                _poison(dst)
        if not late:
            self._host_wait(dict(stream.clock), "blocking copy")
        return dst

    def _to_copy(self, x: FakeCudaTensor, *, dtype: Optional[torch.dtype] = None, layout: Any = None,
                 device: Optional[torch.device] = None, pin_memory: Optional[bool] = None,
                 non_blocking: bool = False, memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
        target = x.device if device is None else self.resolve(device)
        fmt = memory_format or torch.preserve_format
        out_inner = torch.empty_like(x._inner, dtype=dtype or x.dtype, memory_format=fmt)
        if target.type == "cpu":
            if pin_memory or non_blocking:  # torch pins the result of a non-blocking download
                self._register_pinned(out_inner)
            return self._download(out_inner, x, non_blocking)
        out = self._allocate(out_inner, target, "output of to()")
        return self._copy(out, x, non_blocking)

    # -- patched torch entry points ----------------------------------------------------------

    def _factory(self, orig: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A factory taking ``pin_memory=True`` (a CPU-only build has no pinned allocator); those
        torch builds on the device in ways a CPU build cannot (``tensor`` masks the Python key,
        ``arange``... resize an empty result) make their values on the CPU, then copy them up on
        the current stream as CUDA would write them there."""
        @functools.wraps(orig)
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            pin = kwargs.pop("pin_memory", False)
            device = kwargs.get("device")
            if device is None and orig.__name__ in _MADE_ON_CPU:
                device = _context_device()
            if orig.__name__ in _MADE_ON_CPU and device is not None and (
                    isinstance(device, int) or torch.device(device).type == "cuda"):
                kwargs["device"] = "cpu"
                requires_grad = kwargs.pop("requires_grad", False)
                out = self.fresh(orig(*args, **kwargs), self.resolve(device))
                return out.requires_grad_() if requires_grad else out
            out = orig(*args, **kwargs)
            return self._register_pinned(out) if pin else out
        return factory

    def _empty(self, inner: torch.Tensor, device: Optional[torch.device]) -> FakeCudaTensor:
        """What torch's CUDA ``empty``/``empty_strided`` return: uninitialized device memory."""
        return self._allocate(inner, self.resolve("cuda" if device is None else device), "torch.empty")

    def _future_methods(self) -> Dict[str, Callable[..., Any]]:
        """A future carries what the thread that completed it knew to the thread reading it."""
        sim, base = self, concurrent.futures.Future

        def completing(orig: Callable[..., Any]) -> Callable[..., Any]:
            def complete(f: concurrent.futures.Future, value: Any) -> Any:
                f._kvj_known = dict(sim._host())  # type: ignore[attr-defined]
                return orig(f, value)
            return complete

        def reading(orig: Callable[..., Any]) -> Callable[..., Any]:
            def read(f: concurrent.futures.Future, timeout: Optional[float] = None) -> Any:
                try:
                    return orig(f, timeout)
                finally:
                    known = getattr(f, "_kvj_known", None)
                    if known is not None:
                        with sim.lock:
                            _join(sim._host(), known)
            return read

        return {"set_result": completing(base.set_result), "set_exception": completing(base.set_exception),
                "result": reading(base.result), "exception": reading(base.exception)}

    def _tensor_methods(self) -> Dict[str, Callable[..., Any]]:
        """``Tensor.is_pinned`` and ``.pin_memory`` for CPU tensors."""
        sim = self

        def is_pinned(t: torch.Tensor, device: Any = None) -> bool:
            return sim._pinned_mem(t) is not None

        def pin_memory(t: torch.Tensor, device: Any = None) -> torch.Tensor:
            if isinstance(t, FakeCudaTensor):
                raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
            return t if sim._pinned_mem(t) is not None else sim._register_pinned(t.clone())

        return {"is_pinned": is_pinned, "pin_memory": pin_memory}

    # -- helpers for tests -------------------------------------------------------------------

    def fresh(self, t: torch.Tensor, device: Any = "cuda") -> FakeCudaTensor:
        """``t``'s values on ``device``, written by a copy the host has not waited for (so no
        host wait orders what the test does next: only kvj's own waits can)."""
        out = torch.empty_like(t, device=device)
        out.copy_(t, non_blocking=True)  # pageable: staged at once, written on the current stream
        return out

    def pool_in_flight(self, pool: Any) -> bool:
        """Whether any buffer a ``StagingPool`` keeps for reuse is still touched by a queued copy."""
        return any(self.in_flight(buf) for bufs in pool._cached.values() for buf in bufs)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """The stand-in with two devices, installed for one test and checked at its end."""
    sim = FakeCuda(devices=2).install(monkeypatch)
    yield sim
    sim.check()
