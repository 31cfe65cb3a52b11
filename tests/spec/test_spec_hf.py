"""The independent reader on KV blocks the transformers integration journals (kvj-segment(5),
KV BLOCKS, order L2NHD): a block is [layers, 2, block_size, kv_heads, head_dim], K at index 0 of
the second axis and V at 1, positions along the third, read against the DynamicCache it came from."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from spec import reader

transformers = pytest.importorskip("transformers")


def test_cache_journal_blocks_hold_k_then_v_by_position(tmp_path):
    import kvj
    from kvj.integrations.hf import CacheJournal, cache_kwarg

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    path = str(tmp_path / "j")
    with kvj.Journal.open(path) as j:
        cj = CacheJournal(j, model, block_size=4, model_id="tiny-llama")
        cj.start("r", prompt, max_new_tokens=2)
        cache = transformers.DynamicCache(config=config)
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]), use_cache=True, **{cache_kwarg(model): cache})
        assert cj.observe("r", cache, prompt) == 2  # positions 0..7: two whole blocks, each with its next token
        cj.end("r")
        j.sync()
    journal = reader.read_journal(path)
    store = reader.read_store(os.path.join(path, "segments"))
    reader.check_segment_records(journal, store)
    segs = [store[r.payload["key"]] for r in journal.records if r.rtype == 2]
    assert [reader.check_layout(s) for s in segs] == ["kvj-kv-block/2"] * 2
    assert all(s.layout["order"] == "L2NHD" for s in segs)
    for b, seg in enumerate(segs):
        layers, two, bs, heads, dim = seg.shape
        assert (layers, two, bs, heads, dim) == (2, 2, 4, 2, 8) and seg.dtype == "float32"
        block = np.frombuffer(seg.raw, "<f4").reshape(seg.shape)
        for layer in range(layers):
            kv = cache.layers[layer] if hasattr(cache, "layers") else None
            keys = kv.keys if kv is not None else cache.key_cache[layer]
            values = kv.values if kv is not None else cache.value_cache[layer]
            for p in range(bs):
                for h in range(heads):
                    assert np.array_equal(block[layer, 0, p, h], keys[0, h, b * bs + p].numpy())
                    assert np.array_equal(block[layer, 1, p, h], values[0, h, b * bs + p].numpy())
        assert seg.layout["token_ids"] == prompt[b * bs:(b + 1) * bs + 1]
