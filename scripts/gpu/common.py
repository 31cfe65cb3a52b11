"""What the checks of kvj's GPU check share: sizes, the context a check runs with, its parts (each
PASS or FAIL), the CUDA stand-in when asked for, and small tensor helpers."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import faulthandler
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The command the runner and the checks' child processes run.
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")
#: torch.cuda._sleep's length in milliseconds; the long one outlasts a whole burst of enqueues,
#: the training one a forward and backward pass of the 1B model.
DELAY_MS, LONG_DELAY_MS, TRAINING_DELAY_MS = 20.0, 200.0, 500.0
SEED = 20261201

#: Llama configurations built from transformers configs with random weights (nothing downloaded).
MODELS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2),
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, initializer_range=0.02),
}


@dataclass(frozen=True)
class Sizes:
    """Every size the checks use: ``FULL`` on a GPU, ``SMALL`` for ``--small`` and the stand-in."""

    micro: Tuple[int, int, int, int, int]  #: layers, blocks, block size, heads, width (per block: [H, N, C])
    vllm: Tuple[int, int, int, int, int, int]  #: layers, blocks, block size, heads, width, blocks per step
    generation: Tuple[Tuple[str, int, int, int], ...]  #: (model, prompt tokens, new tokens, block size)
    lora: Tuple[str, int, int, int, int, int]  #: model, steps, kill once this step is durable, batch, seq, rank
    transfer_mib: int  #: MiB each transfer timing moves
    flushed_block: Tuple[int, int, int, int, int]  #: a transformers KV block: layers, 2, block size, heads, head dim
    submits: int  #: blocks Flusher.submit is timed on
    kv: Tuple[int, int, int, int] = (32, 8, 128, 16)  #: a model's KV: layers, KV heads, head dim, block (2 MiB)
    load_blocks: int = 2048  #: blocks of ``kv`` the worker loads in the bandwidth check (4 GiB)
    buffers: Tuple[int, int] = (1 << 30, 2 << 30)  #: the bandwidth check's worker: gather and staging bytes
    fused_blocks: int = 1100  #: blocks of one bfloat16 allocation (over 2^31 int8 elements); fp8 twice as many
    #: the decode loop: requests, steps, blocks of the prefill burst, cache blocks
    decode: Tuple[int, int, int, int] = (32, 64, 256, 1024)
    serving_buffers: Optional[Tuple[int, int]] = None  #: the decode loop's worker (None: its defaults)
    step_ms: float = 5.0  #: fixed GPU work per decode step
    dtype: str = "bfloat16"


FULL = Sizes(micro=(3, 16, 16, 8, 128), vllm=(16, 1024, 16, 8, 256, 256),
             generation=(("tiny", 512, 160, 16), ("llama-1b", 4096, 256, 16)),
             lora=("llama-1b", 24, 12, 4, 256, 8), transfer_mib=1024, flushed_block=(16, 2, 16, 8, 128), submits=64)
SMALL = Sizes(micro=(2, 8, 4, 2, 8), vllm=(2, 12, 16, 2, 16, 4), generation=(("tiny", 20, 24, 8),),
              lora=("tiny", 6, 3, 2, 8, 4), transfer_mib=1, flushed_block=(2, 2, 8, 2, 16), submits=8,
              kv=(2, 2, 8, 4), load_blocks=24, buffers=(4 * 4 * 256, 8 * 4 * 256), fused_blocks=12,
              decode=(3, 12, 6, 40), serving_buffers=(4 * 256, 6 * 256))


class CheckFailed(Exception):
    """A part of a check found kvj doing the wrong thing; the message is the reason."""


def expect(ok: bool, reason: str) -> None:
    if not ok:
        raise CheckFailed(reason)


@dataclass
class Result:
    """One check's outcome, as the JSON and the summary report it."""

    name: str
    status: str = "FAIL"
    reason: str = ""
    seconds: float = 0.0
    parts: List[Dict[str, Any]] = field(default_factory=list)
    details: Dict[str, Any] = field(default_factory=dict)


#: The CUDA stand-in, when this process runs under it (--standin).
SIM: Any = None
RID = "gpu-check-0"


def install_standin() -> None:
    """Put the strict CUDA stand-in in place for this whole process (before transformers loads)."""
    global SIM
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import pytest

    from support.fakecuda import FakeCuda
    SIM = FakeCuda(devices=1).install(pytest.MonkeyPatch())  # never undone: the process is the run


def setup_process(standin: bool) -> None:
    """What the worker and its children do first: deterministic cuBLAS (read when CUDA starts),
    the stand-in if asked, stacks dumped on SIGUSR1 (the orchestrator's kill)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if standin:
        install_standin()


@dataclass
class Ctx:
    """What every check runs with: the sizes, the device, the non-default stream the checks run
    under, how many cycles torch.cuda._sleep spins for DELAY_MS, and a scratch directory."""

    sizes: Sizes
    device: Any
    stream: Any
    cycles: int
    tmp: str
    standin: bool

    def delay(self, stream: Any = None, long: bool = False) -> None:
        """A kernel that only takes time (DELAY_MS, or LONG_DELAY_MS), on ``stream`` (default: the
        checks' stream), so that what is enqueued behind it runs late."""
        import torch

        with torch.cuda.stream(stream if stream is not None else self.stream):
            torch.cuda._sleep(int(self.cycles * (LONG_DELAY_MS / DELAY_MS if long else 1)))

    def side(self, purpose: str) -> Any:
        from kvj.segments import device as kd

        return kd.CUDA.side_stream(self.device, purpose)

    @property
    def dtype(self) -> Any:
        import torch

        return getattr(torch, self.sizes.dtype)


def calibrate_sleep(device: Any) -> int:
    """torch.cuda._sleep cycles that last DELAY_MS on this GPU (after a warm-up: clocks ramp)."""
    import torch

    if SIM is not None:
        return 1
    torch.cuda.synchronize(device)
    for _ in range(3):
        torch.cuda._sleep(1_000_000)
        torch.cuda.synchronize(device)
    n = 50_000_000
    t0 = time.perf_counter()
    torch.cuda._sleep(n)
    torch.cuda.synchronize(device)
    return max(1, int(n / (time.perf_counter() - t0) * DELAY_MS / 1e3))


class Parts:
    """The parts of one check: each runs, is checked against the stand-in's rules when it is
    installed, and is recorded PASS or FAIL with its reason; the GPU settles after each."""

    def __init__(self, check: str):
        self.check = check
        self.rows: List[Dict[str, Any]] = []

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        import torch

        t0 = time.perf_counter()
        status, reason = "PASS", ""
        try:
            yield
            standin_verdict()
        except CheckFailed as exc:
            status, reason = "FAIL", str(exc)
        except Exception as exc:  # noqa: BLE001 - any error fails the part, with its reason
            status, reason = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            if SIM is not None:
                SIM.violations.clear()
        row = {"name": name, "status": status, "reason": reason, "seconds": round(time.perf_counter() - t0, 3)}
        self.rows.append(row)
        print(f"  {status:4} {self.check}: {name}{' -- ' + reason if reason else ''}", flush=True)


def standin_verdict() -> None:
    """Under the stand-in: what it found wrong (memory used on another stream and freed without
    record_stream...) fails the part."""
    if SIM is not None:
        gc.collect()
        SIM.check()


def same(a: Any, b: Any) -> bool:
    """Whether two tensors (either side on the device) hold the same shape and bits."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool((a.view(-1).view(_bits_dtype(a)) == b.view(-1).view(_bits_dtype(b))).all())


def _bits_dtype(t: Any) -> Any:
    """An integer dtype of the same width, to compare bits (NaNs included)."""
    import torch

    return torch.uint8 if t.element_size() == 1 else {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def rand(shape: Sequence[int], seed: int, dtype: Any) -> Any:
    """A seeded random CPU tensor."""
    import torch

    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)).to(dtype)


def on_device(ctx: Ctx, cpu: Any) -> Any:
    """``cpu`` on the device, the host having waited for it (a value every stream may read)."""
    import torch

    out = cpu.to(ctx.device)
    torch.cuda.synchronize(ctx.device)
    return out


def pinned(shape: Sequence[int], dtype: Any) -> Any:
    import torch

    return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)


def nhd_layer(ctx: Ctx, blocks: int, block: int, heads: int, width: int) -> Any:
    """One layer of a paged cache in FlashAttention's NHD order, viewed [blocks, heads, block, width]."""
    import torch

    return torch.empty(blocks, block, heads, width, dtype=ctx.dtype, device=ctx.device).permute(0, 2, 1, 3)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / max(seconds, 1e-9) / 1e9, 3)


def median(values: Sequence[float]) -> Optional[float]:
    v = sorted(values)
    return v[len(v) // 2] if v else None


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels (cuBLAS, attention) while a run is compared with another bit for bit."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def model_id(name: str) -> str:
    return f"gpu-check-{name}-seed{SEED}"


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


def kv_layout(ctx: Ctx, name: str, dtype: Optional[str] = None, quant: str = "") -> Any:
    """The block layout of ``ctx.sizes.kv`` (the LHNC order of ``kv_caches``)."""
    from kvj.segments import kvblock

    layers, heads, dim, block = ctx.sizes.kv
    return kvblock.KVBlockLayout(model_id(name), dtype or ctx.sizes.dtype, layers, heads, dim, block, kvblock.LHNC,
                                 quant=quant)


def kv_caches(ctx: Ctx, blocks: int) -> List[Any]:
    """Per-layer caches of ``ctx.sizes.kv`` as vLLM 0.32 allocates them for FlashAttention (NHD
    order, seen [blocks, heads, block, 2 * dim]), filled with random values (the host waited)."""
    import torch

    layers, heads, dim, block = ctx.sizes.kv
    caches = [nhd_layer(ctx, blocks, block, heads, 2 * dim) for _ in range(layers)]
    torch.manual_seed(SEED)
    for c in caches:
        c.normal_()
    torch.cuda.synchronize(ctx.device)
    return caches


def journal_blocks(blocks: int, block: int, seed: str, first: int = 0) -> Tuple[List[int], List[str]]:
    """Tokens of a request of ``blocks`` whole blocks (and one more token), and their chain keys."""
    from kvj.segments import kvblock

    tokens = [(first + 7 * i) % 32000 for i in range(blocks * block + 1)]
    return tokens, kvblock.chain_keys(seed, tokens, block)


def poll_until(worker: Any, vllm_id: str, limit_s: float = 300.0) -> float:
    """Poll ``worker`` (as an engine does, once a step) until ``vllm_id`` is loaded; seconds taken."""
    t0 = time.perf_counter()
    done: set = set()
    while vllm_id not in done:
        expect(time.perf_counter() - t0 < limit_s, f"the load of {vllm_id} was not reported done in {limit_s:.0f} s")
        if SIM is not None:
            SIM.advance()  # the stand-in runs queued work only when asked; a GPU runs it meanwhile
        done.update(worker.poll()[1])
        time.sleep(0.0005)
    return time.perf_counter() - t0
