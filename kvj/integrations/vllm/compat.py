"""What differs between the vLLM releases kvj's connector supports (0.32, 0.33, 0.34), in one place.

Releases (``check_version``); model runners (``find_runner``: Model Runner V1 gives a seeded request a
``torch.Generator``, advanced on resume by the draws it had made; V2 keys its noise on the seed and the
token's absolute position, which a resumed request keeps); token ids (0.34 keeps them in an
``array('i')``: ``token_ids``); sleep mode (refused: ``SLEEP_MODE``). docs/vllm.md has the details,
read from each release's source.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from vllm import __version__ as VLLM_VERSION

from kvj.errors import KvjError

#: ``SUPPORTED_VLLM[0] <= (major, minor) < SUPPORTED_VLLM[1]`` (pyproject's "vllm" extra says the same).
SUPPORTED_VLLM: Tuple[Tuple[int, int], Tuple[int, int]] = ((0, 32), (0, 35))

#: ``KvjConnector.supports_sleep_mode`` (0.33 and later ask): no, sleep mode remaps the KV cache under
#: the views of it the worker gathers from.
SLEEP_MODE = False

#: Model runner kinds (:class:`Runner`).
V1, V2, UNKNOWN = "v1", "v2", "unknown"
#: Modules of the runner classes of each kind (any class in a runner's MRO).
_V1_MODULES = ("vllm.v1.worker.gpu_model_runner",)
_V2_MODULES = ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.cpu.standalone_model_runner")


def version_tuple(version: str = VLLM_VERSION) -> Tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``0.32.0+cpu``, ``0.34.0rc1``); (-1, -1) if none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (-1, -1)


def check_version(version: str = VLLM_VERSION) -> None:
    """Refuse, in one line, a vLLM release outside :data:`SUPPORTED_VLLM`."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    if not SUPPORTED_VLLM[0] <= version_tuple(version) < SUPPORTED_VLLM[1]:
        raise KvjError(f"kvj's vLLM connector supports vLLM {lo_major}.{lo_minor} to {hi_major}.{hi_minor - 1}, "
                       f"this is vLLM {version}")


def token_ids(tokens: Optional[Iterable[Any]]) -> List[int]:
    """Token ids as a list of Python ints, whatever vLLM keeps them in (a list, 0.34's ``TokenBuffer``
    ``array('i')``, a slice of either, a numpy array; None, a prompt of embeddings, has none)."""
    if tokens is None:
        return []
    tolist = getattr(tokens, "tolist", None)
    return [int(t) for t in (tolist() if tolist is not None else tokens)]


# ---------------------------------------------------------------------------- model runners


@dataclass
class Runner:
    """The model runner a worker-side connector serves, as far as a resumed seeded request needs it."""

    kind: str  #: V1, V2 or UNKNOWN
    name: str  #: its class (module and name), or what was found instead
    #: request id -> draws to advance its generator by (V1 only)
    _advance: Optional[Callable[[Mapping[str, int]], None]] = None

    @property
    def warning(self) -> Optional[str]:
        """One line saying a seeded resume cannot be made exact here, or None."""
        if self.kind != UNKNOWN:
            return None
        return (f"kvj: vLLM model runner {self.name} not recognised (neither Model Runner V1 nor V2): a resumed "
                "seeded request continues with a generator seeded afresh, so its tokens after the crash may differ")

    def advance(self, draws: Mapping[str, int]) -> None:
        """Bring the samplers of resumed seeded requests (id -> draws made before the crash) to where
        they stopped: V1 advances each one's generator; V2 keys its noise on the absolute position,
        which a resumed request keeps, so there is nothing to do."""
        if self._advance is not None and draws:
            self._advance(draws)


def runner_kind(runner: Any) -> str:
    """V1, V2 or UNKNOWN: by the modules of the classes the runner is made of."""
    modules = {cls.__module__ for cls in type(runner).__mro__}
    if modules.intersection(_V2_MODULES):
        return V2
    if modules.intersection(_V1_MODULES):
        return V1
    return UNKNOWN


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def find_runner(depth: int = 1, frames: int = 8) -> Runner:
    """The model runner among the callers of the function ``depth`` frames up (``register_kv_caches``).

    vLLM offers a connector no handle on its runner, so the callers' frames are searched for one
    (``self`` of ``initialize_kv_cache``; the local ``runner`` of 0.34's ``extend_kv_cache``).
    """
    frame = sys._getframe(depth + 1)
    found: Any = None
    for _ in range(frames):
        if frame is None:
            break
        for name in ("self", "runner"):
            obj = frame.f_locals.get(name)
            if obj is not None and (runner_kind(obj) != UNKNOWN or type(obj).__name__.endswith("ModelRunner")):
                found = obj
                break
        if found is not None:
            break
        frame = frame.f_back
    if found is None:
        caller = sys._getframe(depth + 1).f_code
        return Runner(UNKNOWN, f"(none found: {sys._getframe(depth).f_code.co_name} was called from "
                               f"{caller.co_name} in {caller.co_filename})")
    kind = runner_kind(found)
    if kind == V1:
        try:
            draw = sampler_draw(found)
        except AttributeError:  # a V1 subclass built otherwise
            return Runner(UNKNOWN, _name(found))
        return Runner(V1, _name(found), _v1_advance(found, draw))
    return Runner(kind, _name(found))


def _v1_advance(runner: Any, draw: Callable[[torch.Generator], Any]) -> Callable[[Mapping[str, int]], None]:
    """V1: advance each request's generator (made by vLLM when it was first scheduled) by its draws."""

    def advance(draws: Mapping[str, int]) -> None:
        requests: Dict[str, Any] = runner.requests
        for req_id, n in draws.items():
            generator = getattr(requests.get(req_id), "generator", None)
            for _ in range(n if generator is not None else 0):
                draw(generator)

    return advance


def sampler_draw(runner: Any) -> Callable[[torch.Generator], Any]:
    """The draw Model Runner V1's sampler (0.32, 0.33) makes from a seeded request's generator per token.

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
