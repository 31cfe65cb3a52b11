"""End to end: SIGKILL a process generating with transformers, recover, resume identically.

The workload process journals every request's DynamicCache block by block. It is killed at
random points; ``kvj fsck`` and ``kvj recover`` run through the real entry point; the
restarted process resumes every in-flight request from the manifest. Checked: the final
greedy tokens equal an uninterrupted run's, token for token; each resumed request starts
computing exactly at its resume position (the end of its last durable block), never
before; what recover planned is what was restored.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.e2e import check_cycles, reference_generation, rng, workload_threads

import kvj
from kvj.demo import crashrun
from kvj.demo.generation import GenerationLoop
from kvj.demo.worker import read_results
from kvj.demo.workload import GenerationWorkload, ModelSpec
from kvj.errors import LayoutMismatch
from kvj.integrations.blocks import BlockJournal, resume_points
from kvj.demo.backends import HFBackend
from kvj.integrations.hf import CacheJournal, cache_kwarg
from kvj.ops.recover import recover
from kvj.segments.store import SegmentStore

pytest.importorskip("transformers")

#: Each loop step lasts at least 10 ms, as with a real model, so the random kills land
#: before, across and after the journal's 100 ms commit windows.
PACE = ["--pace-ms", "10"]
WORK = GenerationWorkload(ModelSpec("llama", "tiny"), requests=3, max_new_tokens=24, stagger=3)


def test_uninterrupted_loop_matches_transformers_generate():
    """The loop's fixed schedule (block-aligned prefill chunks, then one token at a time)
    produces what transformers' own greedy generate produces."""
    out, _ = reference_generation(WORK, "hf")
    with workload_threads():
        model = WORK.model.build()
        for rid, prompt, max_new, _ in WORK.items():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False)
            assert out[rid] == ref[0, len(prompt):].tolist()


def test_sigkill_mid_generation_resumes_token_identical(tmp_path):
    r = rng("generation")
    expected, total = reference_generation(WORK, "hf")
    argv = crashrun.worker("generate", "--journal", str(tmp_path / "j"), "--results", str(tmp_path / "out"),
                           *WORK.argv(), *PACE)
    cycles = crashrun.generation_kill_cycles(argv, kills=2, total_steps=total, r=r)
    assert cycles, "the workload finished before the first kill"
    assert check_cycles(cycles, WORK) > 0, "no kill left a durable block to restore"
    assert read_results(str(tmp_path / "out")) == expected
    state = kvj.replay(str(tmp_path / "j"))
    assert not state.in_flight() and not state.warnings


def test_cache_journal_restores_bit_identical_kv(tmp_path):
    """The hook API on a hand-written decode loop: observe() journals completed blocks,
    restore() rebuilds a DynamicCache whose K/V equal the live cache's bit for bit."""
    from transformers import DynamicCache

    with workload_threads():
        model = WORK.model.build()
        prompt = WORK.items()[0][1]
        kwarg = cache_kwarg(model)
        with kvj.Journal.open(tmp_path / "j") as journal:
            kv = CacheJournal(journal, model, block_size=16, model_id="tiny")
            kv.start("chat-1", prompt, max_new_tokens=30)
            cache, tokens = DynamicCache(config=model.config), list(prompt)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tokens]), use_cache=True, **{kwarg: cache}).logits
                for _ in range(30):
                    tokens.append(int(logits[0, -1].argmax()))
                    kv.observe("chat-1", cache, tokens)
                    logits = model(input_ids=torch.tensor([tokens[-1:]]), use_cache=True, **{kwarg: cache}).logits
            journal.sync()
            live = cache
        state = kvj.replay(str(tmp_path / "j"))
        (point,) = resume_points(state, kv.layout)
        assert point.position == (len(tokens) - 1) // 16 * 16 > len(prompt)
        with kvj.Journal.open(tmp_path / "j") as journal:
            restored, known = CacheJournal(journal, model, block_size=16, model_id="tiny").restore(point)
        assert known == tokens[:point.position + 1]
        assert restored.get_seq_length() == point.position
        for layer in range(model.config.num_hidden_layers):
            for name in ("keys", "values"):
                a = getattr(restored.layers[layer], name)
                b = getattr(live.layers[layer], name)[:, :, :point.position]
                assert torch.equal(a, b)


def _journal_some(tmp_path, steps: int):
    """Run the workload in-process for ``steps`` loop steps with a journal, then stop as if killed
    (everything flushed so far is durable; nothing ends)."""
    model = WORK.model.build()
    with kvj.Journal.open(tmp_path / "j") as journal:
        backend = HFBackend(model, WORK.block_size, WORK.model.model_id)
        loop = GenerationLoop(backend, BlockJournal(journal, backend.layout))
        for rid, prompt, max_new, _ in WORK.items():
            loop.submit(rid, prompt, max_new)
        for _ in range(steps):
            loop.step()
    return model


def test_damaged_newest_segment_falls_back_and_still_matches(tmp_path):
    """A flipped byte in a request's newest segment: recover plans the block before it, the
    request recomputes from there, and the output is still the uninterrupted run's."""
    expected, _ = reference_generation(WORK, "hf")
    with workload_threads():
        model = _journal_some(tmp_path, 12)
        state = kvj.replay(str(tmp_path / "j"))
        victim = max(state.in_flight(), key=lambda req: len(req.segments))
        assert len(victim.segments) >= 2
        newest = victim.segments[max(victim.segments)]
        path = SegmentStore(str(tmp_path / "j" / "segments")).backend.path(newest.key)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        manifest = recover(str(tmp_path / "j")).manifest
        entry = next(r for r in manifest["requests"] if r["id"] == victim.id)
        assert entry["fallback"] and entry["resume_position"] == newest.tokens[0]
        with kvj.Journal.open(tmp_path / "j") as journal:
            backend = HFBackend(model, WORK.block_size, WORK.model.model_id)
            loop = GenerationLoop(backend, BlockJournal(journal, backend.layout))
            for point in resume_points(manifest, backend.layout):
                loop.resume(point)
            out = loop.run()
        assert loop.finished[victim.id].restored == newest.tokens[0]
        assert f"resumes at token {newest.tokens[0]}" in loop.finished[victim.id].fallback
        assert loop.finished[victim.id].positions_run[0] == newest.tokens[0]
        assert out == expected


def test_segments_of_another_model_are_refused(tmp_path):
    with workload_threads():
        _journal_some(tmp_path, 8)
    state = kvj.replay(str(tmp_path / "j"))
    other = GenerationWorkload(ModelSpec("llama", "tiny", seed=1)).model
    backend = HFBackend(other.build(), WORK.block_size, other.model_id)
    with pytest.raises(LayoutMismatch, match="model="):
        resume_points(state, backend.layout)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_many_kills(tmp_path, arch):
    work = GenerationWorkload(ModelSpec(arch, "small"), requests=5, max_new_tokens=48, stagger=5)
    r = rng(f"generation-{arch}")
    expected, total = reference_generation(work, "hf")
    argv = crashrun.worker("generate", "--journal", str(tmp_path / "j"), "--results", str(tmp_path / "out"),
                           *work.argv(), *PACE)
    cycles = crashrun.generation_kill_cycles(argv, kills=6, total_steps=total, r=r)
    assert check_cycles(cycles, work) > 0
    assert read_results(str(tmp_path / "out")) == expected
