"""Garbage collection against dedup: a segment a writer has just claimed is never collected.

A writer's dedup hit (exists, verify, claim) and a collector's age check and unlink exclude
each other through the store's collection lock, in any process: either the claim comes first
(the segment is young again and survives) or the unlink does (the writer finds it gone and
writes it anew). Either way no record points at a deleted segment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from support.wait import wait_for

import kvj
from kvj.fileio import FS
from kvj.journal.config import default_store_path
from kvj.ops.compact import compact
from kvj.ops.recover import recover
from kvj.segments.local import GC_LOCK
from kvj.segments.flusher import Flusher
from kvj.segments.store import SegmentStore

N = 6


def block(i: int) -> torch.Tensor:
    return torch.randn(2, 16, 2, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


# The writer: for each round n, waits for the collector's go-n (naming the block the collector
# is deleting at that moment), flushes that block through Journal.flush (dedup hit or not, as
# the store decides), syncs, and reports done-n.
WRITER = textwrap.dedent("""
    import os, sys, time
    import torch
    from kvj.journal.journal import Journal

    jdir, sig, n_rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def block(i):
        return torch.randn(2, 16, 2, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)

    with Journal.open(jdir) as j:
        j.start("req", tokens=[1, 2, 3], durable=True)
        open(os.path.join(sig, "ready"), "w").close()
        for n in range(n_rounds):
            go = os.path.join(sig, f"go-{n}")
            while not os.path.exists(go):
                time.sleep(0.001)
            i = int(open(go).read())
            j.flush("req", n, block(i), token_range=(16 * n, 16 * n + 16)).result()
            j.sync()
            with open(os.path.join(sig, f"done-{n}.tmp"), "w") as f:
                f.write("ok")
            os.rename(os.path.join(sig, f"done-{n}.tmp"), os.path.join(sig, f"done-{n}"))
""")


def _blocked_on(path: str) -> bool:
    """Whether some process waits for an flock on ``path`` (a ``->`` line in /proc/locks)."""
    st = os.stat(path)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    with open("/proc/locks") as f:
        return any("->" in line and ident in line for line in f)


class HandOffFS(FS):
    """The collector's file layer: right before it unlinks a segment (its age already checked),
    it has the writer flush that very block, and waits until the writer is done or is held
    back by the collection lock."""

    def __init__(self, store_root: str, sig: str, index_of: dict, writer: subprocess.Popen):
        self.store_root, self.sig, self.index_of, self.writer = store_root, sig, index_of, writer
        self.rounds = 0

    def unlink(self, path):
        key = os.path.basename(path).split(".")[0]
        if path.endswith(".kvjseg") and key in self.index_of:
            n = self.rounds
            self.rounds += 1
            with open(os.path.join(self.sig, f"go-{n}.tmp"), "w") as f:
                f.write(str(self.index_of[key]))
            os.rename(os.path.join(self.sig, f"go-{n}.tmp"), os.path.join(self.sig, f"go-{n}"))
            lock = os.path.join(self.store_root, GC_LOCK)
            wait_for(lambda: os.path.exists(os.path.join(self.sig, f"done-{n}"))
                     or (os.path.exists(lock) and _blocked_on(lock)) or self.writer.poll() is not None,
                     f"the writer's flush of block {self.index_of[key]} (round {n})")
        super().unlink(path)


def test_dedup_during_collection_never_leaves_a_record_without_its_segment(tmp_path):
    j, sig = str(tmp_path / "j"), str(tmp_path / "sig")
    os.makedirs(sig)
    store_root = default_store_path(j)
    with SegmentStore(store_root) as store:
        index_of = {store.put(block(i), layout={}).key: i for i in range(N)}
        for key in index_of:
            os.utime(store.backend.path(key), (1, 1))  # old and unreferenced: collectable
    writer = subprocess.Popen([sys.executable, "-c", WRITER, j, sig, str(N)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.exists(os.path.join(sig, "ready")) or writer.poll() is not None, "the writer")
        fs = HandOffFS(store_root, sig, index_of, writer)
        result = compact(j, grace=3600, fs=fs)
        out, err = writer.communicate(timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == 0, err
    assert fs.rounds == N  # the writer flushed each block while the collector was deleting it
    assert sorted(result.segments_removed) == sorted(index_of)
    state = kvj.replay(j)
    referenced = set(state.referenced_keys())
    assert referenced == set(index_of)
    with SegmentStore(store_root) as store:
        for key in referenced:
            assert store.exists(key), f"a durable record points at collected segment {key}"
            store.verify(key)
    assert recover(j, dry_run=True).manifest["segments_unusable"] == 0


def test_an_unlink_between_exists_and_get_is_not_a_flusher_error(tmp_path):
    """The copy found by exists() vanishes before it is read: the put writes it anew."""
    with SegmentStore(tmp_path) as store, Flusher(store) as fl:
        x = block(7)
        key = store.put(x).key
        backend = store.backend
        real_exists = backend.exists

        def exists_then_vanish(k):
            found = real_exists(k)
            if found and k == key:
                os.unlink(backend.path(k))  # a collector in another process, right after the check
            return found

        backend.exists = exists_then_vanish
        info = fl.submit(x).result(timeout=60)
        assert info.key == key and fl.error is None
        fl.drain()
        backend.exists = real_exists
        assert torch.equal(store.get(key), x)
        assert torch.equal(store.get(fl.submit(x + 1).result(timeout=60).key), x + 1)  # not sticky


def test_a_claimed_segment_is_not_collected_and_a_collected_one_is_not_claimed(tmp_path):
    with SegmentStore(tmp_path) as store:
        key = store.put(block(1)).key
        os.utime(store.backend.path(key), (1, 1))
        assert store.backend.touch(key)  # claimed now
        assert not store.delete(key, older_than=1000.0) and store.exists(key)
        os.utime(store.backend.path(key), (1, 1))
        assert store.delete(key, older_than=1000.0) and not store.exists(key)
        assert not store.backend.touch(key)
        hits = store.dedup_hits
        store.put(block(1))
        assert store.exists(key) and store.dedup_hits == hits
        store.put(block(1))
        assert store.dedup_hits == hits + 1
