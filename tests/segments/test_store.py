"""Segment store: keys, dedup without rewrites, durable ordering, corruption handling."""

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import torch

from kvj.errors import InvalidName, LayoutMismatch, SegmentCorrupt, SegmentMissing
from kvj.fileio import FS, DurabilityError
from kvj.segments.check import segment_problem
from kvj.segments.store import SegmentStore, check_key
from kvj.segments.uses import USES_NAME


class RecordingFS(FS):
    """Logs every mutating call as (op, path-or-fd-path)."""

    def __init__(self, log=None):
        self.log = [] if log is None else log
        self._paths = {}

    def open(self, path, flags, mode=0o600):
        fd = super().open(path, flags, mode)
        self._paths[fd] = os.fspath(path)
        self.log.append(("open", os.fspath(path)))
        return fd

    def write(self, fd, data):
        self.log.append(("write", self._paths.get(fd)))
        super().write(fd, data)

    def fsync(self, fd):
        self.log.append(("fsync", self._paths.get(fd)))
        super().fsync(fd)

    def fdatasync(self, fd):
        self.log.append(("fdatasync", self._paths.get(fd)))
        super().fdatasync(fd)

    def close(self, fd):
        self.log.append(("close", self._paths.pop(fd, None)))
        super().close(fd)

    def rename(self, src, dst):
        self.log.append(("rename", os.fspath(src), os.fspath(dst)))
        super().rename(src, dst)

    def unlink(self, path):
        self.log.append(("unlink", os.fspath(path)))
        super().unlink(path)

    def fsync_dir(self, path):
        self.log.append(("fsync_dir", os.fspath(path)))
        super().fsync_dir(path)


class FailingFS(RecordingFS):
    def __init__(self, fail_on):
        super().__init__()
        self.fail_on = fail_on

    def fsync(self, fd):
        self.log.append(("fsync", self._paths.get(fd)))
        if self.fail_on == "fsync":
            raise OSError(errno.EIO, "injected fsync failure")
        FS.fsync(self, fd)

    def write(self, fd, data):
        if self.fail_on == "write":
            raise OSError(errno.ENOSPC, "injected full disk")
        super().write(fd, data)


@pytest.fixture
def store(tmp_path):
    with SegmentStore(tmp_path / "store") as s:
        yield s


def _same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_put_get_info_round_trip(store):
    x = torch.randn(64, 33).to(torch.bfloat16)[:, 1:]  # non-contiguous
    info = store.put(x, layout={"model": "m", "layer": 3})
    assert check_key(info.key) == info.key == info.digest
    assert info.shape == (64, 32) and info.dtype == "bfloat16" and info.raw_size == 64 * 32 * 2
    assert _same_bytes(store.get(info.key), x)
    assert store.info(info.key) == info
    assert store.verify(info.key) == info
    assert store.exists(info.key) and list(store.keys()) == [info.key]
    assert info.key == store.key_for(x, {"layer": 3, "model": "m"})


def test_segment_info_to_dict_is_plain_data(store):
    info = store.put(torch.arange(10), layout={"model": "m"})
    d = info.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert msgpack.unpackb(msgpack.packb(d)) == d
    assert set(d) == {"key", "dtype", "shape", "codec", "raw_size", "stored_size", "digest", "layout"}


BAD_KEYS = ["../" + "a" * 61, "/etc/passwd", "a" * 63, "a" * 65, "A" * 64, "g" * 64, "", "a" * 63 + "/",
            "a" * 32 + ".." + "a" * 30, "٠" * 64, None, 12345, b"a" * 64, "a" * 63 + "\n"]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_keys_are_validated_before_they_become_paths(store, key):
    for op in (store.get, store.info, store.verify, store.exists, store.delete, store.quarantine):
        with pytest.raises(InvalidName):
            op(key)


def test_dedup_does_not_rewrite(tmp_path):
    fs = RecordingFS()
    with SegmentStore(tmp_path, fs=fs) as store:
        x = torch.randn(1000)
        info = store.put(x, layout={"model": "m"})
        path = store.backend.path(info.key)
        st1, bytes1 = os.stat(path), open(path, "rb").read()
        n_ops = len(fs.log)
        again = store.put(x.clone(), layout={"model": "m"})
        assert again == info
        # no open, write, rename or fsync of a segment at all: only the claim's append to the use log
        claim = fs.log[n_ops:]
        assert [op[0] for op in claim] == ["open", "write", "close"] and all(op[1].endswith(USES_NAME) for op in claim)
        st2 = os.stat(path)
        assert st1.st_ino == st2.st_ino and open(path, "rb").read() == bytes1
        other = store.put(x, layout={"model": "other"})  # same bytes, other model: own key
        assert other.key != info.key and len(list(store.keys())) == 2


@pytest.mark.parametrize("n", [300_000, 5_000_000], ids=["hash-first", "hash-while-writing"])
def test_durable_ordering_fsync_rename_dirsync(tmp_path, n):
    fs = RecordingFS()
    with SegmentStore(tmp_path, fs=fs) as store:
        fs.log.clear()
        info = store.put(torch.randn(n))
    final = store.backend.path(info.key)
    ops = fs.log
    tmp = next(op[1] for op in ops if op[0] == "open")
    assert os.path.dirname(tmp) == store.backend.tmp_dir
    i_write = max(i for i, op in enumerate(ops) if op == ("write", tmp))
    i_fsync = ops.index(("fsync", tmp))
    i_rename = ops.index(("rename", tmp, final))
    i_dir = ops.index(("fsync_dir", os.path.dirname(final)), i_rename)
    assert i_write < i_fsync < i_rename < i_dir
    assert ops.index(("close", tmp)) > i_dir  # the writer's lock on its temp file is held until then
    if n * 4 > 16 << 20:  # big segments are synced as they are written, overlapping compression
        assert ("fdatasync", tmp) in ops[:i_write]
    assert os.listdir(store.backend.tmp_dir) == []


def test_large_duplicate_is_not_rewritten(tmp_path):
    fs = RecordingFS()
    with SegmentStore(tmp_path, fs=fs) as store:
        x = torch.randn(1_500_000)  # 6 MiB: its key is computed while it is compressed
        info = store.put(x)
        path = store.backend.path(info.key)
        st1, bytes1 = os.stat(path), open(path, "rb").read()
        fs.log.clear()
        assert store.put(x.clone()) == info
        assert not [op for op in fs.log if op[0] in ("rename", "fsync", "fsync_dir")]
        assert os.stat(path).st_ino == st1.st_ino and open(path, "rb").read() == bytes1
        assert os.listdir(store.backend.tmp_dir) == []


HOLD_LOCK = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); " \
            "print('locked', flush=True); sys.stdin.read()"


def test_temp_files_no_writer_holds_are_cleaned_by_the_next_writer(tmp_path):
    """Liveness is the writer's flock on its temp file, not its pid: a writer in another PID
    namespace (its pid means nothing here) keeps its upload, an abandoned file goes."""
    with SegmentStore(tmp_path) as store:
        store.put(torch.ones(3))
        tmp_dir = store.backend.tmp_dir
    abandoned = os.path.join(tmp_dir, f"{os.getpid()}.abcdef.tmp")  # a live pid, but nobody holds it
    other_ns = os.path.join(tmp_dir, "999999999.abcdef.tmp")  # a pid dead here, its writer alive
    for p in (abandoned, other_ns):
        open(p, "wb").close()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, other_ns], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with SegmentStore(tmp_path) as store:
            assert sorted(os.listdir(tmp_dir)) == sorted(os.path.basename(p) for p in (abandoned, other_ns))
            store.get(next(store.keys()))  # reading cleans nothing
            assert len(os.listdir(tmp_dir)) == 2
            store.put(torch.zeros(5))  # the first write cleans
            assert os.listdir(tmp_dir) == [os.path.basename(other_ns)]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def _tree(root):
    """Every entry under ``root`` with what a write would change."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
    return out


class NoWritesFS(FS):
    """Fails every mutating call: a read-only mount."""

    def _refuse(self, *args, **kwargs):
        raise OSError(errno.EROFS, "read-only file system")

    open = write = writev = fsync = fdatasync = ftruncate = rename = unlink = mkdir = fsync_dir = _refuse


def test_opening_and_reading_a_store_writes_nothing(tmp_path):
    root = tmp_path / "s"
    with SegmentStore(root) as store:
        info = store.put(torch.randn(3000), layout={"model": "m"})
    open(os.path.join(root, "tmp", "999999999.abcdef.tmp"), "wb").close()  # a dead writer's upload
    before = _tree(root)
    with SegmentStore(root, fs=NoWritesFS()) as store:
        assert list(store.keys()) == [info.key] and store.exists(info.key)
        assert store.info(info.key) == info == store.verify(info.key)
        assert store.get(info.key, expect_layout={"model": "m"}).shape == (3000,)
    assert _tree(root) == before
    empty = tmp_path / "empty"
    os.mkdir(empty)
    with SegmentStore(empty, fs=NoWritesFS()) as store:
        assert list(store.keys()) == [] and not store.exists(info.key)
        with pytest.raises(SegmentMissing):
            store.get(info.key)
    assert os.listdir(empty) == []


@pytest.mark.parametrize("fail_on", ["fsync", "write"])
def test_failed_write_or_fsync_is_not_retried_and_poisons_the_store(tmp_path, fail_on):
    fs = FailingFS(fail_on)
    store = SegmentStore(tmp_path, fs=fs)
    x = torch.randn(1000)
    with pytest.raises(DurabilityError):
        store.put(x)
    assert [op for op in fs.log if op[0] == "fsync"].__len__() <= 1
    assert not list(store.keys())
    assert not [n for _, _, files in os.walk(tmp_path) for n in files]  # temp file removed
    assert not [op for op in fs.log if op[0] == "rename"]
    fs.fail_on = None
    with pytest.raises(DurabilityError):
        store.put(torch.randn(10))  # sticky: nothing after a failed fsync is durable
    store.close()


def test_corrupt_file_names_the_file_and_put_heals_it(store):
    x = torch.randn(5000)
    info = store.put(x)
    path = store.backend.path(info.key)
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0x10
    os.chmod(path, 0o600)
    open(path, "wb").write(bytes(data))
    with pytest.raises(SegmentCorrupt) as exc:
        store.get(info.key)
    assert path in str(exc.value)
    with pytest.raises(SegmentCorrupt):
        store.verify(info.key)
    healed = store.put(x)  # damaged copy is quarantined and written anew
    assert healed.key == info.key and _same_bytes(store.get(info.key), x)
    assert len(os.listdir(os.path.join(store.backend.root, "quarantine"))) == 1


def test_file_renamed_to_another_key_is_refused(store):
    a = store.put(torch.arange(100))
    b = store.put(torch.arange(100) + 1)
    os.replace(store.backend.path(a.key), store.backend.path(b.key))
    with pytest.raises(SegmentCorrupt, match="key"):
        store.get(b.key)
    with pytest.raises(SegmentCorrupt, match="key"):
        store.info(b.key)


def test_truncated_and_empty_files(store):
    info = store.put(torch.randn(2000))
    path = store.backend.path(info.key)
    data = open(path, "rb").read()
    for n in (0, 10, len(data) // 2, len(data) - 1):
        open(path, "wb").write(data[:n])
        with pytest.raises(SegmentCorrupt):
            store.get(info.key)
        with pytest.raises(SegmentCorrupt):
            store.info(info.key)


def test_layout_mismatch_is_refused(store):
    info = store.put(torch.zeros(4, 4), layout={"model": "llama", "block_size": 16})
    assert store.get(info.key, expect_layout={"block_size": 16, "model": "llama"}).shape == (4, 4)
    with pytest.raises(LayoutMismatch):
        store.get(info.key, expect_layout={"model": "qwen", "block_size": 16})
    with pytest.raises(LayoutMismatch):
        store.get(info.key, expect_layout={"model": "llama"})


def test_missing_delete_quarantine(store):
    info = store.put(torch.ones(3))
    store.delete(info.key)
    assert not store.exists(info.key)
    with pytest.raises(SegmentMissing):
        store.get(info.key)
    store.delete(info.key)  # idempotent
    info = store.put(torch.ones(3))
    where = store.quarantine(info.key)
    assert os.path.exists(where) and not store.exists(info.key)
    with pytest.raises(SegmentMissing):
        store.info(info.key)


def test_keys_ignores_strays(store):
    info = store.put(torch.ones(3))
    fan = os.path.dirname(store.backend.path(info.key))
    open(os.path.join(fan, "." + info.key + ".1.abcd.tmp"), "wb").close()
    open(os.path.join(fan, "README"), "wb").close()
    os.makedirs(os.path.join(store.backend.objects, "zz"))
    assert list(store.keys()) == [info.key]


def test_put_refuses_device_tensors_it_cannot_read(store):
    with pytest.raises(ValueError):
        store.put(torch.empty(3, device="meta"))


def test_a_dedup_hit_restarts_the_grace_period(tmp_path):
    """Compaction collects by age; a segment a new request just deduplicated against is young."""
    store = SegmentStore(str(tmp_path / "s"))
    t = torch.arange(1024, dtype=torch.float32)
    key = store.put(t).key
    path = store.backend.path(key)
    os.utime(path, (1, 1))
    assert store.stat(key).used == 1
    assert store.put(t.clone()).key == key
    assert store.stat(key).used > time.time() - 60
    store.close()


TRUNCATE_AFTER_GET = textwrap.dedent("""
    import os, sys
    import torch
    from kvj.segments import tensors
    from kvj.segments.store import SegmentStore

    with SegmentStore(sys.argv[1]) as store:
        x = torch.randn(1 << 20)
        key = store.put(x, codec="raw").key
        data = store.backend.get(key)
        os.truncate(store.backend.path(key), 4096)  # another process cuts the file under the reader
        _, got = tensors.decode_into(data, name=key)
        assert torch.equal(got, x)
    print("survived")
""")


def test_a_file_truncated_under_a_reader_is_no_sigbus(tmp_path):
    """Through a memory map, touching pages past a truncated file's end killed the process."""
    proc = subprocess.run([sys.executable, "-c", TRUNCATE_AFTER_GET, str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert "survived" in proc.stdout


def test_truncation_during_a_read_is_a_clear_error(store, monkeypatch):
    info = store.put(torch.randn(300_000))
    path = store.backend.path(info.key)
    real = os.preadv

    def shrinking(fd, buffers, offset):
        os.truncate(path, 1000)  # the file shrinks while the reader is in it
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", shrinking)
    for op in (store.get, store.verify):
        with pytest.raises(SegmentCorrupt, match="truncated") as exc:
            op(info.key)
        assert path in str(exc.value)


def test_a_media_error_is_a_clear_error_and_put_writes_a_good_copy(store, monkeypatch):
    x = torch.randn(300_000)
    info = store.put(x)
    real = os.preadv
    failing = [True]

    def eio(fd, buffers, offset):
        if failing[0]:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", eio)
    for op in (store.get, store.verify):
        with pytest.raises(SegmentCorrupt, match="Input/output error"):
            op(info.key)
    assert segment_problem(store, info.key)[0] == "segment-damaged"
    assert store.put(x) == info  # the unreadable copy is set aside and a good one written
    failing[0] = False
    assert torch.equal(store.get(info.key), x)
    assert len(os.listdir(os.path.join(store.backend.root, "quarantine"))) == 1


def test_a_segment_copied_between_stores_by_its_stored_bytes(tmp_path):
    """read_stored on one node, ingest_stored on another: what replication builds on."""
    with SegmentStore(tmp_path / "a") as a, SegmentStore(tmp_path / "b") as b:
        x = torch.randn(300_000).to(torch.bfloat16)
        info = a.put(x, layout={"model": "m"})
        data = bytes(a.read_stored(info.key))
        assert data == open(a.backend.path(info.key), "rb").read()
        assert b.ingest_stored(info.key, data) == info
        assert _same_bytes(b.get(info.key), x) and list(b.keys()) == [info.key]
        st = os.stat(b.backend.path(info.key))
        assert b.ingest_stored(info.key, data) == info  # already there: kept, not rewritten
        assert os.stat(b.backend.path(info.key)).st_ino == st.st_ino


def test_ingest_refuses_damaged_or_mislabelled_bytes_and_writes_nothing(tmp_path):
    with SegmentStore(tmp_path / "a") as a, SegmentStore(tmp_path / "b") as b:
        one, two = a.put(torch.arange(5000)), a.put(torch.arange(5000) + 1)
        data = a.read_stored(one.key)
        damaged = bytearray(data)
        damaged[40] ^= 1
        with pytest.raises(SegmentCorrupt):
            b.ingest_stored(one.key, bytes(damaged))
        with pytest.raises(SegmentCorrupt, match="key"):
            b.ingest_stored(two.key, data)  # good bytes under another key
        with pytest.raises(InvalidName):
            b.ingest_stored("../" + one.key[3:], data)
        assert list(b.keys()) == []


def test_ingest_after_a_failed_fsync_is_refused(tmp_path):
    with SegmentStore(tmp_path / "a") as a:
        key = a.put(torch.ones(100)).key
        data = a.read_stored(key)
    store = SegmentStore(tmp_path / "b", fs=FailingFS("fsync"))
    with pytest.raises(DurabilityError):
        store.ingest_stored(key, data)
    store.backend.fs.fail_on = None
    with pytest.raises(DurabilityError):
        store.ingest_stored(key, data)
    assert list(store.keys()) == []
    store.close()


def test_delete_many_removes_what_is_old_and_syncs_each_directory_once(tmp_path, monkeypatch):
    monkeypatch.setattr("kvj.segments.local.UNLINK_BATCH", 7)  # several holds of the lock
    class CountingFS(FS):
        def __init__(self):
            self.synced = []

        def fsync_dir(self, path):
            self.synced.append(os.fspath(path))
            super().fsync_dir(path)

    fs = CountingFS()
    with SegmentStore(str(tmp_path), fs=fs) as store:
        keys = [store.put(torch.full((4,), float(i))).key for i in range(40)]
        cutoff = time.time() + 1
        young = keys[7]
        os.utime(store.backend.path(young), (cutoff + 100, cutoff + 100))  # claimed after the listing
        fs.synced.clear()
        removed = store.delete_many(keys + ["f" * 64], older_than=cutoff)  # one absent key too
        assert removed == [k for k in keys if k != young]
        assert list(store.keys()) == [young]
        dirs = {os.path.dirname(store.backend.path(k)) for k in removed}
        assert sorted(fs.synced) == sorted(dirs)  # every directory that lost a file, once
        assert store.delete_many([young]) == [young] and not store.exists(young)


def test_a_tensor_stored_without_a_layout_has_one_key_however_it_is_stored(tmp_path):
    """Through ``Journal.flush``, ``SegmentStore.put`` and ``put_many`` alike: no layout is the
    empty one, so the same bytes are one segment and dedup finds them."""
    from kvj.journal.journal import Journal
    from kvj.journal.replay import replay

    t = torch.arange(64, dtype=torch.float32)
    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        j.start("r")
        j.flush("r", 0, t, token_range=(0, 16)).result()
    key = replay(path).requests["r"].segments[0].key
    with SegmentStore(os.path.join(path, "segments")) as store:
        [many] = store.put_many([(t.numpy().tobytes(), torch.float32, (64,), None)])
        assert many.key == store.put(t).key == store.put(t, layout={}).key == key
        assert list(store.keys()) == [key] and store.dedup_hits == 3


def test_a_closed_journal_or_store_says_it_is_closed(tmp_path):
    from kvj.errors import JournalClosed
    from kvj.journal.journal import Journal

    j = Journal.open(str(tmp_path / "j"))
    store = j.store
    j.close()
    assert j.store is store  # still there to look at, but it stores nothing more
    with pytest.raises(JournalClosed, match="closed"):
        store.put(torch.zeros(4))
    j = Journal.open(str(tmp_path / "j"))
    j.close()
    with pytest.raises(JournalClosed, match="closed"):
        j.store
