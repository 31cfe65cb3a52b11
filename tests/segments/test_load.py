"""Restore onto devices and into a paged KV cache."""

import pytest
import torch

from kvj.errors import LayoutMismatch
from kvj.segments.kvblock import gather_block, paged_layout, restore_paged
from kvj.segments.load import load, load_many
from kvj.segments.store import SegmentStore

L, NB, BS, H, D = 3, 10, 4, 2, 8


def _caches(seed=0, fill=None, head_dim=D, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    if fill is not None:
        return [torch.full((NB, 2, BS, H, head_dim), fill, dtype=dtype) for _ in range(L)]
    return [torch.randn(NB, 2, BS, H, head_dim, generator=g).to(dtype) for _ in range(L)]


@pytest.fixture
def store(tmp_path):
    with SegmentStore(tmp_path) as s:
        yield s


def _flush(store, caches, block_ids, model="tiny-llm"):
    layout = paged_layout(model, caches)
    return [store.put(gather_block(caches, b), layout=layout).key for b in block_ids]


def test_paged_restore_puts_every_block_in_its_slot(store):
    src = _caches(1)
    old_ids = [2, 5, 7, 0]
    keys = _flush(store, src, old_ids)
    dst = _caches(fill=0.0)
    new_ids = [9, 0, 4, 3]
    restore_paged(store, keys, dst, new_ids, model="tiny-llm")
    for layer in range(L):
        for old, new in zip(old_ids, new_ids):
            assert torch.equal(dst[layer][new], src[layer][old])
        untouched = [b for b in range(NB) if b not in new_ids]
        assert torch.count_nonzero(dst[layer][untouched].float()) == 0


def test_shared_prefix_blocks_share_a_key(store):
    a = _caches(2)
    b = [c.clone() for c in a]
    for c in b:
        c[3:].normal_()
    keys_a = _flush(store, a, [0, 1, 2, 3])
    keys_b = _flush(store, b, [0, 1, 2, 3])
    assert keys_a[:3] == keys_b[:3] and keys_a[3] != keys_b[3]
    assert len(list(store.keys())) == 5


@pytest.mark.parametrize("change", ["model", "head_dim", "dtype"])
def test_layout_mismatch_is_refused_before_writing(store, change):
    keys = _flush(store, _caches(3), [1, 2])
    model = "other-llm" if change == "model" else "tiny-llm"
    dst = _caches(fill=0.0, head_dim=D * 2 if change == "head_dim" else D,
                  dtype=torch.float16 if change == "dtype" else torch.bfloat16)
    with pytest.raises(LayoutMismatch):
        restore_paged(store, keys, dst, [0, 1], model=model)
    assert all(torch.count_nonzero(c.float()) == 0 for c in dst)


def test_argument_checks(store):
    keys = _flush(store, _caches(4), [1, 2])
    dst = _caches(fill=0.0)
    with pytest.raises(ValueError):
        restore_paged(store, keys, dst, [3, 3], model="tiny-llm")
    with pytest.raises(ValueError):
        restore_paged(store, keys, dst, [3, NB], model="tiny-llm")
    with pytest.raises(ValueError):
        restore_paged(store, keys, dst, [3], model="tiny-llm")
    restore_paged(store, [], dst, [], model="tiny-llm")


def test_load_and_load_many(store):
    xs = [torch.randn(100, 7) for _ in range(5)]
    keys = [store.put(x).key for x in xs]
    assert torch.equal(load(store, keys[0], "cpu"), xs[0])
    for got, want in zip(load_many(store, keys), xs):
        assert torch.equal(got, want)


def test_a_recurring_block_is_read_and_decoded_once(store, monkeypatch):
    src = _caches(5)
    keys = _flush(store, src, [1, 2, 1, 1, 2])  # a shared prefix: the same block in several requests
    assert len(set(keys)) == 2
    gets = []
    real = store.get
    monkeypatch.setattr(store, "get", lambda key, **kw: gets.append(key) or real(key, **kw))
    dst = _caches(fill=0.0)
    restore_paged(store, keys, dst, [0, 3, 5, 7, 9], model="tiny-llm")
    assert sorted(gets) == sorted(set(keys))
    for layer in range(L):
        for old, new in zip([1, 2, 1, 1, 2], [0, 3, 5, 7, 9]):
            assert torch.equal(dst[layer][new], src[layer][old])


@pytest.mark.parametrize("forged", ["bigger", "reshaped"])
def test_a_segment_that_claims_the_layout_but_holds_another_shape_is_refused(store, forged):
    src = _caches(6)
    good = _flush(store, src, [1])
    block = gather_block(src, 2)
    wrong = torch.cat([block, block]) if forged == "bigger" else block.reshape(2, L, BS, H, D)
    bad = store.put(wrong, layout=paged_layout("tiny-llm", src)).key  # the right layout, the wrong tensor
    dst = _caches(fill=0.0)
    with pytest.raises(LayoutMismatch):
        restore_paged(store, good + [bad], dst, [0, 1], model="tiny-llm")
    assert all(torch.count_nonzero(c.float()) == 0 for c in dst)
