"""kvj in real serving and training loops.

* ``kvj.integrations.hf``: journal a transformers ``DynamicCache`` block by block, restore it.
* ``kvj.integrations.paged``: the same for a vLLM-style paged KV cache (block tables).
* ``kvj.integrations.training``: full checkpoints every K steps and XOR deltas in between;
  a resumed run ends bit-identical to an uninterrupted one.
* ``kvj.integrations.blocks``: the KV block segment convention the caches share.

Modules import transformers only when used. The demo's workloads and generation loop live
in ``kvj.demo``.
"""
