"""What a vLLM engine's KV blocks are: the model's identity (its weights' digest), the block
layout of each rank, and the journal id of a request (``kvj.segments.kvblock`` is the block)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Dict, List, Tuple

import blake3

from kvj.errors import InvalidName, KvjError
from kvj.fileio import atomic_write, makedirs_durable
from kvj.names import check_request_id
from kvj.segments.kvblock import LHNC, KVBlockLayout
from kvj.segments.tensors import dtype_name
from kvj.untrusted import read_json

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvj.integrations.vllm.config import KvjConfig

#: Weight files whose bytes identify a local model directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: The weights' digests, kept beside the journal.
DIGESTS = "vllm-model-digests.json"
#: The digests cache holds a few hundred bytes per model directory: anything far larger is not one.
MAX_DIGESTS_BYTES = 16 << 20
#: vLLM KV cache dtypes whose bytes a block holds as they are (fp8: vLLM stores them as uint8).
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


def _file_stats(directory: str) -> Dict[str, List[int]]:
    """name -> [size, mtime_ns, inode] of the files whose bytes identify a model directory."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(_WEIGHT_SUFFIXES) or name == "config.json":
            st = os.stat(os.path.join(directory, name))
            out[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def weights_digest(directory: str, journal: str) -> str:
    """BLAKE3 of a model directory's weight files and config, hashed once: the digest is kept in
    the journal's ``vllm-model-digests.json`` keyed by each file's size, mtime and inode, and
    hashed again only when one of them changed. A cache that cannot be read (``read_json``: a
    symlink, FIFO or device, too large, not JSON) is no cache: the digest is hashed and the
    file replaced."""
    directory = os.path.realpath(directory)
    stats = _file_stats(directory)
    cache_path = os.path.join(journal, DIGESTS)
    try:
        cache = read_json(cache_path, max_bytes=MAX_DIGESTS_BYTES)
    except (OSError, KvjError):
        cache = {}
    entry = cache.get(directory) if isinstance(cache, dict) else None
    if isinstance(entry, dict) and entry.get("files") == stats and isinstance(entry.get("digest"), str):
        return entry["digest"]
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in stats:
        h.update(name.encode() + b"\0")
        h.update_mmap(os.path.join(directory, name))
    digest = "blake3:" + h.hexdigest()
    if _file_stats(directory) == stats:  # unchanged while it was hashed
        cache = cache if isinstance(cache, dict) else {}
        cache[directory] = {"files": stats, "digest": digest}
        makedirs_durable(journal)
        atomic_write(cache_path, json.dumps(cache, sort_keys=True, indent=1).encode())
    return digest


def model_identity(vllm_config: "VllmConfig", config: "KvjConfig") -> str:
    """``model_id`` from the extra config; a local model's weights digest; a hub id with its
    resolved revision (the commit its cached snapshot is of)."""
    if config.model_id:
        return config.model_id
    mc = vllm_config.model_config
    if os.path.isdir(mc.model):
        return weights_digest(mc.model, config.journal)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(mc.model, revision=mc.revision, local_files_only=True)
    except Exception as exc:  # huggingface_hub raises many types; all mean "not resolvable here"
        raise KvjError(f"kvj: cannot resolve the revision of model {mc.model!r} ({type(exc).__name__}); "
                       f'name the weights with kv_connector_extra_config["model_id"]') from None
    return f"hf:{mc.model}@{os.path.basename(os.path.normpath(path))}"


def block_layout(vllm_config: "VllmConfig", model: str, tp_rank: int = 0, pp_rank: int = 0) -> KVBlockLayout:
    """The KV block layout of rank (``tp_rank``, ``pp_rank``) of this engine: vLLM's standardized
    per-layer view ``[H, N, 2*D]`` of its heads, of the layers of its pipeline stage."""
    from vllm.distributed.utils import get_pp_indices

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if cc.cache_dtype in FP8:
        dtype, quant = "uint8", cc.cache_dtype
    else:
        dtype, quant = dtype_name(mc.dtype), ""
    layers = mc.get_total_num_hidden_layers()
    stage = get_pp_indices(layers, pp_rank, pc.pipeline_parallel_size)
    return KVBlockLayout(model, dtype, layers, mc.get_total_num_kv_heads(), mc.get_head_size(), cc.block_size, LHNC,
                         pc.tensor_parallel_size, tp_rank, quant, pc.pipeline_parallel_size, pp_rank, tuple(stage))


def worker_ranks(tp_size: int, pp_size: int) -> Tuple[int, int]:
    """This worker's (tensor-parallel rank, pipeline-parallel rank): (0, 0) without parallelism."""
    if tp_size * pp_size == 1:
        return 0, 0
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


def journal_id(vllm_request_id: str, engine: str) -> str:
    """The journal's id for a vLLM request: unique across engine processes (vLLM's ids restart
    at 0 in each), a digest when the id is not a valid kvj id."""
    try:
        return check_request_id(f"{engine}-{vllm_request_id}")
    except InvalidName:
        return f"{engine}-" + blake3.blake3(vllm_request_id.encode()).hexdigest()[:32]
