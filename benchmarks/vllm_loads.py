"""The vLLM connector's loads, side by side (part of ``kvj bench vllm``; needs no vLLM):

* **per block**: a prompt's KV blocks, each its own segment, loaded by the connector's worker
  (``WorkerJournal.start_loads`` and ``poll``, as vLLM calls them: chunks through bounded
  staging, read, checked and decoded on its loader threads, copied into the cache), against
  **whole**: the same bytes as one segment, loaded by the store in one call (goal: per block
  at least 0.8x of whole);
* against the **floor** of the per-block load: every block segment read, its chunks CRC-checked
  and decompressed, nothing else (no digest, no layout check, no copy into a cache), on as many
  threads as the worker's loader has.

Blocks shaped like a Llama-3-8B's (32 layers, 8 KV heads, head 128, block 16: 2 MiB in
bfloat16), values from a normal distribution, codec ``auto``; each figure the median of
``rounds``, after one round not counted (warm buffers and page cache); each ratio the median
of the rounds' own ratios (the three are measured back to back in each round, so a
neighbour's load on a shared machine falls on all alike). The ratios are the result;
absolute GB/s depend on this machine.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import numpy as np
import torch

import kvj
from kvj.integrations.vllm.durable import durable_blocks
from kvj.integrations.vllm.plan import Load, Save, Start, StepPlan
from kvj.integrations.vllm.worker import WorkerJournal
from kvj.journal.config import default_store_path
from kvj.segments import kvblock, segfile
from kvj.segments.chunks import ChunkDecoder
from kvj.segments.kvblock import LHNC, KVBlockLayout
from kvj.segments.store import SegmentStore

LAYOUT = KVBlockLayout("bench-8b", "bfloat16", 32, 8, 128, 16, LHNC)
#: Seconds between polls: an engine polls once a step.
POLL = 0.001


def run(directory: Optional[str] = None, blocks: int = 64, rounds: int = 5, layout: KVBlockLayout = LAYOUT,
        threads: Optional[int] = None) -> Dict[str, Any]:
    """Per-block load, whole load and floor of ``blocks`` blocks, in GB/s (medians of ``rounds``)."""
    work = tempfile.mkdtemp(prefix="kvj-bench-loads-", dir=directory)
    try:
        return _measure(work, blocks, rounds, layout, threads or min(8, os.cpu_count() or 1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _caches(layout: KVBlockLayout, blocks: int, seed: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((blocks, *layout.block_shape), generator=gen).to(layout.torch_dtype)
            for _ in range(layout.layers)]


def _measure(work: str, n: int, rounds: int, layout: KVBlockLayout, threads: int) -> Dict[str, Any]:
    journal = os.path.join(work, "journal")
    src = _caches(layout, n, 0)
    tokens = [(7 * t) % 32000 for t in range(n * layout.block_size + 1)]
    bs = layout.block_size
    chains = kvblock.chain_keys(layout.seed(), tokens, bs)
    saver = WorkerJournal(journal, layout, load_threads=threads)
    saver.register(src)
    saver.step(StepPlan(starts=[Start("r0", "e-r0", tokens, {})],
                        saves=[Save("e-r0", b, b, chains[b], tokens[b * bs:(b + 1) * bs + 1]) for b in range(n)]))
    saver.close()
    keys = [entry["key"] for entry in durable_blocks(kvj.replay(journal), layout.seed()).values()]
    nbytes = n * layout.nbytes
    whole_store = SegmentStore(os.path.join(work, "whole"), threads=threads)
    whole_key = whole_store.put(torch.stack([torch.stack([c[b] for c in src]) for b in range(n)]), codec="auto").key
    out = torch.empty(nbytes, dtype=torch.uint8)
    store = SegmentStore(default_store_path(journal), threads=threads)
    dst = [torch.zeros((n, *layout.block_shape), dtype=layout.torch_dtype) for _ in range(layout.layers)]
    loader = WorkerJournal(journal, layout, load_threads=threads)  # a restarted engine's worker
    times: Dict[str, List[float]] = {"per_block": [], "whole": [], "floor": []}
    try:
        loader.register(dst)
        for r in range(rounds + 1):  # the first round warms buffers and the page cache: not counted
            took = {"per_block": _per_block(loader, chains, f"r{r}")}
            t0 = time.perf_counter()
            whole_store.get(whole_key, out=out)
            took["whole"] = time.perf_counter() - t0
            took["floor"] = _floor(store, keys, threads)
            for name, seconds in took.items():
                if r:
                    times[name].append(seconds)
    finally:
        loader.close()
        whole_store.close()
        store.close()
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    with SegmentStore(os.path.join(work, "whole")) as whole:
        info = whole.info(whole_key)
    paired = lambda other: statistics.median(o / p for p, o in zip(times["per_block"], times[other]))  # noqa: E731
    return {"blocks": n, "block_bytes": layout.nbytes, "bytes": nbytes, "threads": threads, "rounds": rounds,
            "ratio_stored": info.stored_size / max(1, info.raw_size), "gbps": gbps,
            "per_block_vs_whole": paired("whole"), "per_block_vs_floor": paired("floor")}


def _per_block(worker: WorkerJournal, chains: List[str], vllm_id: str) -> float:
    """Seconds for ``worker`` to load every block (into other slots of its cache), polled as an
    engine polls, once a step."""
    n = len(chains)
    t0 = time.perf_counter()
    worker.start_loads(StepPlan(loads=[Load(vllm_id, [(n - 1 - b, chains[b]) for b in range(n)])]))
    while vllm_id not in worker.poll()[1]:
        time.sleep(POLL)
    seconds = time.perf_counter() - t0
    if worker.load_errors():
        raise RuntimeError("kvj bench vllm: a block failed to load")
    return seconds


def _floor(store: SegmentStore, keys: List[str], threads: int) -> float:
    """Seconds to read every block segment, check its chunks' CRCs and decompress them, on
    ``threads`` threads, a block a task (each chunk decoded into a scratch buffer)."""
    def one(key: str) -> None:
        source = segfile.as_source(store.read_stored(key), key)
        header = segfile.read_header(source)
        chunks = ChunkDecoder(source, header, segfile.PREAMBLE.size, segfile.element(header.dtype).word)
        scratch = memoryview(np.empty(chunks.header.chunk_size, np.uint8)).cast("B")
        for job in chunks.jobs:
            chunks.decode(job, scratch[:job.raw_len])

    with ThreadPoolExecutor(max_workers=threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, keys))
        return time.perf_counter() - t0


def format_lines(result: Dict[str, Any]) -> List[str]:
    """The lines ``kvj bench vllm`` prints for the loads."""
    g = result["gbps"]
    return [f"loads of {result['blocks']} KV blocks of {result['block_bytes'] / (1 << 20):.1f} MiB "
            f"({result['bytes'] / (1 << 20):.0f} MiB, stored {result['ratio_stored']:.2f}x), codec auto, "
            f"{result['threads']} loader threads, median of {result['rounds']}:",
            f"  per block (the connector's load, into the cache)        {g['per_block']:6.2f} GB/s",
            f"  whole (the same bytes as one segment, one store load)   {g['whole']:6.2f} GB/s   "
            f"per block / whole {result['per_block_vs_whole']:.2f}x (goal >= 0.8x)",
            f"  floor (read + CRC + decompress, the same threads)       {g['floor']:6.2f} GB/s   "
            f"per block / floor {result['per_block_vs_floor']:.2f}x"]


def format_table(result: Dict[str, Any]) -> str:
    """``kvj bench vllm --loads-only``'s output."""
    return "\n".join(format_lines(result))
