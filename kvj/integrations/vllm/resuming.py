"""Resume the requests a vLLM engine had in flight, from a ``kvj recover`` (or handoff) manifest.

Each continues as its prompt plus every durable generated token, with the rest of its budget; the
connector loads its durable blocks and a seeded sampler continues where it stopped (``compat``), so
the tokens equal an uninterrupted run's. This module imports vLLM only inside ``resume``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Union

from kvj.errors import FormatError
from kvj.journal.recovery import MAX_MANIFEST_BYTES
from kvj.untrusted import read_json

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput

#: Start-record meta tag of requests journaled by the connector.
START_FORMAT = "kvj-vllm-request/1"
#: Sampling settings journaled with each request and restored by :func:`resume`.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "stop_token_ids", "ignore_eos",
            "detokenize")
#: ``kv_transfer_params`` keys in which the connector reports, per request, the tokens whose KV it
#: loaded, and those vLLM's own prefix cache held when it was scheduled (block-aligned).
RESTORED, REUSED = "kvj_restored_tokens", "kvj_reused_tokens"

Manifest = Union[str, "os.PathLike[str]", Mapping[str, Any]]


@dataclass
class ResumePlan:
    """How one request that was in flight continues: its known tokens and its remaining budget."""

    request_id: str  #: the journal's id of the request that was in flight
    prompt: List[int]  #: the original prompt
    generated: List[int]  #: tokens it had generated that are durable
    max_tokens: int  #: its original budget
    durable_tokens: int  #: tokens covered by its verified blocks (the recover manifest's resume position)
    sampling: Dict[str, Any]
    stop_ids: List[int]
    #: earlier incarnations still in flight that this one carries (killed while being resumed):
    #: the resumed request's END ends them too, so none is left in flight for a later recover
    superseded: List[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """It had produced its last token (its budget, or a stop token) before the crash."""
        return len(self.generated) >= self.max_tokens or any(t in self.stop_ids for t in self.generated)

    @property
    def draws(self) -> int:
        """Draws its sampler made: one per generated token (speculative decoding, which draws
        otherwise, is refused by the connector)."""
        return len(self.generated)


@dataclass
class Resumed:
    """A resumed request's whole output: the tokens before the crash and those generated now."""

    plan: ResumePlan
    token_ids: List[int]  #: every generated token, as an uninterrupted run would have returned them
    output: Optional["RequestOutput"]  #: vLLM's output for the resubmitted part (None if complete)

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def restored_tokens(self) -> int:
        """Tokens of the resubmitted prompt whose KV the connector loaded (and verified)."""
        params = (self.output.kv_transfer_params or {}) if self.output is not None else {}
        return int(params.get(RESTORED, 0))

    @property
    def reused_tokens(self) -> int:
        """Tokens of the resubmitted prompt vLLM's own prefix cache already held (say, blocks
        another resumed request had loaded)."""
        params = (self.output.kv_transfer_params or {}) if self.output is not None else {}
        return int(params.get(REUSED, 0))

    @property
    def recomputed_tokens(self) -> int:
        """Tokens of the resubmitted prompt that vLLM computed again."""
        if self.output is None:
            return 0
        return len(self.output.prompt_token_ids or []) - self.restored_tokens - self.reused_tokens


def _load_manifest(manifest: Manifest) -> Mapping[str, Any]:
    """The manifest given, or the one in the file it names (read by ``read_json``: bounded, never a FIFO)."""
    if isinstance(manifest, Mapping):
        return manifest
    doc = read_json(manifest, max_bytes=MAX_MANIFEST_BYTES)
    if not isinstance(doc, dict):
        raise FormatError(f"{os.fspath(manifest)} is not a kvj recover manifest")
    return doc


def resume_plans(manifest: Manifest) -> List[ResumePlan]:
    """The requests of a ``kvj recover`` manifest that the connector journaled, in start order.

    A request that a later resume already took over (it is in flight too, its start record
    naming the first) is left out: the later one carries all its tokens.
    """
    reqs = [r for r in _load_manifest(manifest)["requests"] if (r.get("meta") or {}).get("format") == START_FORMAT]
    by_id = {r["id"]: r for r in reqs}
    superseded = {rid for r in reqs for rid in _resumed_ids(r["meta"])}
    plans = []
    for r in sorted(reqs, key=lambda r: r["start_lsn"]):
        if r["id"] in superseded:
            continue
        chain, earlier = [], _resumed_ids(r["meta"])
        while earlier:  # the in-flight incarnations this one took over, newest first
            rid = earlier[0]
            if rid not in by_id or rid in chain:
                break
            chain.append(rid)
            earlier = _resumed_ids(by_id[rid]["meta"])
        meta = r["meta"]
        known = [int(t) for t in r.get("tokens") or []] + [int(t) for t in r.get("output") or []]
        for seg in sorted(r["segments"], key=lambda s: s["tokens"][0]):
            start, ids = seg["tokens"][0], [int(t) for t in seg["layout"]["token_ids"]]
            overlap = known[start:start + len(ids)]
            if ids[:len(overlap)] != overlap:
                raise FormatError(f"request {r['id']}: segment {seg['seg']} does not continue its tokens")
            known[start:start + len(ids)] = ids
        prompt_len = int(meta["prompt_len"])
        plans.append(ResumePlan(r["id"], known[:prompt_len], known[prompt_len:], int(meta["max_tokens"]),
                                int(r["resume_position"]), dict(meta.get("sampling") or {}),
                                [int(t) for t in meta.get("stop_ids") or []], chain))
    return plans


def _resumed_ids(meta: Mapping[str, Any]) -> List[str]:
    """The ids a request's START says it resumes (its ``resumes`` meta: ids joined by commas)."""
    return [rid for rid in str(meta.get("resumes") or "").split(",") if rid]


def resume(llm: "LLM", manifest: Manifest, *, use_tqdm: bool = False) -> List[Resumed]:
    """Resubmit every request that was in flight (``kvj recover``'s manifest), or was handed off
    to this engine (a handoff manifest: ``kvj.integrations.vllm.handoff``), and finish it.

    Each continues as its prompt plus its durable generated tokens, with the rest of its
    token budget; ``llm``'s KvjConnector loads the durable blocks and vLLM computes only what
    follows the last one. The returned ``token_ids`` equal an uninterrupted run's, under
    greedy decoding and under seeded sampling (``kvj.integrations.vllm.compat``, model runners).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    manifest = _load_manifest(manifest)
    plans = resume_plans(manifest)
    origin = manifest.get("handoff")  # handed off by another engine: its journal, where its ids live
    prompts, params = [], []
    for plan in plans:
        budget = plan.max_tokens - len(plan.generated)
        sampling = {k: v for k, v in plan.sampling.items() if k in SAMPLING and v is not None}
        extra = {"kvj_resumes": ",".join([plan.request_id, *plan.superseded]), "kvj_prompt_len": len(plan.prompt),
                 "kvj_max_tokens": plan.max_tokens, "kvj_draws": plan.draws,
                 **({"kvj_from": origin["from"]} if origin else {})}
        # A request already complete is still submitted, for one token, so that its
        # connector ends it in the journal; that token is not part of its output.
        params.append(SamplingParams(**{**sampling, "max_tokens": max(1, budget) if not plan.complete else 1,
                                        "extra_args": extra}))
        prompts.append(TokensPrompt(prompt_token_ids=plan.prompt + plan.generated))
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm) if prompts else []
    results = []
    for plan, out in zip(plans, outputs):
        new = [] if plan.complete else list(out.outputs[0].token_ids)
        results.append(Resumed(plan, plan.generated + new, None if plan.complete else out))
    return results
