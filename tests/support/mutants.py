"""Mutation testing of kvj's GPU ordering: delete one wait, event or ``record_stream`` at a time
and show that a device-path test, run under the strict CUDA stand-in, fails.

A :class:`Site` names one place in kvj's source: a function (``Class.method`` for methods), the
exact text to replace there (it must occur once in that function's source) and what replaces it:
``None`` for a deleted call, ``torch.cuda.Event()`` for an event that covers no work, ``True`` or
``False`` for a poll or check that lies. :func:`mutated` compiles the changed function and
swaps its code object in place (every reference to the function sees the mutant, also names
imported elsewhere) until the block ends.

Adding a site (the training snapshot and the vLLM connector, say): append a ``Site`` to
``SITES`` with the module, the function, the text and its replacement, and ``hint``: the names
(or parts of names) of the tests that should catch it, run first. Add the test module that
exercises the path to ``MODULES`` if it is not there; its tests may take only the ``gpu``,
``tmp_path`` and ``monkeypatch`` fixtures and ``parametrize`` marks (they run in-process, each
with a fresh stand-in, outside pytest). ``tests/segments/test_mutations.py`` then shows some
test fails for every site, and that the killing test passes on the unchanged code.
"""

from __future__ import annotations

import __future__
import ast
import importlib
import importlib.util
import inspect
import itertools
import os
import pathlib
import shutil
import tempfile
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

from support.fakecuda import FakeCuda

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


@dataclass(frozen=True)
class Site:
    """One wait, event or record_stream in kvj, and the mutant without it."""

    module: str
    function: str
    old: str
    new: str = "None"
    hint: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.function}: {self.old} -> {self.new}"


D, R, F, S = "kvj.segments.device", "kvj.segments.load", "kvj.segments.flusher", "kvj.segments.store"
K = "kvj.segments.kvblock"
T, TR = "kvj.integrations.training.host", "kvj.integrations.training.recover"
VS, VL = "kvj.integrations.vllm.saves", "kvj.integrations.vllm.loads"
NO_EVENT = "torch.cuda.Event()"  # never recorded: waits on it return at once, queries say done

#: Every host wait, GPU-side wait, event and record_stream on kvj's device paths.
SITES: List[Site] = [
    # the primitives themselves
    Site(D, "Cuda.wait", "event.synchronize()", hint=("flush_from_cuda",)),
    Site(D, "Cuda.done", "bool(event.query())", "True", hint=("ring",)),
    Site(D, "Cuda.gpu_wait", "stream.wait_event(event)", hint=("flush_from_cuda",)),
    Site(D, "Cuda.gpu_wait_stream", "stream.wait_stream(other)", hint=("flush_from_cuda",)),
    Site(D, "Cuda.keep_alive", "tensor.record_stream(stream)", hint=("used_and_dropped",)),
    Site(D, "Cuda.settle", "stream.synchronize()", hint=("error_after_the_copy",)),
    Site(D, "Cuda.enqueue_on", "self.settle(stream)", hint=("error_after_the_copy[record]",)),
    Site(D, "Cuda.finish", "self.wait(event)", hint=("get_onto_cuda",)),
    Site(D, "Cuda.finish", "self.settle(stream)", hint=("error_after_the_copy[synchronize]",)),
    # host to device (a segment loaded onto the device)
    Site(D, "Cuda.upload", "self.record(side)", NO_EVENT, hint=("get_onto_cuda",)),
    Site(D, "Cuda.upload", "self.keep_alive(out, self.current_stream(device))", hint=("used_and_dropped",)),
    Site(S, "SegmentStore.get", 'cuda.CUDA.finish(copied, cuda.CUDA.side_stream(target, "h2d"))',
         hint=("get_onto_cuda",)),
    # device to host (the flusher's downloads)
    Site(D, "Cuda.download", "self.gpu_wait_stream(side, current)", hint=("flush_from_cuda",)),
    Site(D, "Cuda.download", "self.record(side)", NO_EVENT, hint=("flush_from_cuda",)),
    Site(D, "Cuda.download", "self.keep_alive(tensor, side)", hint=("another_stream",)),
    Site(D, "Cuda.download", "self.gpu_wait(current, event)", hint=("flush_from_cuda",)),
    Site(F, "Flusher._work", "device.CUDA.wait(event)", hint=("flush_from_cuda",)),
    # paged KV blocks (the vLLM connector's save and load, restore_paged)
    Site(D, "gather_blocks", "cu.gpu_wait_stream(side, current)", hint=("gather_saves",)),
    Site(D, "gather_blocks", "cu.record(side)", NO_EVENT, hint=("gather_saves",)),
    Site(D, "gather_blocks", "cu.keep_alive(bufs.blocks, side)", hint=("reuse_the_blocks",)),
    Site(D, "scatter_blocks", "cu.gpu_wait_stream(side, current)", hint=("old_slots",)),
    Site(D, "scatter_blocks", "cu.record(side)", NO_EVENT, hint=("two_restores",)),
    Site(D, "scatter_blocks", "cu.keep_alive(t, side)", hint=("scatter_loads",)),
    Site(D, "Transfer.wait", "CUDA.finish(self.event, self.stream)", hint=("two_restores",)),
    Site(D, "Transfer.fence", "CUDA.gpu_wait(waiter, self.event)", hint=("scatter_loads",)),
    Site(D, "BlockBuffers.busy", "not self.transfer.done()", "False", hint=("ring",)),
    Site(D, "BlockRing.take", "return None", "return (bufs.transfer.wait(), bufs)[1]", hint=("slow_disk",)),
    Site(K, "restore_paged", "moved.wait()", hint=("two_restores",)),
    Site(R, "load_many", "with cuda.CUDA.use(stream):", "if True:", hint=("worker_threads_are_fenced",)),
    # the training capture (StateJournal's saves, recovery onto a device)
    Site(T, "StateBuffers._download", "cuda.CUDA.gpu_wait_stream(side, current)", hint=("one_copy",)),
    Site(T, "StateBuffers._download", "early = cuda.CUDA.record(side)", f"early = {NO_EVENT}", hint=("scalers",)),
    Site(T, "StateBuffers._download", "gathered = cuda.CUDA.record(side)", f"gathered = {NO_EVENT}",
         hint=("one_copy",)),
    Site(T, "StateBuffers._download", "landed = cuda.CUDA.record(side)", f"landed = {NO_EVENT}", hint=("one_copy",)),
    Site(T, "StateBuffers._download", "cuda.CUDA.gpu_wait(current, gathered)", hint=("one_copy",)),
    Site(T, "StateBuffers._download", "cuda.CUDA.gpu_wait(current, early)", hint=("scalers",)),
    Site(T, "StateBuffers._before_step", "cuda.CUDA.gpu_wait(cuda.CUDA.current_stream(device), gathered)",
         hint=("only_the_next_optimizer_step",)),
    Site(T, "Capture.wait", "cuda.CUDA.finish(event, stream)", hint=("one_copy",)),
    Site(TR, "_placed", 'cuda.CUDA.finish(last, cuda.CUDA.side_stream(target, "h2d"))',
         hint=("recovered_onto_the_device",)),
    # the vLLM connector's worker side (a step's saves written from pinned staging; a load reported done)
    Site(VS, "Saves._write_round", "moved.wait()", hint=("device_a_step_saves",)),
    Site(VL, "Loads._advance", "ch.copy.done()", "True", hint=("device_a_step_saves",)),
    # ... and never makes the serving thread wait (a wait reintroduced: issue 39 item 3)
    Site(VS, "Saves._gather_round", "job.add_done_callback(self._round_done)",
         "job.add_done_callback(self._round_done); job.result()", hint=("slow_disk",)),
    Site(VS, "Saves._gather_round", "slot = self.buffers.saves.take() if self.buffers.saves is not None else None",
         "slot = device.CUDA.pinned(self.buffers.saves.slot_bytes)", hint=("slow_disk",)),
    Site(VL, "Loads._start_reads", "slot = pool.take() if pool is not None else None",
         "slot = device.CUDA.pinned(pool.slot_bytes)", hint=("larger_than_the_staging",)),
]

#: The CPU-into-CUDA ``index_copy_`` the vLLM connector once had: the host's ids and blocks
#: scattered straight into a device cache.
CPU_INTO_CUDA = Site(D, "scatter_blocks", "cache.index_copy_(0, dev_ids, part)",
                     "cache.index_copy_(0, ids_host, part)", hint=("scatter_loads",))

#: The device-path tests every mutant runs against (files under tests/).
MODULES = ["segments/test_device_paths.py", "segments/test_device_blocks.py", "integrations/test_training_device.py",
           "integrations/test_dcp.py", "integrations/test_vllm_worker.py", "integrations/test_vllm_serving.py"]

FIXTURES = {"gpu", "tmp_path", "monkeypatch"}


def _function(site: Site) -> Callable[..., Any]:
    obj: Any = importlib.import_module(site.module)
    for part in site.function.split("."):
        obj = obj.__dict__[part] if isinstance(obj, type) else getattr(obj, part)
    return inspect.unwrap(obj)


@contextmanager
def mutated(site: Site) -> Iterator[None]:
    """Run the block with ``site``'s function changed as the site says."""
    fn = _function(site)
    source = textwrap.dedent(inspect.getsource(fn))
    if source.count(site.old) != 1:
        raise AssertionError(f"{site.name}: the text occurs {source.count(site.old)} times in "
                             f"{site.function} (the code changed: update the site)")
    tree = ast.parse(source.replace(site.old, site.new))
    (node,) = tree.body
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    node.decorator_list = []
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    code = compile(tree, fn.__code__.co_filename, "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)
    scope: Dict[str, Any] = {}
    exec(code, fn.__globals__, scope)
    original = fn.__code__
    fn.__code__ = scope[node.name].__code__
    try:
        yield
    finally:
        fn.__code__ = original


@dataclass
class Case:
    """One device-path test with one set of parameters."""

    id: str
    fn: Callable[..., Any]
    params: Dict[str, Any]


def cases(modules: Sequence[str] = MODULES) -> List[Case]:
    """The tests of ``modules`` that use the stand-in, each parametrization a case."""
    out: List[Case] = []
    for rel in modules:
        path = os.path.join(HERE, rel)
        spec = importlib.util.spec_from_file_location(f"kvj_mutants.{rel[:-3].replace('/', '.')}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not callable(fn):
                continue
            args = list(inspect.signature(fn).parameters)
            if "gpu" not in args:
                continue
            grid: List[Dict[str, Any]] = [{}]
            for mark in getattr(fn, "pytestmark", []):
                if mark.name != "parametrize":
                    continue
                names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else mark.args[0]
                rows = [v if len(names) > 1 else (v,) for v in mark.args[1]]
                grid = [{**g, **dict(zip(names, row))} for g, row in itertools.product(grid, rows)]
            for params in grid:
                unknown = set(args) - FIXTURES - set(params)
                if unknown:
                    raise AssertionError(f"{rel}::{name} takes {sorted(unknown)}: mutation runs give only "
                                         f"{sorted(FIXTURES)}")
                label = "-".join(str(v) for v in params.values())
                out.append(Case(f"{rel}::{name}" + (f"[{label}]" if label else ""), fn, params))
    return out


#: What a broken mutant (not a missing wait) raises: such a failure kills nothing.
BROKEN = (NameError, TypeError, AttributeError, SyntaxError, ImportError)


def run(case: Case) -> Optional[BaseException]:
    """Run one case under a fresh stand-in; the exception it failed with, or None."""
    mp = pytest.MonkeyPatch()
    tmp = tempfile.mkdtemp(prefix="kvj-mutant-")
    try:
        sim = FakeCuda(devices=2).install(mp)
        given = {"gpu": sim, "tmp_path": pathlib.Path(tmp), "monkeypatch": mp}
        args = inspect.signature(case.fn).parameters
        case.fn(**{k: v for k, v in given.items() if k in args}, **case.params)
        sim.check()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure of the test is what we look for
        if isinstance(exc, BROKEN):
            raise AssertionError(f"{case.id} broke ({type(exc).__name__}: {exc}), not a failed check") from exc
        return exc
    finally:
        mp.undo()
        shutil.rmtree(tmp, ignore_errors=True)


def first_killer(site: Site, all_cases: Sequence[Case]) -> Optional[Tuple[Case, BaseException]]:
    """The first case that fails with ``site`` mutated (its hints first), or None: a survivor."""
    hinted = [c for c in all_cases if any(h in c.id for h in site.hint)]
    order = hinted + [c for c in all_cases if c not in hinted]
    with mutated(site):
        for case in order:
            exc = run(case)
            if exc is not None:
                return case, exc
    return None
