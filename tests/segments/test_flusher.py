"""Flush path: snapshot on submit, durable before on_durable, bounded staging, sticky errors."""

import errno
import os
import threading
import time

import pytest
import torch

from kvj.errors import JournalClosed
from kvj.fileio import FS, DurabilityError
from kvj.segments.codecs import Backpressure
from kvj.segments.codecs.raw import RawCodec
from kvj.segments.flusher import Flusher
from kvj.segments.staging import StagingPool
from kvj.segments.store import SegmentStore


class LoggingFS(FS):
    def __init__(self, log, delay=0.0, fail=False):
        self.log, self.delay, self.fail = log, delay, fail
        self.lock = threading.Lock()

    def fsync(self, fd):
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise OSError(errno.EIO, "injected")
        super().fsync(fd)

    def rename(self, src, dst):
        super().rename(src, dst)
        with self.lock:
            self.log.append(("rename", os.path.basename(dst)))

    def fsync_dir(self, path):
        super().fsync_dir(path)
        with self.lock:
            self.log.append(("fsync_dir", os.fspath(path)))


def test_submit_snapshots_and_reports_after_durability(tmp_path):
    log = []
    fs = LoggingFS(log)
    with SegmentStore(tmp_path, fs=fs) as store, Flusher(store, workers=2, staging_bytes=1 << 20) as fl:
        tensors = [torch.randn(4096) for _ in range(6)]
        originals = [t.clone() for t in tensors]

        def on_durable(info):
            path = store.backend.path(info.key)
            assert os.path.exists(path)
            with fs.lock:
                log.append(("durable", info.key))

        futures = [fl.submit(t, {"model": "m"}, on_durable) for t in tensors]
        for t in tensors:
            t.fill_(7.0)  # the caller may reuse its buffer at once
        infos = [f.result(timeout=30) for f in futures]
        fl.drain()
    for info, orig in zip(infos, originals):
        assert torch.equal(store.get(info.key), orig)
        name = info.key + ".kvjseg"
        i_rename = log.index(("rename", name))
        i_durable = log.index(("durable", info.key))
        fan_dir = os.path.dirname(store.backend.path(info.key))
        assert any(op == ("fsync_dir", fan_dir) for op in log[i_rename:i_durable])


def test_non_contiguous_and_zero_size(tmp_path):
    with SegmentStore(tmp_path) as store, Flusher(store) as fl:
        x = torch.arange(60, dtype=torch.int32).reshape(6, 10).t()
        e = torch.empty(0, 3, dtype=torch.float16)
        ix, ie = fl.submit(x).result(), fl.submit(e).result()
        assert torch.equal(store.get(ix.key), x) and store.get(ie.key).shape == (0, 3)


class SlowRaw(RawCodec):
    """A codec that is the bottleneck: 20 ms per chunk."""

    def encode(self, buf, itemsize):
        time.sleep(0.02)
        return super().encode(buf, itemsize)


def _spy_pressure(store):
    levels = []
    orig = store.put_bytes

    def spy(raw, **kw):
        levels.append(kw["pressure"])
        return orig(raw, **kw)

    store.put_bytes = spy
    return levels


def test_staging_is_bounded_and_submit_blocks_on_a_slow_disk(tmp_path):
    fs = LoggingFS([], delay=0.02)
    capacity = 64 << 10
    with SegmentStore(tmp_path, fs=fs) as store:
        fl = Flusher(store, workers=1, staging_bytes=capacity)
        levels = _spy_pressure(store)
        t0 = time.monotonic()
        futures = [fl.submit(torch.full((4096,), float(i))) for i in range(24)]  # 16 KiB each
        fl.drain()
        assert all(f.done() and f.exception() is None for f in futures)
        assert fl.staging.peak_in_use <= capacity
        assert time.monotonic() - t0 >= 0.02 * 24 * 0.8  # submit waited for the slow disk
        # the disk is the bottleneck: compressing costs nothing and saves writes, so no step-down
        assert set(levels) == {Backpressure.NORMAL}
        fl.close()


class NoSyncFS(FS):
    """A disk that is never the bottleneck (fsyncs cost nothing), whatever the machine's load."""

    def fsync(self, fd):
        pass

    def fdatasync(self, fd):
        pass

    def fsync_dir(self, path):
        pass


def test_codec_steps_down_when_compression_is_the_bottleneck(tmp_path):
    with SegmentStore(tmp_path, fs=NoSyncFS()) as store:
        fl = Flusher(store, workers=1, staging_bytes=1 << 20, codec=SlowRaw())
        levels = _spy_pressure(store)
        futures = [fl.submit(torch.full((1024,), float(i))) for i in range(12)]
        fl.drain()
        assert all(f.exception() is None for f in futures)
        assert Backpressure.SATURATED in levels and levels[0] == Backpressure.NORMAL
        assert fl.pressure.level == Backpressure.NORMAL  # back to normal once drained
        fl.close()


def test_oversized_tensor_does_not_deadlock(tmp_path):
    with SegmentStore(tmp_path) as store, Flusher(store, staging_bytes=4096) as fl:
        x = torch.randn(10_000)
        assert torch.equal(store.get(fl.submit(x).result(timeout=30).key), x)


def test_worker_error_reaches_future_and_is_sticky(tmp_path):
    calls = []
    fs = LoggingFS([], fail=True)
    with SegmentStore(tmp_path, fs=fs) as store:
        fl = Flusher(store)
        fut = fl.submit(torch.randn(100), on_durable=calls.append)
        with pytest.raises(DurabilityError):
            fut.result(timeout=30)
        assert calls == []  # never reported durable
        with pytest.raises(DurabilityError):
            fl.submit(torch.randn(100))
        with pytest.raises(DurabilityError):
            fl.drain()
        fl.close()
        with pytest.raises(JournalClosed):
            fl.submit(torch.randn(1))


def test_callback_error_propagates_and_only_io_errors_are_sticky(tmp_path):
    """A refused input fails only its own flush; a failed write or fsync is final (issue 9 item 7)."""
    import errno

    def refuse(info):
        raise ValueError("journal append refused")

    def eio(info):
        raise OSError(errno.EIO, "injected EIO")

    with SegmentStore(tmp_path) as store, Flusher(store) as fl:
        with pytest.raises(ValueError):
            fl.submit(torch.ones(4), on_durable=refuse).result(timeout=30)
        assert fl.submit(torch.ones(5)).result(timeout=30).raw_size == 20
        fl.drain()
        with pytest.raises(OSError):
            fl.submit(torch.ones(4), on_durable=eio).result(timeout=30)
        with pytest.raises(OSError):
            fl.submit(torch.ones(4))
        with pytest.raises(OSError):
            fl.drain()


def test_staging_pool_reuses_buffers():
    pool = StagingPool(1 << 20)
    a = pool.acquire(1000)
    ptr = a.data_ptr()
    pool.release(a)
    b = pool.acquire(900)  # same size class
    assert b.data_ptr() == ptr and pool.in_use == b.numel()
    pool.release(b)
    assert pool.in_use == 0


def test_every_dtype_strided_and_scalar(tmp_path):
    from kvj.segments.tensors import DTYPES

    with SegmentStore(tmp_path) as store, Flusher(store) as fl:
        for dt in DTYPES.values():
            raw = torch.randint(0, 2 if dt == torch.bool else 256, (6, 10 * dt.itemsize), dtype=torch.uint8)
            x = raw.view(dt).t()
            got = store.get(fl.submit(x).result(timeout=30).key)
            assert torch.equal(got.contiguous().view(torch.uint8), x.contiguous().view(torch.uint8)), dt
        assert store.get(fl.submit(torch.tensor(3.5)).result().key).item() == 3.5


def test_durable_writes_of_several_blocks_overlap(tmp_path):
    """A stream of small blocks is not one fsync latency per block: several workers wait in
    fsync at once (and the file system commits them together)."""
    meeting = threading.Barrier(4, timeout=30)

    class MeetingFS(FS):
        def fsync(self, fd):
            meeting.wait()  # returns only once four fsyncs are in flight together
            super().fsync(fd)

    with SegmentStore(tmp_path, fs=MeetingFS()) as store, Flusher(store) as fl:
        # Blocks whose keys share one of the store's striped key locks write one after the
        # other (a later one would wait for an earlier one still at the meeting): take eight
        # blocks on eight different locks, so any four can meet.
        blocks: dict = {}
        for i in range(256):
            block = torch.full((1024,), float(i))
            blocks.setdefault(id(store._key_lock(store.key_for(block))), block)
        chosen = list(blocks.values())[:8]
        assert len(chosen) == 8
        futures = [fl.submit(block) for block in chosen]
        infos = [f.result(timeout=120) for f in futures]
    assert len({i.key for i in infos}) == 8 and not meeting.broken
