"""What differs between the vLLM releases kvj's connector supports, in one place."""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from vllm import __version__ as VLLM_VERSION

from kvj.errors import KvjError

#: The vLLM minor release this connector is written against (pyproject's "vllm" extra pins it).
SUPPORTED_VLLM = (0, 32)


def check_version() -> None:
    major_minor = tuple(int(p) for p in VLLM_VERSION.split(".")[:2] if p.isdigit())
    if major_minor != SUPPORTED_VLLM:
        raise KvjError(f"kvj's vLLM connector supports vLLM {SUPPORTED_VLLM[0]}.{SUPPORTED_VLLM[1]}.x, "
                       f"this is vLLM {VLLM_VERSION}")



def caller_model_runner() -> Any:
    """The vLLM model runner that called ``register_kv_caches`` (its ``initialize_kv_cache``), or None."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if all(hasattr(owner, a) for a in ("requests", "input_batch", "sampler")):
            return owner
        frame = frame.f_back
    return None


def sampler_draw(runner: Any) -> Callable[[torch.Generator], Any]:
    """The draw vLLM 0.32's sampler makes from a seeded request's generator for each token.

    Its CPU sampler draws one ``randint`` per request (its Gumbel noise is seeded from it);
    the others (and the CPU one with fp64 Gumbel noise) fill one row of exponential noise the
    width of the vocabulary, float64 or the probabilities' float32.
    """
    sampler = runner.sampler.topk_topp_sampler
    vocab = runner.model_config.get_vocab_size()
    if getattr(sampler.forward, "__func__", None) is type(sampler).forward_cpu and not sampler.use_fp64_gumbel:
        return lambda g: torch.randint(0, 2 ** 31, (1,), generator=g, dtype=torch.long)
    dtype = torch.float64 if sampler.use_fp64_gumbel else torch.float32
    return lambda g: torch.empty(vocab, dtype=dtype, device=g.device).exponential_(generator=g)
