"""The environment check: GPU, driver, torch, CUDA, the packages kvj needs; torch.cuda._sleep
holds a stream back (the races of the other checks rely on it)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any, Dict

from gpu import common
from gpu.common import DELAY_MS, Ctx, Parts, expect

REQUIRED = ("numpy", "msgpack", "zstandard", "msgspec", "crc32c", "blake3", "transformers", "peft", "accelerate",
            "safetensors")


def environment_details() -> Dict[str, Any]:
    """What this machine is: GPU, driver, torch, CUDA, Python and the packages kvj needs."""
    from importlib import metadata

    import torch

    info: Dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
                            "standin": common.SIM is not None, "packages": {}}
    for name in ("torch", *REQUIRED):
        try:
            info["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["packages"][name] = None
    if torch.cuda.is_available():
        info["devices"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
    if common.SIM is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
                              "pcie.link.width.current", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"not available ({exc})"
    return info


def check_environment(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    import torch

    info = environment_details()
    info["sleep_cycles_per_ms"] = round(ctx.cycles / DELAY_MS)
    where = "the CUDA stand-in" if ctx.standin else f"{info.get('gpu')}, {info.get('nvidia_smi')}"
    print(f"  {where}; torch {torch.__version__}, CUDA {torch.version.cuda}, Python {info['python']}", flush=True)
    with parts.part("a CUDA device"):
        expect(torch.cuda.device_count() >= 1, "torch sees no CUDA device")
        expect(ctx.standin or torch.version.cuda is not None, "this torch is not built with CUDA")
    with parts.part("the packages kvj needs import"):
        missing = [n for n in REQUIRED if info["packages"][n] is None]
        expect(not missing, f"missing: {', '.join(missing)} (see the docstring for the wheels to carry)")
        import kvj.integrations.hf  # noqa: F401 - what the checks use, and their imports
        import kvj.integrations.hf_trainer  # noqa: F401
        import kvj.ops.recover  # noqa: F401
        import kvj.segments.flusher  # noqa: F401
    with parts.part("torch.cuda._sleep holds a stream back"):
        done = torch.cuda.Event()
        ctx.delay(long=True)
        done.record(ctx.stream)
        expect(not done.query(), "a long _sleep had finished before the host could look")
        done.synchronize()
    return info
