"""kvj in real serving and training loops: ``vllm`` (a KV connector), ``hf`` (transformers
caches) over ``blocks``, ``training`` (checkpoints and XOR deltas: a resumed run ends
bit-identical), ``hf_trainer`` (``Trainer``), ``dcp`` (torch.distributed.checkpoint)."""
