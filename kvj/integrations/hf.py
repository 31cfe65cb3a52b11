"""Hugging Face transformers: journal a ``DynamicCache`` block by block, restore it.

In your decode loop: ``start`` a request, ``observe`` after each forward pass (it flushes each
block the cache completed), ``end`` it; after a crash ``restore`` gives back a ``DynamicCache``
of the durable prefix and the token ids to continue from. A block is ``[layers, 2,
block_size, kv_heads, head_dim]`` (order L2NHD); a cache layer ``[1, kv_heads, seq, head_dim]``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import torch

from kvj.errors import FormatError
from kvj.integrations.blocks import BlockJournal, ResumePoint
from kvj.segments.kvblock import KVBlockLayout

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from kvj.journal.journal import Journal


def layout_for(model: "PreTrainedModel", block_size: int = 16, model_id: Optional[str] = None) -> KVBlockLayout:
    """The block layout of ``model``'s KV cache; ``model_id`` names the weights (default: the
    config's ``name_or_path``), and segments of another name are refused on load."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVBlockLayout(model_id or getattr(config, "name_or_path", "") or config.model_type,
                         str(model.dtype).replace("torch.", ""), config.num_hidden_layers, kv_heads, head_dim, block_size)


def _layer_kv(cache: "DynamicCache", layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.54
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def cache_block(cache: "DynamicCache", index: int, layout: KVBlockLayout) -> torch.Tensor:
    """Block ``index`` of a batch-1 ``DynamicCache`` as one ``layout.shape`` tensor."""
    a, b = index * layout.block_size, (index + 1) * layout.block_size
    per_layer = []
    for layer in range(layout.layers):
        k, v = _layer_kv(cache, layer)
        if k.shape[0] != 1 or k.shape[2] < b:
            raise FormatError(f"cache holds {k.shape[2]} positions of batch {k.shape[0]}; "
                              f"block {index} needs positions up to {b} of batch 1")
        per_layer.append(torch.stack((k[0, :, a:b].transpose(0, 1), v[0, :, a:b].transpose(0, 1))))
    return torch.stack(per_layer)


def build_cache(blocks: List[torch.Tensor], config: Any) -> "DynamicCache":
    """A batch-1 ``DynamicCache`` holding ``blocks`` (consecutive blocks from position 0)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    if blocks:
        kv = torch.cat(blocks, dim=2)  # [layers, 2, positions, kv_heads, head_dim]
        for layer in range(kv.shape[0]):
            cache.update(kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous(),
                         kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous(), layer)
    return cache


def cache_kwarg(model: "PreTrainedModel") -> str:
    """The forward argument that takes the cache: ``cache`` (transformers 5) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class CacheJournal(BlockJournal):
    """Journals ``DynamicCache`` KV as it grows; restores it after a crash."""

    def __init__(self, journal: "Journal", model: "PreTrainedModel", block_size: int = 16,
                 model_id: Optional[str] = None):
        super().__init__(journal, layout_for(model, block_size, model_id))
        self.config = model.config

    def observe(self, request_id: str, cache: "DynamicCache", token_ids: Sequence[int]) -> int:
        """Flush the blocks ``cache`` completed since the last call; returns how many.
        ``token_ids``: every id known so far (the prompt, the generated, the one just sampled)."""
        bs, b, n = self.layout.block_size, self.next_block(request_id), 0
        length = cache.get_seq_length()
        while (b + 1) * bs <= length and len(token_ids) > (b + 1) * bs:
            self.flush(request_id, b, cache_block(cache, b, self.layout), token_ids[b * bs:(b + 1) * bs + 1])
            b, n = b + 1, n + 1
        return n

    def restore(self, point: ResumePoint, device: Union[str, torch.device] = "cpu"
                ) -> Tuple["DynamicCache", List[int]]:
        """The cache of ``point``'s durable blocks (positions ``[0, point.position)``) and the
        token ids known so far: feed ``token_ids[point.position:]`` next."""
        blocks = self.load(point, device)
        self.adopt(point)
        return build_cache(blocks, self.config), list(point.tokens)
