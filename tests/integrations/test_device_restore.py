"""KV blocks journaled from a device and restored onto one through the integrations
(BlockJournal.load, PagedKVCache.restore, the transformers DynamicCache, GenerationLoop.resume),
under the strict CUDA stand-in (tests/support/fakecuda.py): copies run late and streams race
unless kvj waits, so these pass only where kvj's own waits order the work as CUDA needs."""

from __future__ import annotations

import pytest
import torch
from support.e2e import workload_threads
from support.fakecuda import gpu  # noqa: F401

import kvj
from kvj.demo.generation import GenerationLoop
from kvj.demo.workload import GenerationWorkload, ModelSpec
from kvj.demo.backends import PagedKVCache
from kvj.integrations.blocks import BlockJournal, resume_points
from kvj.segments.kvblock import KVBlockLayout

LAYOUT = KVBlockLayout("m", dtype="bfloat16", layers=2, kv_heads=2, head_dim=8, block_size=4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _journal_blocks(gpu, path, dev):
    """A request with three blocks flushed from ``dev``, left in flight; their CPU values."""
    g = torch.Generator().manual_seed(11)
    values = [torch.randn(LAYOUT.shape, generator=g).to(torch.bfloat16) for _ in range(3)]
    prompt = list(range(10))
    tokens = prompt + [20, 21, 22]
    with kvj.Journal.open(path) as journal:
        bj = BlockJournal(journal, LAYOUT)
        bj.start("r1", prompt, max_new_tokens=8)
        for b, v in enumerate(values):
            block = gpu.fresh(v, dev)
            bj.flush("r1", b, block, tokens[b * 4:(b + 1) * 4 + 1])
            block.fill_(0)  # the cache slot is reused at once
        for fut in bj._requests["r1"].pending:
            fut.result(timeout=60)
    return values


def test_blocks_flushed_from_a_device_load_onto_the_callers_device(gpu, tmp_path):
    values = _journal_blocks(gpu, tmp_path / "j", "cuda:0")
    torch.cuda.set_device(1)
    with kvj.Journal.open(tmp_path / "j") as journal:
        bj = BlockJournal(journal, LAYOUT)
        (point,) = resume_points(kvj.replay(str(tmp_path / "j")), LAYOUT)
        blocks = bj.load(point, "cuda")
    assert point.position == 12 and [b.device for b in blocks] == [torch.device("cuda", 1)] * 3
    for got, want in zip(blocks, values):
        assert torch.equal(_bits(got.cpu()), _bits(want))


def test_a_paged_cache_on_the_device_takes_restored_blocks_in_its_new_slots(gpu, tmp_path):
    values = _journal_blocks(gpu, tmp_path / "j", "cuda:0")
    with kvj.Journal.open(tmp_path / "j") as journal:
        (point,) = resume_points(kvj.replay(str(tmp_path / "j")), LAYOUT)
        blocks = BlockJournal(journal, LAYOUT).load(point, "cuda:0")
    cache = PagedKVCache(LAYOUT, num_blocks=8, device="cuda:0", order_seed=5)
    slots = cache.restore("r1", blocks)
    assert cache.pools[0].is_cuda and len(set(slots)) == 3
    for layer, pool in enumerate(cache.pools):
        got = pool.cpu()
        for slot, want in zip(slots, values):
            assert torch.equal(_bits(got[slot]), _bits(want[layer]))


def test_a_dynamic_cache_is_rebuilt_on_the_device(gpu, tmp_path):
    transformers = pytest.importorskip("transformers")
    from kvj.integrations.hf import build_cache

    values = _journal_blocks(gpu, tmp_path / "j", "cuda:1")
    with kvj.Journal.open(tmp_path / "j") as journal:
        (point,) = resume_points(kvj.replay(str(tmp_path / "j")), LAYOUT)
        blocks = BlockJournal(journal, LAYOUT).load(point, "cuda:1")
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      hidden_size=16, head_dim=8, vocab_size=32)
    cache = build_cache(blocks, config)
    keys, vals = (cache.layers[1].keys, cache.layers[1].values) if hasattr(cache, "layers") else (
        cache.key_cache[1], cache.value_cache[1])
    assert keys.device == torch.device("cuda", 1) and cache.get_seq_length() == 12
    want = torch.cat([v[1] for v in values], dim=1)  # [2, positions, heads, dim]
    assert torch.equal(_bits(keys[0].transpose(0, 1).cpu()), _bits(want[0]))
    assert torch.equal(_bits(vals[0].transpose(0, 1).cpu()), _bits(want[1]))


WORK = GenerationWorkload(ModelSpec("llama", "tiny"), requests=2, block_size=16, max_new_tokens=10, stagger=2,
                          shared_prefix=16)


@pytest.mark.parametrize("backend", ["paged", "hf"])
def test_generation_on_the_device_resumes_token_identical_from_its_journal(gpu, tmp_path, backend):
    """Serve on cuda:0, stop mid-decode with requests in flight, resume from the journal
    (blocks loaded onto cuda:0): the tokens equal an uninterrupted run on the CPU."""
    pytest.importorskip("transformers")
    from kvj.demo.crashrun import uninterrupted_generation
    from kvj.demo.backends import HFBackend, PagedBackend

    def serve(journal, state=None):
        model = WORK.model.build("cuda:0")
        if backend == "paged":
            kv = PagedBackend(model, WORK.block_size, WORK.model.model_id, num_blocks=64,
                              order_seed=len(state.epochs) if state else 0, journal=journal)
        else:
            kv = HFBackend(model, WORK.block_size, WORK.model.model_id)
        loop = GenerationLoop(kv, BlockJournal(journal, kv.layout))
        if state is not None:
            if backend == "paged":
                kv.cache.forget_previous(state)
            for point in resume_points(state, kv.layout):
                assert loop.resume(point).restored > 0
        return loop

    with workload_threads():
        expected, _ = uninterrupted_generation(WORK, backend, "cpu")
        with kvj.Journal.open(tmp_path / "j") as journal:
            loop = serve(journal)
            for rid, prompt, max_new, _ in WORK.items():
                loop.submit(rid, prompt, max_new)
            for _ in range(6):  # every request is past its prompt's first block, none has finished
                loop.step()
            assert len(loop.active) == 2
            for bj_req in loop.blocks._requests.values():
                for fut in bj_req.pending:
                    fut.result(timeout=60)
        with kvj.Journal.open(tmp_path / "j") as journal:
            resumed = serve(journal, kvj.replay(str(tmp_path / "j"))).run()
    assert resumed == expected
