"""A KV block: ``block_size`` token positions of every layer of one rank's KV cache, stored as one segment.

This module owns what a block is (``man/kvj-segment.5``, KV BLOCKS): its layout (model, dtype,
geometry, axis order ``L2NHD`` ``[layers, 2, block, kv_heads, head_dim]`` or vLLM's ``LHNC``
``[layers, kv_heads, block, 2*head_dim]``, and rank), its chained key (``chain[b] =
BLAKE3(chain[b-1] || token ids of block b)`` from the layout's rank-free identity, so a block
loads only where it came from), the check on load (0.1.0's tags too), and kvj's own paged cache
(``[num_blocks, 2, block_size, kv_heads, head_dim]`` per layer): :func:`gather_block` and
:func:`restore_paged`, which scatters block ``i`` into slot ``new_block_ids[i]``.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import blake3
import numpy as np
import torch

from kvj.errors import InvalidArgument, LayoutMismatch
from kvj.segments import device as cuda
from kvj.segments.load import default_staging
from kvj.segments.staging import StagingPool
from kvj.segments.tensors import dtype_name

if TYPE_CHECKING:
    from kvj.segments.store import SegmentStore

#: Layout ``format`` of a KV block segment written now.
FORMAT = "kvj-kv-block/2"
#: Tags of KV block segments written by kvj 0.1.0 (read, never written).
HF_V1, PAGED_V1 = "kvj-kv-block/1", "paged_kv_block"
#: Axis orders of a block.
L2NHD, LHNC = "L2NHD", "LHNC"


@dataclass(frozen=True)
class KVBlockLayout:
    """What a KV block holds: model, element dtype, geometry, axis order and rank.

    ``layers`` and ``kv_heads`` are the whole model's; a tensor-parallel rank holds
    ``kv_heads // tp_size`` heads, a pipeline stage the layers ``stage`` = [first, end).
    """

    model: str
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    order: str = L2NHD
    tp_size: int = 1
    tp_rank: int = 0
    #: what the stored bytes mean when ``dtype`` is only their storage (vLLM keeps fp8 KV as uint8)
    quant: str = ""
    pp_size: int = 1
    pp_rank: int = 0
    stage: Optional[Tuple[int, int]] = None  #: the pipeline stage's layers [first, end); None: all

    def __post_init__(self) -> None:
        if self.order not in (L2NHD, LHNC):
            raise InvalidArgument(f"KV block order must be {L2NHD} or {LHNC}, not {self.order!r}")
        stage = (0, self.layers) if self.stage is None else tuple(int(i) for i in self.stage)
        object.__setattr__(self, "stage", stage)
        if min(self.layers, self.kv_heads, self.head_dim, self.block_size, self.tp_size, self.pp_size) < 1 \
                or self.kv_heads % self.tp_size or not 0 <= self.tp_rank < self.tp_size \
                or not 0 <= self.pp_rank < self.pp_size or len(stage) != 2 or not 0 <= stage[0] < stage[1] <= self.layers:
            raise InvalidArgument(f"bad KV block geometry: {self}")

    @property
    def rank(self) -> int:
        """The rank among the engine's ``world`` (vLLM's order: pipeline stage, then tensor rank)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world(self) -> int:
        """How many ranks hold a shard of each block: tensor- times pipeline-parallel size."""
        return self.tp_size * self.pp_size

    @property
    def stage_layers(self) -> int:
        first, end = self.stage  # type: ignore[misc]
        return end - first

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def shard_heads(self) -> int:
        return self.kv_heads // self.tp_size

    @property
    def block_shape(self) -> Tuple[int, ...]:
        """One layer's block in this layout's order (what ``cache[block_id]`` views)."""
        if self.order == L2NHD:
            return (2, self.block_size, self.shard_heads, self.head_dim)
        return (self.shard_heads, self.block_size, 2 * self.head_dim)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The segment's tensor: every layer of one block (of this rank's pipeline stage)."""
        return (self.stage_layers, *self.block_shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.torch_dtype).element_size()

    def identity(self) -> Dict[str, Any]:
        """The rank-free fields a block must match to load anywhere this layout is served."""
        return {"format": FORMAT, "model": self.model, "dtype": self.dtype, "layers": self.layers,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "block_size": self.block_size,
                "order": self.order, "tp_size": self.tp_size, "pp_size": self.pp_size, "quant": self.quant}

    def seed(self) -> str:
        """The chain seed: BLAKE3 of the identity as canonical JSON (rank-free)."""
        return fingerprint(self.identity())

    def segment_layout(self, token_ids: Optional[Sequence[int]] = None, chain: Optional[str] = None) -> Dict[str, Any]:
        """The layout journaled with one block: identity, rank and stage; its token ids (and the next)
        when known; for a chained block its chain key and seed."""
        out: Dict[str, Any] = {**self.identity(), "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                               "stage": list(self.stage)}  # type: ignore[arg-type]
        if token_ids is not None:
            out["token_ids"] = [int(t) for t in token_ids]
        if chain is not None:
            out.update(chain=chain, seed=self.seed())
        return out

    def check(self, layout: Mapping[str, Any], where: str) -> None:
        """Refuse (``LayoutMismatch``) a block segment of another model, dtype, geometry, order,
        parallel size or rank: a shard of another rank never loads."""
        theirs = parse(layout, where)
        if theirs != self:
            diff = [f"{k}={v!r} (expected {asdict(self)[k]!r})" for k, v in asdict(theirs).items()
                    if asdict(self)[k] != v]
            raise LayoutMismatch(f"{where} belongs to another KV block layout: " + ", ".join(diff))

    def check_caches(self, caches: Sequence[torch.Tensor]) -> None:
        """Refuse caches that are not ``[num_blocks, *block_shape]`` of this dtype, one per layer."""
        if len(caches) != self.stage_layers:
            raise LayoutMismatch(f"{len(caches)} KV cache layers; the block layout has {self.stage_layers}")
        for c in caches:
            if tuple(c.shape[1:]) != self.block_shape or c.dtype != self.torch_dtype:
                raise LayoutMismatch(f"KV cache {tuple(c.shape)} {dtype_name(c.dtype)} is not "
                                     f"[num_blocks, {', '.join(map(str, self.block_shape))}] {self.dtype}")
            if c.shape[0] != caches[0].shape[0] or _where(c) != _where(caches[0]):
                raise LayoutMismatch("KV cache layers differ in number of blocks or device")


def _where(t: torch.Tensor) -> torch.device:
    return cuda.CUDA.device_of(t) if cuda.CUDA.is_device_tensor(t) else t.device


def fingerprint(identity: Mapping[str, Any]) -> str:
    """BLAKE3 of ``identity`` as canonical JSON (sorted keys)."""
    return blake3.blake3(json.dumps(dict(identity), sort_keys=True).encode()).hexdigest()


def chain_keys(seed: str, token_ids: Sequence[int], block_size: int, start: Sequence[str] = ()) -> List[str]:
    """Chained keys of the whole blocks of ``token_ids``; ``start`` (keys of a prefix) is continued."""
    keys = list(start)
    prev = bytes.fromhex(keys[-1] if keys else seed)
    for b in range(len(keys), len(token_ids) // block_size):
        ids = np.asarray(token_ids[b * block_size:(b + 1) * block_size], dtype="<i8")
        prev = blake3.blake3(prev + ids.tobytes()).digest()
        keys.append(prev.hex())
    return keys


def parse(layout: Mapping[str, Any], where: str = "segment") -> KVBlockLayout:
    """The :class:`KVBlockLayout` a journaled KV block segment's layout describes (any tag kvj wrote)."""
    lay = dict(layout or {})
    tag = lay.get("format", lay.get("kind"))
    try:
        if tag == FORMAT:
            return KVBlockLayout(str(lay["model"]), str(lay["dtype"]), int(lay["layers"]), int(lay["kv_heads"]),
                                 int(lay["head_dim"]), int(lay["block_size"]), str(lay["order"]),
                                 int(lay["tp_size"]), int(lay["tp_rank"]), str(lay["quant"]), int(lay["pp_size"]),
                                 int(lay["pp_rank"]), tuple(int(i) for i in lay["stage"]))
        if tag == HF_V1:
            return KVBlockLayout(str(lay["model"]), str(lay["dtype"]), int(lay["layers"]), int(lay["kv_heads"]),
                                 int(lay["head_dim"]), int(lay["block_size"]))
        if tag == PAGED_V1:
            return KVBlockLayout(str(lay["model"]), str(lay["dtype"]), int(lay["num_layers"]),
                                 int(lay["num_kv_heads"]), int(lay["head_dim"]), int(lay["block_size"]))
    except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
        raise LayoutMismatch(f"{where}: malformed KV block layout ({exc})") from None
    raise LayoutMismatch(f"{where} is not a KV block (layout format {tag!r})")


def of_caches(model: str, caches: Sequence[torch.Tensor], order: str = L2NHD) -> KVBlockLayout:
    """The layout of blocks of per-layer caches ``[num_blocks, *block_shape]`` (``order``'s view)."""
    if not caches or caches[0].dim() != (5 if order == L2NHD else 4):
        raise InvalidArgument(f"each cache must be [num_blocks, ...] in {order} order")
    first = caches[0]
    if order == L2NHD:
        _, two, block, heads, head_dim = first.shape
        if two != 2:
            raise InvalidArgument("each cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim]")
    else:
        _, heads, block, width = first.shape
        head_dim = width // 2
    lay = KVBlockLayout(str(model), dtype_name(first.dtype), len(caches), heads, head_dim, block, order)
    lay.check_caches(caches)
    return lay


def paged_layout(model: str, kv_caches: Sequence[torch.Tensor]) -> Dict[str, Any]:
    """The layout every block segment of ``kv_caches`` carries (restore also takes 0.1.0's)."""
    _check_caches(kv_caches)
    return of_caches(model, kv_caches).segment_layout()


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    if not kv_caches:
        raise InvalidArgument("kv_caches is empty")
    first = kv_caches[0]
    if first.dim() != 5 or first.shape[1] != 2:
        raise InvalidArgument("each cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim]")
    for c in kv_caches:
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise InvalidArgument("all layer caches must share shape, dtype and device")
    return first


def gather_block(kv_caches: Sequence[torch.Tensor], block_id: int) -> torch.Tensor:
    """One block of every layer, ``[num_layers, 2, block_size, heads, head_dim]`` (to flush)."""
    _check_caches(kv_caches)
    return torch.stack([c[block_id] for c in kv_caches])


def restore_paged(store: SegmentStore, keys: Sequence[str], kv_caches: Sequence[torch.Tensor],
                  new_block_ids: Sequence[int], *, model: str, workers: Optional[int] = None,
                  staging: Optional[StagingPool] = None) -> None:
    """Scatter a request's block segments into ``kv_caches``: ``keys[i]`` into block ``new_block_ids[i]``.

    Every block's header is checked against the cache's layout, shape and dtype first
    (LayoutMismatch leaves every slot untouched); then the blocks go in chunk by chunk through one
    staging buffer of at most the pool's capacity (pinned for CUDA), decoded in parallel, put in
    by ``device.scatter_blocks``, the host waiting for its event: memory is bounded whatever the
    request's length.
    """
    first = _check_caches(kv_caches)
    if len(keys) != len(new_block_ids):
        raise InvalidArgument("keys and new_block_ids differ in length")
    ids = [int(b) for b in new_block_ids]
    if len(set(ids)) != len(ids) or any(not 0 <= b < first.shape[0] for b in ids):
        raise InvalidArgument("new_block_ids must be distinct slots of the cache")
    if not keys:
        return
    expected = of_caches(model, kv_caches)
    block_shape = (len(kv_caches),) + tuple(first.shape[1:])
    layouts: Dict[str, Optional[Dict[str, Any]]] = {}
    for key in dict.fromkeys(keys):  # headers only: nothing is decoded before every block fits
        info = store.info(key)
        expected.check(info.layout or {}, f"segment {key}")
        if tuple(info.shape) != block_shape or info.dtype != dtype_name(first.dtype):
            raise LayoutMismatch(f"segment {key} holds {info.dtype} {list(info.shape)}, this cache's "
                                 f"blocks are {dtype_name(first.dtype)} {list(block_shape)}")
        layouts[key] = info.layout
    is_cuda = cuda.CUDA.is_device_tensor(first)
    block_bytes = first[0].numel() * first.element_size() * len(kv_caches)
    pool = staging or (default_staging() if is_cuda else StagingPool((block_bytes + 8) * len(keys) + 8))
    per = max(1, min(len(keys), pool.capacity // (block_bytes + 8)))  # blocks a chunk takes, with their ids
    ids_at = -(-per * block_bytes // 8) * 8  # the block ids go up from the same pinned buffer, 8-aligned
    buf = pool.acquire(ids_at + 8 * per, pinned=is_cuda)
    try:
        bufs = cuda.block_buffers(kv_caches, per, buf[ids_at:ids_at + 8 * per].view(torch.long))
        slot = [buf[i * block_bytes:(i + 1) * block_bytes] for i in range(per)]
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as ex:
            for at in range(0, len(keys), per):
                chunk = keys[at:at + per]
                _decode_chunk(store, chunk, slot, layouts, block_shape, first.dtype, ex)
                host = buf[:len(chunk) * block_bytes].view(first.dtype).view((len(chunk),) + block_shape)
                moved = cuda.scatter_blocks(kv_caches, ids[at:at + per], host, bufs)
                moved.wait()  # the staging buffer is reused once the copy from it is done (and, the host
                # having waited, the caller's later work on any stream comes after the scatter)
    finally:
        pool.release(buf)  # scatter_blocks raises only once nothing reads the buffer


def _decode_chunk(store: SegmentStore, keys: Sequence[str], slot: Sequence[torch.Tensor],
                  layouts: Mapping[str, Optional[Dict[str, Any]]], block_shape: Tuple[int, ...],
                  dtype: torch.dtype, ex: ThreadPoolExecutor) -> None:
    """Decode ``keys[i]`` into ``slot[i]`` in parallel; a key that recurs (a shared prefix
    block) is decoded once and its bytes copied."""
    first_of: Dict[str, int] = {}
    for i, key in enumerate(keys):
        first_of.setdefault(key, i)

    def one(i: int) -> None:
        try:
            block = store.get(keys[i], expect_layout=layouts[keys[i]], out=slot[i])
        except InvalidArgument:
            raise LayoutMismatch(f"segment {keys[i]} holds more than one block of this cache") from None
        if tuple(block.shape) != block_shape or block.dtype != dtype:
            raise LayoutMismatch(f"segment {keys[i]} holds {block.dtype} {list(block.shape)}, this cache's "
                                 f"blocks are {dtype} {list(block_shape)}")

    list(ex.map(one, first_of.values()))
    for i, key in enumerate(keys):
        if first_of[key] != i:
            np.copyto(slot[i].numpy(), slot[first_of[key]].numpy())
