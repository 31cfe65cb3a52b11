"""Packs: many segments made durable by one fdatasync and one directory fsync, each member a
segment like any other above the backend (found, read, verified, claimed, collected,
quarantined by key), and the pack format as kvj-segment(5) PACKS specifies it."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import time

import crc32c
import pytest
import torch
from support.fakecuda import gpu  # noqa: F401

from kvj.errors import InvalidArgument, SegmentCorrupt, SegmentMissing
from kvj.segments import device, packfile
from kvj.segments import segfile as seg
from kvj.segments.flusher import Flusher
from kvj.segments.store import SegmentStore


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 2, 16, 2, 64, generator=g).to(torch.bfloat16)


def items(buf: torch.Tensor, layout=None):
    return [(memoryview(b.contiguous().view(torch.uint8).numpy()).cast("B"), b.dtype, tuple(b.shape),
             layout if layout is not None else {"block": i}) for i, b in enumerate(buf)]


def packs_in(root) -> list:
    return sorted(n for n in os.listdir(os.path.join(root, "packs")) if n.endswith(".kvjpack"))


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def test_put_many_writes_one_pack_with_one_fdatasync_and_one_directory_fsync(tmp_path):
    kv = blocks(40)
    with SegmentStore(tmp_path / "s") as store:
        store.put_many(items(blocks(1, seed=9)))  # the store's directories exist from here on
        (first,) = packs_in(tmp_path / "s")
        before = store.io_counts()
        infos = store.put_many(items(kv))
        counts = delta(before, store.io_counts())
        assert counts["file_syncs"] == 1 and counts["dir_syncs"] == 1
        (new,) = set(packs_in(tmp_path / "s")) - {first}
        assert counts["bytes_written"] == os.path.getsize(os.path.join(tmp_path / "s", "packs", new))
        assert not os.path.exists(tmp_path / "s" / "objects")
        for i, info in enumerate(infos):
            assert torch.equal(store.get(info.key), kv[i])
            assert store.verify(info.key) == info == store.info(info.key)
            assert store.stat(info.key).size == len(store.read_stored(info.key))
        assert set(store.keys()) == {i.key for i in infos} | {store.key_for(blocks(1, seed=9)[0], {"block": 0})}
        # one segment per put, for comparison: an fsync and a directory fsync (or more) each
        before = store.io_counts()
        store.put(kv[0], layout={"loose": 1})
        assert delta(before, store.io_counts())["file_syncs"] == 1 and delta(before, store.io_counts())["dir_syncs"] >= 1


def test_each_member_is_exactly_a_segment_file(tmp_path):
    """A member's bytes are what put() writes as a loose file for the same tensor."""
    kv = blocks(5, seed=1)
    with SegmentStore(tmp_path / "packed") as packed, SegmentStore(tmp_path / "loose") as loose:
        infos = packed.put_many(items(kv), codec="byteplane")
        for i, info in enumerate(infos):
            single = loose.put(kv[i], layout={"block": i}, codec="byteplane")
            assert single == info
            with open(loose.backend.path(info.key), "rb") as f:
                assert bytes(packed.read_stored(info.key)) == f.read()


def test_duplicates_and_stored_members_are_not_written_again(tmp_path):
    kv = blocks(6, seed=2)
    with SegmentStore(tmp_path) as store:
        first = store.put(kv[0], layout={"block": 0})  # stored loose before
        batch = items(kv)
        batch.append(batch[3])  # the same block twice in one step
        hits = store.dedup_hits
        infos = store.put_many(batch)
        assert infos[0] == first and infos[3] == infos[6] and store.dedup_hits == hits + 1
        (pack,) = packs_in(tmp_path)
        path = os.path.join(tmp_path, "packs", pack)
        with open(path, "rb") as f:
            data = f.read()
        off, count, crc = packfile.index_location(data[-packfile.TRAILER.size:], len(data), path)
        members = packfile.parse_index(data[:16], data[off:off + count * 48], off, count, crc, path)
        assert sorted(m.key for m in members) == sorted({i.key for i in infos[1:6]})  # five new members
        before = store.io_counts()
        assert store.put_many(batch) == infos  # all stored: nothing written, nothing synced
        assert delta(before, store.io_counts()) == {"file_syncs": 0, "dir_syncs": 0, "bytes_written": 0}
        assert packs_in(tmp_path) == [pack]


def test_pack_layout_is_the_spec_and_is_listed_from_its_tail(tmp_path):
    """The bytes as kvj-segment(5) PACKS lays them out, read here without kvj's parser."""
    kv = blocks(3, seed=3)
    with SegmentStore(tmp_path) as store:
        infos = store.put_many(items(kv))
    (pack,) = packs_in(tmp_path)
    data = open(os.path.join(tmp_path, "packs", pack), "rb").read()
    assert data[:16] == b"\x89KVJPAK\n" + struct.pack("<HHI", 1, 0, 0)
    index_offset, count, crc, end = struct.unpack("<QII8s", data[-24:])
    assert end == b"KVJPAKOK" and count == 3 and index_offset + 48 * count + 24 == len(data)
    index = data[index_offset:index_offset + 48 * count]
    assert crc32c.crc32c(data[-24:-12], crc32c.crc32c(index)) == crc
    pos = 16
    for i, info in enumerate(infos):
        key, offset, length = struct.unpack_from("<32sQQ", index, 48 * i)
        assert key.hex() == info.key and offset == pos
        member = data[offset:offset + length]
        assert member[:8] == b"\x89KVJSEG\n" and member[-8:] == b"KVJSEGOK"
        pos += length
    assert pos == index_offset


def test_the_pack_format_agrees_with_the_segment_format_it_holds():
    """A pack's preamble has a segment file's layout, and its least member is the smallest
    segment file (a preamble and a trailer): the two modules state them apart, so check."""
    assert packfile.PREAMBLE.format == seg.PREAMBLE.format
    assert packfile.MIN_MEMBER == seg.PREAMBLE.size + seg.TRAILER.size


def test_a_pack_written_by_another_process_is_found(tmp_path):
    """The index is built once and refreshed on a miss: a pack another writer made since is
    found by exists, get, stat and keys."""
    with SegmentStore(tmp_path) as reader:
        assert list(reader.keys()) == []
        code = textwrap.dedent("""
            import sys, torch
            from kvj.segments.store import SegmentStore
            x = torch.arange(4096, dtype=torch.float32).reshape(4, 1024)
            with SegmentStore(sys.argv[1]) as s:
                infos = s.put_many([(memoryview(r.numpy()).cast("B"), r.dtype, tuple(r.shape), {"r": i})
                                    for i, r in enumerate(x)])
            print(" ".join(i.key for i in infos))
        """)
        keys = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              check=True).stdout.split()
        assert len(keys) == 4 and reader.exists(keys[2])
        assert torch.equal(reader.get(keys[1]), torch.arange(1024, 2048, dtype=torch.float32))
        assert sorted(reader.keys()) == sorted(keys)


def test_a_damaged_member_is_found_and_quarantined_without_losing_the_others(tmp_path):
    kv = blocks(4, seed=4)
    with SegmentStore(tmp_path) as store:
        infos = store.put_many(items(kv))
        (pack,) = packs_in(tmp_path)
        path = os.path.join(tmp_path, "packs", pack)
        victim = infos[1].key
        where = store.backend.describe(victim)
        offset = int(where.rsplit("@", 1)[1])
        with open(path, "r+b") as f:  # a flipped bit inside member 1's first chunk
            f.seek(offset + 100)
            b = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(SegmentCorrupt) as err:
            store.get(victim)
        assert pack in str(err.value)
        damaged = bytes(store.read_stored(victim))
        aside = store.quarantine(victim)
        assert not store.exists(victim) and victim not in set(store.keys())
        with pytest.raises(SegmentMissing):
            store.get(victim)
        assert open(aside, "rb").read() == damaged  # the member's bytes, set aside as a segment file
        assert store.quarantined_copies(victim) == [aside]
        for i in (0, 2, 3):
            assert torch.equal(store.get(infos[i].key), kv[i])
        again = store.put_many(items(kv[1:2], {"block": 1}))  # the same content stored anew
        assert again[0].key == victim and torch.equal(store.get(victim), kv[1])
    with SegmentStore(tmp_path) as reopened:  # the dead list is on disk
        assert torch.equal(reopened.get(victim), kv[1]) and len(packs_in(tmp_path)) == 2


def test_collection_of_members_dead_lists_unlink_and_repack(tmp_path):
    kv = blocks(10, seed=5)
    root = tmp_path / "s"
    with SegmentStore(root) as store:
        infos = store.put_many(items(kv))
        (pack,) = packs_in(root)
        path = os.path.join(root, "packs", pack)
        os.utime(path, (1, 1))  # the pack (every member's last use) is old
        assert store.delete_many([infos[0].key, infos[1].key], older_than=1000.0) == [infos[0].key, infos[1].key]
        assert packs_in(root) == [pack] and os.path.exists(path[:-len(".kvjpack")] + ".dead")
        assert not store.exists(infos[0].key) and store.exists(infos[2].key)
    with SegmentStore(root) as store:  # removal is durable: named in the dead list
        assert sorted(store.keys()) == sorted(i.key for i in infos[2:])
        with pytest.raises(SegmentMissing):
            store.get(infos[1].key)
        os.utime(path, None)  # used now: collection keeps its members
        assert store.delete_many([infos[2].key], older_than=time.time() - 3600) == []
        assert store.exists(infos[2].key)
        # four more dead: 6 of 10 members (of about equal size), more than half: repacked
        store.delete_many([i.key for i in infos[2:6]])
        (repacked,) = packs_in(root)
        assert repacked != pack and not os.path.exists(path) and not os.path.exists(path[:-8] + ".dead")
        for i in range(6, 10):
            assert torch.equal(store.get(infos[i].key), kv[i])
        assert sorted(store.keys()) == sorted(i.key for i in infos[6:])
        store.delete_many([i.key for i in infos[6:]])
        assert packs_in(root) == [] and list(store.keys()) == []


def test_a_claimed_member_is_not_collected_and_a_collected_one_is_not_claimed(tmp_path):
    """The gc.lock protocol for packed members, as test_collection checks it for loose files."""
    kv = blocks(3, seed=6)
    with SegmentStore(tmp_path) as store:
        infos = store.put_many(items(kv))
        key = infos[0].key
        path = os.path.join(tmp_path, "packs", packs_in(tmp_path)[0])
        os.utime(path, (1, 1))
        assert store.backend.touch(key)  # claimed now
        assert store.stat(key).used > 1000.0
        assert store.delete_many([key], older_than=1000.0) == [] and store.exists(key)
        os.utime(path, (1, 1))
        assert store.delete_many([key], older_than=1000.0) == [key] and not store.exists(key)
        assert not store.backend.touch(key)
        hits = store.dedup_hits
        assert store.put_many(items(kv[:1], {"block": 0}))[0].key == key
        assert store.dedup_hits == hits and store.exists(key)  # written anew, not a dedup hit


def test_a_stale_index_never_claims_a_collected_member(tmp_path):
    """A store that listed a pack before another process collected one of its members does
    not claim it (touch checks the dead list on disk) but writes it anew."""
    kv = blocks(3, seed=7)
    with SegmentStore(tmp_path) as writer:
        infos = writer.put_many(items(kv))
        assert writer.exists(infos[1].key)  # indexed
        with SegmentStore(tmp_path) as collector:
            os.utime(os.path.join(tmp_path, "packs", packs_in(tmp_path)[0]), (1, 1))
            assert collector.delete_many([infos[1].key], older_than=1000.0) == [infos[1].key]
        assert not writer.backend.touch(infos[1].key)
        hits = writer.dedup_hits
        again = writer.put_many(items(kv))
        assert again == infos and writer.dedup_hits == hits + 2  # blocks 0 and 2 claimed, block 1 written
        assert len(packs_in(tmp_path)) == 2 and torch.equal(writer.get(infos[1].key), kv[1])


def test_a_pack_repacked_by_another_process_is_followed(tmp_path):
    kv = blocks(4, seed=8)
    with SegmentStore(tmp_path) as reader:
        infos = reader.put_many(items(kv))
        assert torch.equal(reader.get(infos[3].key), kv[3])  # the old pack is indexed
        with SegmentStore(tmp_path) as other:
            other.delete_many([infos[0].key, infos[1].key])  # half dead: repacked
        assert torch.equal(reader.get(infos[3].key), kv[3])
        assert reader.stat(infos[2].key).size > 0 and reader.backend.touch(infos[2].key)


def test_a_damaged_pack_lists_nothing_and_says_so(tmp_path):
    kv = blocks(2, seed=10)
    with SegmentStore(tmp_path) as store:
        infos = store.put_many(items(kv))
    path = os.path.join(tmp_path, "packs", packs_in(tmp_path)[0])
    with open(path, "r+b") as f:  # a flipped bit in the index: its CRC no longer matches
        f.seek(-30, os.SEEK_END)
        b = f.read(1)
        f.seek(-30, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    with SegmentStore(tmp_path) as store:
        assert list(store.keys()) == [] and not store.exists(infos[0].key)
        with pytest.raises(SegmentMissing, match="damaged pack"):
            store.get(infos[0].key)


def test_packs_are_refused_when_not_a_pack():
    with pytest.raises(SegmentCorrupt):
        packfile.index_location(b"\x00" * 24, 100, "x")
    members = [packfile.Member("ab" * 32, 16, 40)]
    tail = packfile.tail(members, 56)
    off, count, crc = packfile.index_location(tail[-24:], 56 + len(tail), "x")
    assert packfile.parse_index(packfile.preamble(), tail[:48], off, count, crc, "x") == members
    with pytest.raises(SegmentCorrupt, match="inconsistent"):
        bad = packfile.tail([packfile.Member("ab" * 32, 20, 36)], 56)
        packfile.parse_index(packfile.preamble(), bad[:48], 56, 1, struct.unpack("<QII8s", bad[-24:])[2], "x")
    assert packfile.parse_dead(packfile.dead_entries(["cd" * 32, "ef" * 32]) + b"\x01\x02") == {"cd" * 32, "ef" * 32}
    torn = bytearray(packfile.dead_entries(["cd" * 32, "ef" * 32]))
    torn[40] ^= 1
    assert packfile.parse_dead(bytes(torn)) == {"cd" * 32}


def test_flusher_submit_many_one_job_one_pack(tmp_path):
    kv = blocks(12, seed=11)
    with SegmentStore(tmp_path) as store, Flusher(store) as fl:
        got = []
        infos = fl.submit_many(kv, [{"b": i} for i in range(12)], on_durable=got.append).result(timeout=120)
        assert got == [infos] and len(packs_in(tmp_path)) == 1
        for i, info in enumerate(infos):
            assert torch.equal(store.get(info.key), kv[i])
        mixed = [torch.randn(3, 5), torch.arange(7, dtype=torch.int16), torch.randn(6, 4).t(), kv[0]]
        infos = fl.submit_many(mixed, [None, {"a": 1}, None, {"b": 0}]).result(timeout=120)
        for t, info in zip(mixed, infos):
            assert torch.equal(store.get(info.key), t)
        with pytest.raises(InvalidArgument):
            fl.submit_many(kv, [{}])
        with pytest.raises(InvalidArgument):
            fl.submit_many(kv[:, 0].transpose(1, 2), [{}] * 12)


def test_flusher_submit_many_waits_for_the_copy_into_its_buffer(gpu, tmp_path):
    """A step's blocks downloaded by one copy into a pinned buffer: the worker reads the
    buffer only after the copy's event (the stand-in leaves poison there until then)."""
    kv = blocks(8, seed=12)
    on_gpu = gpu.fresh(kv.clone(), "cuda:0")
    host = device.CUDA.pinned(kv.numel() * kv.element_size()).view(kv.dtype).view(kv.shape)
    event = device.CUDA.download(on_gpu, host)
    assert gpu.in_flight(host)
    with SegmentStore(tmp_path) as store, Flusher(store) as fl:
        infos = fl.submit_many(host, [{"b": i} for i in range(8)], ready=event).result(timeout=120)
        for i, info in enumerate(infos):
            assert torch.equal(store.get(info.key), kv[i])
        many = [gpu.fresh(b.clone(), "cuda:0") for b in blocks(3, seed=13)]
        infos = fl.submit_many(many, [{"d": i} for i in range(3)]).result(timeout=120)
        for t, info in zip(blocks(3, seed=13), infos):
            assert torch.equal(store.get(info.key), t)


def test_compaction_fsck_recovery_and_replication_see_packed_members(tmp_path):
    """Above the backend packs need no special case: a journal whose segments are pack
    members is compacted (the ended request's members collected, its pack removed), checked
    by fsck, recovered, and its stored bytes shipped to another store as replicate does."""
    from kvj.journal.config import default_store_path
    from kvj.journal.journal import Journal
    from kvj.ops.compact import compact
    from kvj.ops.fsck import fsck
    from kvj.ops.recover import recover

    path = str(tmp_path / "j")
    live, done = blocks(4, seed=20), blocks(4, seed=21)
    with Journal.open(path) as j:
        with SegmentStore(default_store_path(path)) as store:
            live_infos = store.put_many(items(live, {"r": "live"}))
            done_infos = store.put_many(items(done, {"r": "done"}))
        assert len(packs_in(default_store_path(path))) == 2
        for rid, infos in (("live", live_infos), ("done", done_infos)):
            j.start(rid, tokens=[1])
            for i, info in enumerate(infos):
                j.flush(rid, i, token_range=(16 * i, 16 * i + 16), info=info).result()
        j.end("done")
        j.sync()
    result = compact(path, grace=0.0, now=time.time() + 60)
    assert sorted(result.segments_removed) == sorted(i.key for i in done_infos)
    assert len(packs_in(default_store_path(path))) == 1  # the ended request's pack is gone
    checked = fsck(path)
    assert checked.exit_code == 0 and checked.data_verified == 4 and not checked.orphans
    manifest = recover(path, dry_run=True).manifest
    assert manifest["segments_unusable"] == 0
    with SegmentStore(default_store_path(path)) as store, SegmentStore(tmp_path / "replica") as other:
        for key in store.keys():
            other.ingest_stored(key, store.read_stored(key))
        for info, t in zip(live_infos, live):
            assert torch.equal(other.get(info.key), t)


@pytest.mark.parametrize("first", ["writes", "fails"])
def test_concurrent_put_many_write_a_shared_block_once(tmp_path, first):
    """Two steps sharing blocks, put at once: the blocks the first is writing are not written
    again by the second, which waits for them and claims them (or, if the first put failed,
    stores them itself)."""
    import threading

    from support.wait import wait_for

    kv = blocks(8, seed=30)
    batch = items(kv)
    gate, calls, errors, out = threading.Event(), [], [], {}
    with SegmentStore(tmp_path) as store:
        real = store.backend.begin_many

        def gated():
            calls.append(1)
            if len(calls) == 1:  # the first step's pack waits for the gate
                gate.wait()
                if first == "fails":
                    raise RuntimeError("the first step's write fails")
            return real()

        def put(name, part):
            try:
                out[name] = store.put_many([batch[i] for i in part])
            except RuntimeError as exc:
                errors.append(exc)

        store.backend.begin_many = gated
        a = threading.Thread(target=put, args=("a", range(0, 6)))
        b = threading.Thread(target=put, args=("b", range(2, 8)))
        try:
            a.start()
            wait_for(lambda: calls, "the first step to start its pack, its blocks claimed")
            b.start()
            wait_for(lambda: os.path.isdir(tmp_path / "packs") and len(packs_in(tmp_path)) == 1,
                     "the second step's own pack (blocks 6 and 7)")
            assert b.is_alive()  # waiting for the blocks the first step writes
        finally:
            gate.set()
            a.join(60)
            b.join(60)
        assert not b.is_alive() and [i.key for i in out["b"]] == [store.key_for(kv[i], {"block": i}) for i in range(2, 8)]
        for i, info in zip(range(2, 8), out["b"]):
            assert torch.equal(store.get(info.key), kv[i])
        copies = {}
        for pack in packs_in(tmp_path):
            for key in store.backend.packs._load(pack[:-len(".kvjpack")]).members:
                copies[key] = copies.get(key, 0) + 1
        assert all(n == 1 for n in copies.values())  # no block written twice
        if first == "fails":
            assert len(errors) == 1 and "a" not in out and len(copies) == 2
            assert all(os.path.exists(store.backend.path(i.key)) for i in out["b"][:4])  # stored on their own
        else:
            assert not errors and len(copies) == 8
