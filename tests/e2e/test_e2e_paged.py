"""End to end with a vLLM-style paged KV cache: kill, recover, restore into new block ids.

The workload process serves requests over a paged cache (block tables, a pool of blocks
per layer) with paged attention over transformers weights, journaling every full block and
every block allocation. After SIGKILLs and ``kvj recover``, the restarted process hands out
blocks in a different order; every resumed request lands in block ids it did not have
before, and the final tokens equal an uninterrupted run's.
"""

from __future__ import annotations

import pytest
import torch
from support.e2e import check_cycles, reference_generation, rng, workload_threads

import kvj
from kvj.demo import crashrun
from kvj.demo.generation import GenerationLoop
from kvj.demo.worker import read_results
from kvj.demo.workload import GenerationWorkload, ModelSpec
from kvj.integrations.blocks import BlockJournal, resume_points
from kvj.demo.backends import HFBackend, PagedBackend

pytest.importorskip("transformers")

#: Each loop step lasts at least 10 ms, as with a real model, so the random kills land
#: before, across and after the journal's 100 ms commit windows.
PACE = ["--pace-ms", "10"]
WORK = GenerationWorkload(ModelSpec("llama", "tiny"), requests=3, max_new_tokens=24, stagger=3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_paged_attention_matches_transformers(arch):
    """Same weights, same positions: the paged forward's logits and KV blocks agree with
    transformers' DynamicCache forward (to float tolerance), prefill chunk and decode."""
    with workload_threads():
        model = ModelSpec(arch, "tiny").build()
        hf, paged = HFBackend(model, 16), PagedBackend(model, 16, num_blocks=16)
        prompt = WORK.items()[0][1][:40]
        with torch.no_grad():
            for start, end in ((0, 16), (16, 32), (32, 40), (40, 41)):
                ids = prompt[start:end] if end <= len(prompt) else [7]
                torch.testing.assert_close(paged.forward("r", ids, start), hf.forward("r", ids, start),
                                           rtol=1e-4, atol=1e-4)
        for block in (0, 1):
            torch.testing.assert_close(paged.block("r", block), hf.block("r", block), rtol=1e-5, atol=1e-5)


def test_restore_scatters_every_block_into_its_new_slot(tmp_path):
    with workload_threads():
        model = WORK.model.build()
        with kvj.Journal.open(tmp_path / "j") as journal:
            before = PagedBackend(model, WORK.block_size, WORK.model.model_id, order_seed=0)
            loop = GenerationLoop(before, BlockJournal(journal, before.layout))
            rid, prompt, max_new, _ = WORK.items()[1]
            loop.submit(rid, prompt, max_new)
            for _ in range(12):
                loop.step()
        (point,) = resume_points(kvj.replay(str(tmp_path / "j")), before.layout)
        assert point.position >= 3 * WORK.block_size
        with kvj.Journal.open(tmp_path / "j") as journal:
            after = PagedBackend(model, WORK.block_size, WORK.model.model_id, order_seed=1)
            GenerationLoop(after, BlockJournal(journal, after.layout)).resume(point)
        old, new = before.cache.tables[rid], after.restored_tables[rid]
        assert len(new) == point.position // WORK.block_size
        assert new != old[:len(new)]
        for i, (o, n) in enumerate(zip(old, new)):
            for layer in range(before.layout.layers):
                assert torch.equal(after.cache.pools[layer][n], before.cache.pools[layer][o]), (i, layer)


@pytest.mark.slow  # the fast suite kills the HF backend's loop (test_e2e_generation); paged restores run in test_device_restore
def test_sigkill_paged_generation_resumes_into_new_blocks(tmp_path):
    r = rng("paged")
    expected, total = reference_generation(WORK, "paged")
    journal = str(tmp_path / "j")
    argv = crashrun.worker("generate", "--backend", "paged", "--journal", journal,
                           "--results", str(tmp_path / "out"), *WORK.argv(), *PACE)
    cycles = crashrun.generation_kill_cycles(argv, kills=2, total_steps=total, r=r)
    assert cycles, "the workload finished before the first kill"
    assert check_cycles(cycles, WORK) > 0
    final = cycles[-1]["summary"]
    moved = 0
    for entry in final.values():
        if entry["restored"]:
            after = entry["blocks_after"]
            assert len(after) == entry["restored"] // WORK.block_size
            assert after != entry["blocks_before"][:len(after)]
            moved += 1
    assert read_results(str(tmp_path / "out")) == expected
    state = kvj.replay(journal)
    assert not state.in_flight() and not state.warnings
    assert not state.allocations.get("cpu"), "blocks left allocated in the journal's memory map"
    print(f"paged: {moved} requests restored into new block ids")


@pytest.mark.slow
def test_many_kills_paged(tmp_path):
    work = GenerationWorkload(ModelSpec("qwen2", "small"), requests=5, max_new_tokens=48, stagger=5)
    r = rng("paged-many")
    expected, total = reference_generation(work, "paged")
    argv = crashrun.worker("generate", "--backend", "paged", "--journal", str(tmp_path / "j"),
                           "--results", str(tmp_path / "out"), *work.argv(), *PACE)
    cycles = crashrun.generation_kill_cycles(argv, kills=6, total_steps=total, r=r)
    assert check_cycles(cycles, work) > 0
    assert read_results(str(tmp_path / "out")) == expected
