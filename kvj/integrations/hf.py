"""Hugging Face transformers integration: journal a ``DynamicCache`` block by block, restore it.

Two ways in:

* ``CacheJournal``, for your own decode loop: ``start`` a request, call ``observe`` after
  each forward pass (it flushes every block the cache completed, in the background), ``end``
  it; after a crash ``restore`` gives back a ``DynamicCache`` holding the durable prefix and
  the token ids to continue from.
* ``HFBackend``, the ``DynamicCache`` backend of ``kvj.demo.generation.GenerationLoop``,
  which runs several requests with a schedule that makes resumed output bit-identical.

Block tensors are ``[layers, 2, block_size, kv_heads, head_dim]`` (see ``blocks``); a
``DynamicCache`` layer holds ``[batch=1, kv_heads, seq, head_dim]``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kvj.errors import FormatError
from kvj.integrations.blocks import BlockJournal, BlockLayout, ResumePoint

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from kvj.journal.journal import Journal


def layout_for(model: "PreTrainedModel", block_size: int = 16, model_id: Optional[str] = None) -> BlockLayout:
    """The block layout of ``model``'s KV cache. ``model_id`` names the weights (default: the
    config's ``name_or_path``); segments journaled under another name are refused on load."""
    name = model_id or getattr(model.config, "name_or_path", "") or model.config.model_type
    return BlockLayout.from_config(model.config, model=name, block_size=block_size, dtype=model.dtype)


def _layer_kv(cache: "DynamicCache", layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.54
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def cache_block(cache: "DynamicCache", index: int, layout: BlockLayout) -> torch.Tensor:
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
    """Journals ``DynamicCache`` KV as it grows; restores it after a crash.

    Call ``observe(request_id, cache, token_ids)`` after every forward pass, with all token
    ids known so far (the prompt, what was generated, and the token just sampled): each
    block the cache has completed is flushed once, as one segment.
    """

    def __init__(self, journal: "Journal", model: "PreTrainedModel", block_size: int = 16,
                 model_id: Optional[str] = None):
        super().__init__(journal, layout_for(model, block_size, model_id))
        self.config = model.config

    def observe(self, request_id: str, cache: "DynamicCache", token_ids: Sequence[int]) -> int:
        """Flush the blocks ``cache`` completed since the last call; returns how many."""
        bs, b, n = self.layout.block_size, self.next_block(request_id), 0
        length = cache.get_seq_length()
        while (b + 1) * bs <= length and len(token_ids) > (b + 1) * bs:
            self.flush(request_id, b, cache_block(cache, b, self.layout), token_ids[b * bs:(b + 1) * bs + 1])
            b, n = b + 1, n + 1
        return n

    def restore(self, point: ResumePoint, device: Union[str, torch.device] = "cpu"
                ) -> Tuple["DynamicCache", List[int]]:
        """The cache of ``point``'s durable blocks and the token ids known so far.

        The cache holds positions ``[0, point.position)``; feed ``token_ids[point.position:]``
        next. Further blocks of the request are journaled by ``observe`` as usual.
        """
        blocks = self.load(point, device)
        self.adopt(point)
        return build_cache(blocks, self.config), list(point.tokens)


class HFBackend:
    """``GenerationLoop`` backend: one batch-1 ``DynamicCache`` per request."""

    def __init__(self, model: "PreTrainedModel", block_size: int = 16, model_id: Optional[str] = None):
        self.model = model
        self.layout = layout_for(model, block_size, model_id)
        self.device = model.device
        self._kwarg = cache_kwarg(model)
        self.caches: Dict[str, "DynamicCache"] = {}

    def forward(self, request_id: str, token_ids: Sequence[int], start: int) -> torch.Tensor:
        cache = self.caches.get(request_id)
        if cache is None:
            from transformers import DynamicCache
            cache = self.caches[request_id] = DynamicCache(config=self.model.config)
        if cache.get_seq_length() != start:
            raise FormatError(f"request {request_id}: cache holds {cache.get_seq_length()} positions, "
                              f"forward starts at {start}")
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        kwargs: Dict[str, Any] = {self._kwarg: cache}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[0, -1]

    def block(self, request_id: str, index: int) -> torch.Tensor:
        return cache_block(self.caches[request_id], index, self.layout)

    def restore(self, request_id: str, blocks: List[torch.Tensor]) -> None:
        self.caches[request_id] = build_cache(blocks, self.model.config)

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
