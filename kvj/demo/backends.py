"""The demo's generation backends: transformers' ``DynamicCache``, and a vLLM-style paged KV
cache with paged-attention decoding over transformers weights.

``HFBackend`` keeps one batch-1 ``DynamicCache`` per request. ``PagedKVCache`` is a pool of
fixed-size blocks per layer, ``[num_blocks, 2, block_size, kv_heads, head_dim]`` like vLLM's,
and a block table per request. ``PagedBackend`` runs a Llama/Qwen2-architecture model (the
weights of a transformers model) over that cache in plain PyTorch: a journaled block is one
block of the pool (all layers), and after a crash the request's blocks are scattered into
whatever block ids the restarted pool hands out, which are not the ones they had before.
Block allocations and frees are journaled too (``alloc``/``free`` records, listed by ``kvj
inspect``). Both are ``GenerationLoop`` backends
(``kvj.demo.generation``); the KV block itself is ``kvj.segments.kvblock``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from kvj.errors import CacheFull, FormatError
from kvj.integrations.hf import build_cache, cache_block, cache_kwarg, layout_for
from kvj.segments import device
from kvj.segments.kvblock import KVBlockLayout, gather_block

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from kvj.journal.journal import Journal
    from kvj.journal.state import JournalState


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


class PagedKVCache:
    """Per-layer block pools and per-request block tables.

    Free blocks are handed out in a seeded random order (``order_seed``), as a long-running
    server's fragmented free list would; two pools with different seeds place the same
    request in different blocks.
    """

    def __init__(self, layout: KVBlockLayout, num_blocks: int, device: Union[str, torch.device] = "cpu", *,
                 order_seed: int = 0, journal: Optional["Journal"] = None):
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        _, _, bs, kvh, hd = layout.shape
        self.pools = [torch.zeros((num_blocks, 2, bs, kvh, hd), dtype=layout.torch_dtype, device=self.device)
                      for _ in range(layout.layers)]
        gen = torch.Generator().manual_seed(order_seed)
        self._free: List[int] = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: Dict[str, List[int]] = {}
        self.journal = journal
        self.block_bytes = layout.layers * 2 * bs * kvh * hd * self.pools[0].element_size()

    def ensure(self, request_id: str, positions: int) -> List[int]:
        """Give the request enough blocks for ``positions``; returns the newly allocated ids."""
        table = self.tables.setdefault(request_id, [])
        need = -(-positions // self.layout.block_size) - len(table)
        if need > len(self._free):
            raise CacheFull(f"paged KV cache full: request {request_id} needs {need} more blocks, "
                              f"{len(self._free)} free of {self.num_blocks}")
        new = [self._free.pop(0) for _ in range(max(need, 0))]
        table.extend(new)
        if self.journal is not None:
            for block in new:
                self.journal.alloc(str(self.device), block * self.block_bytes, self.block_bytes, request_id)
        return new

    def release(self, request_id: str) -> None:
        """Return the request's blocks to the free list."""
        for block in self.tables.pop(request_id, []):
            if self.journal is not None:
                self.journal.free(str(self.device), block * self.block_bytes)
            self._free.append(block)

    def write(self, layer: int, request_id: str, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (``[n, kv_heads, head_dim]``) of positions ``start``... in their slots."""
        bs = self.layout.block_size
        pos = torch.arange(start, start + k.shape[0])
        table = torch.tensor(self.tables[request_id], dtype=torch.long)
        blocks, offsets = table[pos // bs].to(self.device), (pos % bs).to(self.device)
        self.pools[layer][blocks, 0, offsets] = k
        self.pools[layer][blocks, 1, offsets] = v

    def gather(self, layer: int, request_id: str, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, length)``, each ``[length, kv_heads, head_dim]``."""
        _, _, bs, kvh, hd = self.layout.shape
        table = torch.tensor(self.tables[request_id][:-(-length // bs)], dtype=torch.long, device=self.device)
        kv = self.pools[layer][table]  # [blocks, 2, block_size, kv_heads, head_dim]
        return kv[:, 0].reshape(-1, kvh, hd)[:length], kv[:, 1].reshape(-1, kvh, hd)[:length]

    def block(self, request_id: str, index: int) -> torch.Tensor:
        """Block ``index`` of the request across all layers: ``layout.shape``."""
        return gather_block(self.pools, self.tables[request_id][index])

    def forget_previous(self, state: "JournalState") -> Dict[str, List[int]]:
        """Journal frees for the blocks a previous process left allocated on this device (its
        pool died with it); returns their block ids by request, in allocation order."""
        previous: Dict[str, List[int]] = {}
        for addr, alloc in sorted(state.allocations.get(str(self.device), {}).items(), key=lambda kv: kv[1].lsn):
            previous.setdefault(alloc.tag, []).append(addr // self.block_bytes)
            if self.journal is not None:
                self.journal.free(str(self.device), addr)
        return previous

    def restore(self, request_id: str, blocks: List[torch.Tensor]) -> List[int]:
        """Allocate fresh blocks for a resumed request and scatter ``blocks`` into them: block
        ``i`` goes to the ``i``-th new id of every layer's pool (``device.scatter_blocks``: one
        copy onto the device from pinned staging, one indexed copy per layer)."""
        if request_id in self.tables:
            raise FormatError(f"request {request_id} already has blocks in the cache")
        new = self.ensure(request_id, len(blocks) * self.layout.block_size)
        if blocks:
            shape = device.blocks_shape(self.pools, len(blocks))
            host = torch.stack([b.cpu() for b in blocks])
            if device.CUDA.is_device_tensor(self.pools[0]):
                pinned = device.CUDA.pinned(host.numel() * host.element_size()).view(host.dtype).view(shape)
                pinned.copy_(host)
                host = pinned
            moved = device.scatter_blocks(self.pools, new, host, device.block_buffers(self.pools, len(blocks)))
            moved.wait()  # the pinned copy may go only once it is on the device ...
            moved.fence()  # ... and the next forward reads the blocks after the scatter
        return new


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of queries at ``start``... (``q``: [n, heads, d]) over ``k``/``v``
    ([start+n, kv_heads, d]); returns [n, heads*d]."""
    n, heads, hd = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None
    if n > 1:
        mask = (torch.arange(k.shape[0], device=q.device)[None, :]
                <= start + torch.arange(n, device=q.device)[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(n, heads * hd)


class PagedBackend:
    """``GenerationLoop`` backend: paged attention in plain PyTorch over a transformers
    Llama/Qwen2 model's weights (embeddings, norms, projections, rotary embedding, MLP)."""

    def __init__(self, model: "PreTrainedModel", block_size: int = 16, model_id: Optional[str] = None, *,
                 num_blocks: int = 256, order_seed: int = 0, journal: Optional["Journal"] = None):
        self.model = model
        self.layout = layout_for(model, block_size, model_id)
        self.device = model.device
        self.cache = PagedKVCache(self.layout, num_blocks, self.device, order_seed=order_seed, journal=journal)
        self._lengths: Dict[str, int] = {}
        self.restored_tables: Dict[str, List[int]] = {}  #: block ids each resumed request was restored into

    def forward(self, request_id: str, token_ids: Sequence[int], start: int) -> torch.Tensor:
        if self._lengths.get(request_id, 0) != start:
            raise FormatError(f"request {request_id}: cache holds {self._lengths.get(request_id, 0)} positions, "
                              f"forward starts at {start}")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        n, hd, body = len(token_ids), self.layout.head_dim, self.model.model
        end = start + n
        self.cache.ensure(request_id, end)
        h = body.embed_tokens(torch.tensor([list(token_ids)], dtype=torch.long, device=self.device))
        cos, sin = body.rotary_emb(h, torch.arange(start, end, device=self.device)[None])
        for index, layer in enumerate(body.layers):
            attn, x = layer.self_attn, layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, n, -1, hd).transpose(1, 2)
            k = attn.k_proj(x).view(1, n, -1, hd).transpose(1, 2)
            v = attn.v_proj(x).view(1, n, -1, hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.cache.write(index, request_id, start, k[0].transpose(0, 1), v[0].transpose(0, 1))
            keys, values = self.cache.gather(index, request_id, end)
            h = h + attn.o_proj(_attend(q[0].transpose(0, 1), keys, values, start, attn.scaling)[None])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self._lengths[request_id] = end
        return self.model.lm_head(body.norm(h[:, -1:]))[0, -1]

    def block(self, request_id: str, index: int) -> torch.Tensor:
        return self.cache.block(request_id, index)

    def restore(self, request_id: str, blocks: List[torch.Tensor]) -> None:
        self.restored_tables[request_id] = self.cache.restore(request_id, blocks)
        self._lengths[request_id] = len(blocks) * self.layout.block_size

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)
        self._lengths.pop(request_id, None)
