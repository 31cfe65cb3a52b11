"""kvj in real serving and training loops.

* ``kvj.integrations.vllm``: a vLLM KV connector journaling every request, token and KV block
  (``worker`` is its worker side, without vLLM; ``resume`` continues the requests in flight
  after ``kvj recover``).
* ``kvj.integrations.hf``: journal a transformers ``DynamicCache`` block by block, restore it.
* ``kvj.integrations.training``: full checkpoints every K steps and XOR deltas in between;
  a resumed run ends bit-identical to an uninterrupted one.
* ``kvj.integrations.blocks``: journaling a request's KV block by block (``hf`` and the demo's
  engines; the block itself is ``kvj.segments.kvblock``'s).

Modules import transformers only when used. The demo's workloads, generation loop and
engines (``HFBackend``, the paged-attention ``PagedBackend``) live in ``kvj.demo``.
"""
