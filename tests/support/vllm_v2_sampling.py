"""Model Runner V2's seeded sampling, run on the CPU by Triton's interpreter, for a request
uninterrupted and for the same request resumed the way ``kvj.integrations.vllm.resuming`` resumes
it (its prompt followed by the tokens it had generated, the KV of its first block loaded by the
connector, in another batch slot beside another request).

A script (``TRITON_INTERPRET=1`` must be set before Triton is imported): it drives vLLM's own V2
kernels of whichever vLLM is first on ``sys.path`` as its model runner does (``prepare_pos_seq_lens``
for the positions, ``combine_sampled_and_draft_tokens`` for the input ids and the logits
indices, ``gumbel_sample`` with the request's seed and ``positions[logits_indices]``) over a toy
model whose logits depend on the last token only, and prints one JSON object: the tokens of both
runs, the tokens greedy decoding and another seed give, and the line of V2's sampler that says
which positions it samples with.

    TRITON_INTERPRET=1 python tests/support/vllm_v2_sampling.py SEED
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from typing import Any, Dict, List

VOCAB, PROMPT, NEW, CRASH_AFTER, BLOCK = 300, 45, 16, 6, 32


def _kernels() -> types.SimpleNamespace:
    """V2's kernels, compiled by Triton's interpreter (vLLM itself turns Triton off without a GPU)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Triton is imported"
    import triton
    import triton.language as tl

    stub = types.ModuleType("vllm.triton_utils")
    stub.triton, stub.tl, stub.HAS_TRITON = triton, tl, True  # type: ignore[attr-defined]
    sys.modules["vllm.triton_utils"] = stub
    from vllm.v1.worker.gpu.input_batch import combine_sampled_and_draft_tokens, prepare_pos_seq_lens
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    return types.SimpleNamespace(combine=combine_sampled_and_draft_tokens, positions=prepare_pos_seq_lens,
                                 sample=gumbel_sample)


def generate(k: types.SimpleNamespace, table: Any, requests: Dict[int, Dict], steps: int) -> Dict[int, List[int]]:
    """Run ``steps`` steps of a batch: ``requests`` maps a batch slot (vLLM's request state index)
    to its ``prompt``, ``computed`` (tokens whose KV is in the cache already), ``seed`` and
    ``temperature``; each step prefills what is left of a prompt or decodes one token."""
    import torch

    slots = max(requests) + 1
    computed = torch.zeros(slots, dtype=torch.int32)
    prefill_len = torch.zeros(slots, dtype=torch.int32)
    last = torch.zeros(slots, dtype=torch.int64)
    seeds = torch.zeros(slots, dtype=torch.int64)
    temps = torch.zeros(slots, dtype=torch.float32)
    for slot, r in requests.items():
        computed[slot], prefill_len[slot] = r["computed"], len(r["prompt"])
        seeds[slot], temps[slot] = r["seed"], r["temperature"]
    out: Dict[int, List[int]] = {slot: [] for slot in requests}
    order = sorted(requests)
    for _ in range(steps):
        query = [int(prefill_len[s] - computed[s]) if computed[s] < prefill_len[s] else 1 for s in order]
        starts = [0]
        for q in query:
            starts.append(starts[-1] + q)
        input_ids = torch.zeros(starts[-1], dtype=torch.int64)
        for i, s in enumerate(order):  # the prefill tokens (vLLM's prepare_prefill_inputs)
            if computed[s] < prefill_len[s]:
                input_ids[starts[i]:starts[i + 1]] = torch.tensor(requests[s]["prompt"][int(computed[s]):])
        idx = torch.tensor(order, dtype=torch.int32)
        qsl = torch.tensor(starts, dtype=torch.int32)
        pos = torch.zeros(starts[-1], dtype=torch.int64)
        seq_lens = torch.zeros(len(order), dtype=torch.int32)
        k.positions(idx, qsl, computed, pos, seq_lens)
        cu_logits = torch.arange(len(order) + 1, dtype=torch.int32)
        logits_indices = k.combine(input_ids, idx, last, qsl, seq_lens, prefill_len,
                                   torch.zeros(slots, 0, dtype=torch.int64), cu_logits, len(order))
        logits = table[input_ids[logits_indices]]
        sampled = k.sample(logits, idx, temps, seeds, pos[logits_indices], apply_temperature=True,
                           is_drafting=False)
        for i, s in enumerate(order):
            computed[s] += query[i]
            last[s] = sampled[i]
            out[s].append(int(sampled[i]))
    return out


def main(seed: int) -> Dict:
    import torch

    k = _kernels()
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(VOCAB, VOCAB, generator=g) * 2.0  # next-token logits of each last token
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist()
    other = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    req = {"prompt": prompt, "computed": 0, "seed": 1234, "temperature": 1.0}
    whole = generate(k, table, {0: req, 1: {"prompt": other, "computed": 0, "seed": 99, "temperature": 0.8}},
                     NEW)[0]
    # Resumed after CRASH_AFTER tokens: prompt + those tokens, its first block loaded (computed),
    # in another slot, beside another request; nothing done to its sampler.
    resumed = {"prompt": prompt + whole[:CRASH_AFTER], "computed": BLOCK, "seed": 1234, "temperature": 1.0}
    after = generate(k, table, {0: {"prompt": other[:7], "computed": 0, "seed": 5, "temperature": 1.0}, 3: resumed},
                     NEW - CRASH_AFTER)[3]
    greedy = generate(k, table, {0: {**req, "temperature": 0.0}}, NEW)[0]
    reseeded = generate(k, table, {0: {**req, "seed": 4321}}, NEW)[0]
    source = importlib.util.find_spec("vllm.v1.worker.gpu.sample.sampler").origin
    with open(source) as f:
        pos_line = next((line.strip() for line in f if line.strip().startswith("pos = ")), "")
    return {"whole": whole, "resumed": whole[:CRASH_AFTER] + after, "greedy": greedy, "reseeded": reseeded,
            "sampler_pos": pos_line}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
