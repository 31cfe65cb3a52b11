"""Deterministic workloads for the end-to-end runs: small models, prompts and training data.

Everything here is a pure function of a seed, so a process killed mid-run and the process
that resumes it (or an uninterrupted reference run) see the same model, the same prompts
and the same batches. Models are real transformers architectures (Llama, Qwen2) built
from a config and randomly initialised: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Dict, List, Tuple

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

#: Model sizes: (vocab, hidden, intermediate, layers, heads, kv heads).
SIZES: Dict[str, Tuple[int, int, int, int, int, int]] = {
    "tiny": (512, 64, 128, 2, 4, 2),
    "small": (1024, 128, 256, 4, 4, 2),
    "demo": (2048, 512, 1024, 8, 8, 2),
}


@dataclass(frozen=True)
class ModelSpec:
    """Which model to build: architecture, size and the seed of its random initialisation."""

    arch: str = "llama"
    size: str = "tiny"
    seed: int = 0
    dtype: str = "float32"

    @property
    def model_id(self) -> str:
        """A name that changes whenever the weights would: recorded in every segment's layout."""
        identity = {**asdict(self), "dims": SIZES[self.size]}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
        return f"kvj-{self.arch}-{self.size}-seed{self.seed}-{digest}"

    def argv(self) -> List[str]:
        """Arguments of ``python -m kvj.demo.worker`` that build this model."""
        return ["--arch", self.arch, "--size", self.size, "--seed", str(self.seed), "--dtype", self.dtype]

    def config(self) -> "PretrainedConfig":
        """The architecture's config at this size (transformers is imported only here)."""
        vocab, hidden, inter, layers, heads, kv_heads = SIZES[self.size]
        kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=False)
        if self.arch == "llama":
            from transformers import LlamaConfig
            return LlamaConfig(**kwargs)
        if self.arch == "qwen2":
            from transformers import Qwen2Config
            return Qwen2Config(**kwargs)
        raise ValueError(f"unknown architecture {self.arch!r}: use llama or qwen2")

    def build(self, device: str = "cpu") -> "PreTrainedModel":
        """The model, identically initialised on every call (the global RNG is left as it was)."""
        from transformers import AutoModelForCausalLM
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = AutoModelForCausalLM.from_config(self.config(), attn_implementation="sdpa")
        return model.to(device=device, dtype=getattr(torch, self.dtype)).eval()


def prompts(count: int, *, seed: int = 1, vocab: int = 512, shared_prefix: int = 32,
            lengths: Tuple[int, int] = (20, 60)) -> Dict[str, List[int]]:
    """``count`` prompts, ids ``req-0``... Each starts with the same ``shared_prefix`` tokens
    (a system prompt, as in real serving) followed by a request-specific part."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (shared_prefix,), generator=gen).tolist()
    out: Dict[str, List[int]] = {}
    for i in range(count):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        out[f"req-{i}"] = system + torch.randint(0, vocab, (n,), generator=gen).tolist()
    return out


def training_batch(step: int, *, seed: int, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """The token batch for ``step``: a function of (seed, step) only, so a resumed run sees
    exactly the batches the interrupted one would have seen, without saving any RNG state.

    Sequences follow a simple learnable pattern (a per-sequence arithmetic progression
    modulo the vocabulary) so the loss visibly falls during the demo's fine-tuning.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab


@dataclass(frozen=True)
class GenerationWorkload:
    """Several requests sharing a system prompt, arriving a few loop steps apart, each
    generating a different number of tokens (so at any moment some have ended, some are
    mid-prompt and some are decoding)."""

    model: ModelSpec = ModelSpec()
    requests: int = 4
    block_size: int = 16
    max_new_tokens: int = 40  #: for the first request; each later one generates 8 more
    stagger: int = 4  #: loop steps between arrivals
    prompt_seed: int = 1
    shared_prefix: int = 32

    def argv(self) -> List[str]:
        """Arguments of ``python -m kvj.demo.worker generate`` that run this workload."""
        return self.model.argv() + ["--requests", str(self.requests), "--block-size", str(self.block_size),
                                    "--max-new", str(self.max_new_tokens), "--stagger", str(self.stagger),
                                    "--prompt-seed", str(self.prompt_seed), "--shared-prefix", str(self.shared_prefix)]

    def items(self) -> List[Tuple[str, List[int], int, int]]:
        """(request id, prompt, max_new_tokens, arrival step) of every request."""
        vocab = SIZES[self.model.size][0]
        ps = prompts(self.requests, seed=self.prompt_seed, vocab=vocab, shared_prefix=self.shared_prefix)
        return [(rid, p, self.max_new_tokens + 8 * i, i * self.stagger) for i, (rid, p) in enumerate(ps.items())]
