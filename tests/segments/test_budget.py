"""Eviction under a byte budget: the store as a bounded LRU prefix cache.

A long run stores more distinct blocks than the budget holds, loads and re-references some;
after each compaction the store fits its budget, the segments evicted were all used less
recently than every unneeded one kept, and nothing an in-flight request or a recovery
manifest needs is ever evicted. A put that claims a segment while eviction runs keeps it.
"""

from __future__ import annotations

import os
import random
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from support.wait import wait_for

from kvj.errors import SegmentMissing
from kvj.journal.config import default_store_path
from kvj.journal.journal import Journal
from kvj.journal.replay import replay
from kvj.ops.compact import compact
from kvj.ops.evict import needed_keys
from kvj.ops.recover import manifest_keys, recover
from kvj.ops.status import status
from kvj.segments.local import GC_LOCK
from kvj.segments.store import SegmentStore
from kvj.segments.uses import UseLog, encode, parse, USE, MISS

SEED = int(os.environ.get("KVJ_TEST_SEED", "2020"))
#: The budget, in blocks: more than an in-flight window and a manifest need, far fewer than the run stores.
BUDGET_BLOCKS = 50


def block(i: int) -> torch.Tensor:
    return torch.randn(2, 16, 2, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def item(i: int):
    t = block(i)
    return t.view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape), None


def age(store: SegmentStore, seconds: float) -> None:
    """Every segment file and pack was last stored or claimed ``seconds`` ago (past eviction's
    minimum age, inside the grace period)."""
    t = time.time() - seconds
    for sub in ("objects", "packs"):
        for dirpath, _dirs, names in os.walk(os.path.join(store.backend.root, sub)):
            for name in names:
                if name.endswith((".kvjseg", ".kvjpack")):
                    os.utime(os.path.join(dirpath, name), (t, t))


def stored_bytes(store: SegmentStore) -> int:
    return sum(store.stat(k).size for k in store.keys())


def test_a_long_run_keeps_the_most_recently_used_under_the_budget_and_never_what_is_needed(tmp_path):
    print(f"seed {SEED} (KVJ_TEST_SEED)")
    rng = random.Random(SEED)
    j = str(tmp_path / "j")
    store = SegmentStore(default_store_path(j), count_loads=True)
    journal = Journal.open(j, store=store)
    clock = [0]
    last = {}  # key -> the order of its last use (store, claim or load), as the test did them
    key_of = {}  # block content -> key
    served = asked = 0

    def used(keys):
        clock[0] += 1
        for key in keys:
            last[key] = clock[0]

    in_flight = {}  # request -> round it started
    manifest = set()
    distinct = 0
    budget = None  # BUDGET_BLOCKS of the largest block stored
    sizes = []
    evicted_total = 0
    for rnd in range(20):
        for r in range(3):
            rid = f"r{rnd}-{r}"
            journal.start(rid, tokens=[rnd, r], durable=True)
            in_flight[rid] = rnd
            contents = []
            for b in range(rng.randint(2, 4)):
                if key_of and rng.random() < 0.3:  # a shared prefix: the same block again (a new reference)
                    contents.append(rng.choice(sorted(key_of)))
                else:
                    distinct += 1
                    contents.append(1000 + distinct)
            if rng.random() < 0.5:  # one step's blocks in one pack
                infos = store.put_many([item(c) for c in contents])
                used([i.key for i in infos])
            else:
                infos = []
                for c in contents:
                    infos.append(store.put(block(c)))
                    used([infos[-1].key])
            for seg, (c, info) in enumerate(zip(contents, infos)):
                journal.flush(rid, seg, info=info, token_range=(16 * seg, 16 * seg + 16)).result()
                key_of[c] = info.key
                sizes.append(info.stored_size)
        for key in rng.sample(sorted(set(store.keys())), 3):  # loads: a prefix hit each
            store.get(key)
            used([key])
            served += 1
            asked += 1
        gone = [k for k in key_of.values() if not store.exists(k)]
        if gone:  # a load of an evicted block: asked, not served
            with pytest.raises(SegmentMissing):
                store.get(rng.choice(sorted(gone)))
            asked += 1
        for rid, started in sorted(in_flight.items()):
            if started < rnd - 1 or (started == rnd - 1 and rng.random() < 0.5):
                journal.end(rid)
                del in_flight[rid]
        journal.sync()
        if rnd == 5:  # a recovery: its manifest plans to load what was in flight, ended later
            journal.close()
            result = recover(j, default_store_path(j))  # its own store, which counts no loads
            manifest = set(manifest_keys(result.manifest))
            assert manifest
            journal = Journal.open(j, store=store)
        if budget is None:
            budget = BUDGET_BLOCKS * max(sizes)
        age(store, 600)
        before = set(store.keys())
        needed = set(replay(j).referenced_keys()) | manifest  # what in-flight requests and the manifest need
        assert needed == set(needed_keys(j)[0])
        needed_bytes = sum(store.stat(k).size for k in needed)
        assert needed_bytes <= budget  # the run is sized so that the budget can be kept
        res = compact(j, store, max_store_bytes=budget)
        after = set(store.keys())
        evicted = before - after
        assert evicted == set(res.segments_evicted) and not res.segments_removed
        assert needed <= after, f"round {rnd}: evicted what is needed: {sorted(needed - after)}"
        assert stored_bytes(store) <= budget and res.store_bytes == stored_bytes(store) and res.over_budget == 0
        kept = after - needed
        if evicted and kept:
            assert max(last[k] for k in evicted) <= min(last[k] for k in kept), f"round {rnd}: not LRU"
        evicted_total += len(evicted)
        loads = status(j, default_store_path(j))["store"]["loads"]
        assert loads == {"served": served, "asked": asked, "hit_rate": served / asked}
    journal.close()
    held = len(set(store.keys()))
    assert distinct > 2 * held and evicted_total >= distinct - held  # the budget really bit
    store.close()


def _blocked_on(path: str) -> bool:
    """Whether some process or thread waits for an flock on ``path`` (a ``->`` line in /proc/locks)."""
    st = os.stat(path)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    with open("/proc/locks") as f:
        return any("->" in line and ident in line for line in f)


@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
def test_a_put_racing_the_eviction_of_its_block_is_not_lost(tmp_path, packed):
    """Right after eviction takes the exclusive collection lock to check and remove its first
    batch, a writer thread puts the LRU block again; the removal goes on once the writer is done
    or waits for the lock. The put either claimed the block first (kept) or finds it gone and
    writes it anew: stored either way."""
    j = str(tmp_path / "j")
    store = SegmentStore(default_store_path(j), count_loads=True)
    with Journal.open(j, store=store):
        pass
    if packed:
        keys = [i.key for i in store.put_many([item(c) for c in range(4)])]
    else:
        keys = [store.put(block(c)).key for c in range(4)]
    for key in keys[1:]:
        store.get(key)  # block 0 is the least recently used
    age(store, 600)
    backend = store.backend
    real_lock = backend.collection_lock
    result = {}
    writer = threading.Thread(target=lambda: result.setdefault("info", store.put(block(0))))

    @contextmanager
    def hand_off(exclusive):
        with real_lock(exclusive):
            if exclusive and not writer.is_alive() and "info" not in result:
                writer.start()
                wait_for(lambda: "info" in result or _blocked_on(os.path.join(backend.root, GC_LOCK))
                         or not writer.is_alive(), "the writer's put of the block being evicted")
            yield

    backend.collection_lock = hand_off
    res = compact(j, store, max_store_bytes=stored_bytes(store) - 1)
    writer.join(timeout=120)
    backend.collection_lock = real_lock
    assert not writer.is_alive() and result["info"].key == keys[0]
    assert res.segments_evicted == [keys[0]]  # it was evicted while the writer waited ...
    assert store.exists(keys[0]) and torch.equal(store.get(keys[0]), block(0))  # ... and the put stored it anew
    store.close()


def test_a_claim_between_choosing_and_removal_keeps_the_segment_and_the_next_stands_in(tmp_path):
    j = str(tmp_path / "j")
    store = SegmentStore(default_store_path(j), count_loads=True)
    with Journal.open(j, store=store):
        pass
    keys = [store.put(block(c)).key for c in range(5)]
    for key in keys[1:]:
        store.get(key)
    age(store, 600)
    real = store.delete_many
    calls = []

    def claim_then_delete(batch, older_than=None, keep=None):
        if not calls:
            assert batch[0] == keys[0]  # the LRU block was chosen ...
            store.put(block(0))  # ... and a writer re-references it before it is removed
        calls.append(list(batch))
        return real(batch, older_than, keep)

    store.delete_many = claim_then_delete
    budget = stored_bytes(store) - 1
    res = compact(j, store, max_store_bytes=budget)
    assert store.exists(keys[0]) and keys[0] not in res.segments_evicted
    assert res.segments_evicted == [keys[1]] and calls == [[keys[0]], [keys[1]]] and stored_bytes(store) <= budget


def test_recently_stored_segments_are_not_evicted_and_what_is_left_over_is_reported(tmp_path):
    j = str(tmp_path / "j")
    store = SegmentStore(default_store_path(j))
    with Journal.open(j, store=store) as journal:
        journal.start("live", durable=True)
        live = store.put(block(1)).key
        journal.flush("live", 0, info=store.info(live), token_range=(0, 16)).result()
        journal.sync()
    old = store.put(block(2)).key
    age(store, 600)
    fresh = store.put(block(3)).key  # stored just now: inside eviction's minimum age
    res = compact(j, store, max_store_bytes=0)
    assert res.segments_evicted == [old]
    assert set(store.keys()) == {live, fresh}
    assert res.over_budget == res.store_bytes == stored_bytes(store) > 0
    dry = compact(j, store, max_store_bytes=0, dry_run=True, now=time.time() + 3600, grace=7200)
    assert dry.segments_evicted == [fresh] and set(store.keys()) == {live, fresh}  # a dry run changes nothing


def test_without_a_use_log_file_times_order_eviction(tmp_path):
    j = str(tmp_path / "j")
    store = SegmentStore(default_store_path(j))
    with Journal.open(j, store=store):
        pass
    keys = [store.put(block(c)).key for c in range(3)]
    os.unlink(store.backend.uses.path)
    for n, key in enumerate(keys):
        t = time.time() - 1000 + 100 * (2 - n)  # block 2 oldest
        os.utime(store.backend.path(key), (t, t))
    res = compact(j, store, max_store_bytes=stored_bytes(store) - 1)
    assert res.segments_evicted == [keys[2]]


def test_a_manifest_that_cannot_be_read_stops_eviction(tmp_path):
    j = str(tmp_path / "j")
    store = SegmentStore(default_store_path(j))
    with Journal.open(j, store=store):
        pass
    key = store.put(block(1)).key
    age(store, 600)
    os.makedirs(os.path.join(j, "recovery"))
    with open(os.path.join(j, "recovery", "manifest-000001.json"), "w") as f:
        f.write('{"requests": 3}')
    from kvj.errors import FormatError

    with pytest.raises(FormatError, match="manifest-000001.json"):
        compact(j, store, max_store_bytes=0)
    assert store.exists(key)


def test_the_use_log_counts_loads_folds_and_ends_at_a_torn_record(tmp_path):
    a, b = "ab" * 32, "cd" * 32
    data = encode([(USE, a, 1), (MISS, b, 1)], 5_000_000_000) + encode([(USE, a, 0)], 7_000_000_000)
    uses = parse(data + data[:20])
    assert uses.last == {a: 7.0} and (uses.served, uses.missed, uses.ignored_bytes) == (1, 1, 20)
    assert uses.hit_rate() == 0.5
    bad = bytearray(data)
    bad[60] ^= 1  # the second record's key: its CRC fails; a valid record follows, so it is damage, skipped
    damaged = parse(bytes(bad))
    assert (damaged.damaged, damaged.damage_offset, damaged.ignored_bytes, damaged.missed) == (1, 53, 0, 0)
    assert damaged.last == {a: 7.0}  # the third record is read past the damage
    assert parse(bytes(bad[:106])).ignored_bytes == 53  # the last record failing: a torn append
    store = SegmentStore(tmp_path / "s")
    with store:
        k1, k2 = store.put(block(1)).key, store.put(block(2)).key
        store.get(k1)  # not counted: this store does not count loads
        counted = SegmentStore(tmp_path / "s", count_loads=True)
        counted.get(k1)
        counted.verify(k2)
        with pytest.raises(SegmentMissing):
            counted.get("ef" * 32)
        counted.close()
        log: UseLog = store.backend.uses
        before = log.read()
        assert (before.served, before.missed) == (2, 1) and set(before.last) == {k1, k2}
        store.delete(k2)
        log.fold(set(store.keys()))
        after = log.read()
        assert set(after.last) == {k1} and after.last[k1] == before.last[k1]
        assert (after.served, after.missed) == (2, 1) and os.path.getsize(log.path) == 3 * 53
