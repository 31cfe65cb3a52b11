"""kvj in real serving and training loops.

* ``kvj.integrations.hf``: journal a transformers ``DynamicCache`` block by block, restore it.
* ``kvj.integrations.paged``: the same for a vLLM-style paged KV cache (block tables).
* ``kvj.integrations.serving``: a multi-request greedy generation loop over either cache
  whose output after a crash and resume is identical, token for token.
* ``kvj.integrations.training``: AdamW fine-tuning with full checkpoints every K steps and
  XOR deltas in between; a resumed run ends bit-identical to an uninterrupted one.
* ``kvj.integrations.blocks``: the KV block segment convention both caches share.
* ``kvj.integrations.workload``: deterministic models, prompts and data for demos and tests.

``python -m kvj.integrations generate|train`` runs the workloads as processes (the demo
and the end-to-end tests kill and resume them). Modules import transformers only when used.
"""
