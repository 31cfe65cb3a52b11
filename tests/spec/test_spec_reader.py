"""The independent reader (``spec/reader.py``, written from the man pages alone) on files kvj
wrote through its public API and CLI: journals (every record type, rotation, a mirror, a
snapshot, a torn tail, version-1 files), segments of every codec and layout, each decoded and
compared with the tensors that were stored."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli_helpers import in_process

import kvj
from kvj.journal.config import CommitPolicy, default_store_path
from kvj.segments.store import SegmentStore
from spec import reader

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def read_all(path: str) -> tuple:
    """The journal and its store as the reader sees them, every segment record checked."""
    journal = reader.read_journal(str(path))
    store = reader.read_store(default_store_path(str(path)))
    reader.check_segment_records(journal, store)
    return journal, store


def same_as_kvj(journal: reader.Journal, path: str) -> None:
    """The reader's fold agrees with kvj's replay: requests in flight and their segments,
    checkpoint, deltas, allocations, counts."""
    mine = reader.fold(journal.records, journal.snapshot[1] if journal.snapshot else None)
    theirs = kvj.replay(path).to_dict(include_ended=False)
    assert {r["id"]: (r["start_lsn"], r["resume_position"], [(s["seg"], s["key"], s["tokens"], s["lsn"])
                                                               for s in r["segments"]], r.get("output", []))
            for r in theirs["requests"]} == \
        {rid: (r["start_lsn"], r["resume_position"], [(s["seg"], s["key"], list(s["tokens"]), s["lsn"])
                                                      for _, s in sorted(r["segments"].items())], r["output"])
         for rid, r in mine["requests"].items()}
    assert theirs["checkpoint"] == mine["checkpoint"] and theirs["deltas"] == mine["deltas"]
    assert theirs["allocations"] == {d: [a for _, a in sorted(v.items())]
                                     for d, v in sorted(mine["allocations"].items())}
    assert theirs["counts"] == mine["counts"]
    assert {r["id"]: r.get("reply") for r in theirs["requests"]} == {rid: r["reply"] for rid, r in mine["requests"].items()}
    assert {chain: (s["key"], s["lsn"]) for chain, s in theirs.get("cache", {}).items()} == \
        {chain: (s["key"], s["lsn"]) for chain, s in mine["cache"].items()}


# ---------------------------------------------------------------------------- journals


def test_every_record_type_over_rotated_files_reads_as_kvj_replays_it(tmp_path, capsys):
    path = str(tmp_path / "j")
    assert in_process(capsys, "init", "-j", path).returncode == 0
    store_key = None
    with kvj.Journal.open(path, policy=CommitPolicy(file_size_limit=400)) as j:
        j.start("r-1", "h", [1, 2, 3], {"user": "a", "nested": {"x": [1, 2.5, None]}})
        j.tokens("r-1", 3, [7, 8])
        j.tokens("r-1", 9, [9])  # not where its tokens end: ignored
        j.tokens("r-1", 5, [9, 10])
        info = j.store.put(torch.arange(64, dtype=torch.float32), layout={"model": "m"})
        store_key = info.key
        j.flush("r-1", 0, info=info, token_range=(0, 16)).result()
        j.flush("r-1", 1, torch.ones(4, 4), token_range=(16, 32), layout={"model": "m", "n": 2}).result()
        j.start("r-2", None, None, {})
        j.end("r-2", "cancelled")
        j.start("r-4", None, [5], {})
        j.handoff("r-4", "engine-b")
        j.append(kvj.RecordType.REPLY, {"id": "r-1", "status": "completed", "count": 2, "at": 1.5,
                                        "finish_reason": "stop", "stop_reason": 7})
        j.alloc("cuda:0", 0x1000, 4096, "kv:r-1")
        j.alloc("cuda:0", 0x9000, 512, "kv:r-2")
        j.free("cuda:0", 0x9000)
        j.checkpoint(10, {"w": store_key}, {"lr": 0.001})
        j.delta(11, 10, {"w": store_key}, {})
        j.epoch(1, 9, manifest="recovery/m.json", salvage={"lost": [3, 4], "id": "x"})
        j.sync()
    assert in_process(capsys, "record", "start", "r-3", "-j", path).returncode == 0
    assert in_process(capsys, "record", "end", "r-3", "--status", "ok", "-j", path).returncode == 0
    journal, store = read_all(path)
    assert len(journal.logs) >= 2 and journal.torn is None  # rotated: base_lsn continuity checked
    assert {r.rtype for r in journal.records} == set(reader.TYPES)
    assert all(r.time_ns for r in journal.records) and journal.logs[-1].version == 2
    assert set(store) == {r.payload["key"] for r in journal.records if r.rtype == 2} and store_key in store
    assert kvj.replay(path).requests["r-1"].reply["status"] == "completed"
    same_as_kvj(journal, path)


def test_a_torn_tail_and_mid_log_damage_are_found_where_kvj_finds_them(tmp_path):
    path = str(tmp_path / "j")
    with kvj.Journal.open(path, policy=CommitPolicy(file_size_limit=300)) as j:
        for i in range(12):
            j.start(f"r{i}", tokens=list(range(i)), durable=True)
    newest = sorted(p for p in os.listdir(path) if p.endswith(".log"))[-1]
    newest_path = os.path.join(path, newest)
    size = os.path.getsize(newest_path)
    assert size > 36 + 40  # a group to tear
    cut_short = os.path.join(path, f"{int(newest[:16]) + 1:016d}.log")  # a creation cut short
    with open(cut_short, "wb") as f:
        f.write(b"\x89KVJLOG\n" + bytes(12))
    os.chmod(cut_short, 0o600)
    tail = kvj.replay(path).tail
    assert reader.read_journal(path).torn == (cut_short, 0) == (tail["path"], tail["offset"])
    os.unlink(cut_short)

    with open(newest_path, "r+b") as f:
        f.truncate(size - 5)
    journal = reader.read_journal(path)
    tail = kvj.replay(path).tail
    assert journal.torn == (tail["path"], tail["offset"])
    assert journal.records[-1].lsn == kvj.replay(path).last_lsn

    sealed = os.path.join(path, sorted(p for p in os.listdir(path) if p.endswith(".log"))[0])
    with open(sealed, "r+b") as f:
        f.seek(36 + 32 + 24)  # inside the first record's payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(reader.SpecError, match="invalid group"):
        reader.read_journal(path)
    with pytest.raises(kvj.CorruptionError):
        kvj.replay(path)


def test_a_mirrored_journal_is_two_identical_readable_copies(tmp_path):
    path, mirror = str(tmp_path / "j"), str(tmp_path / "m")
    with kvj.Journal.open(path, mirror=mirror, policy=CommitPolicy(file_size_limit=300)) as j:
        for i in range(6):
            j.start(f"r{i}", tokens=[i], durable=True)
        j.end("r0", durable=True)
    first, second = reader.read_mirrored(path)
    assert [(r.lsn, r.payload) for r in first.records] == [(r.lsn, r.payload) for r in second.records]
    assert len(first.logs) > 1
    same_as_kvj(first, path)


def test_a_snapshot_holds_the_fold_of_the_records_it_replaced(tmp_path, capsys):
    path = str(tmp_path / "j")
    with kvj.Journal.open(path, policy=CommitPolicy(file_size_limit=300)) as j:
        for i in range(5):
            j.start(f"r{i}", f"h{i}", [i, i + 1], {"i": i})
            j.flush(f"r{i}", 0, torch.full((8,), float(i)), token_range=(0, 2), layout={"m": 1}).result()
        j.end("r1", "ok")
        j.alloc("cuda:0", 16, 32, "t")
        j.sync()
    with kvj.Journal.open(path, policy=CommitPolicy(file_size_limit=36)) as j:  # seals every file so far
        j.start("late", durable=True)
    before = reader.read_journal(path).records
    assert in_process(capsys, "compact", "-j", path, "--grace", "0").returncode == 0
    with kvj.Journal.open(path) as j:
        j.start("after", durable=True)
    journal, _ = read_all(path)
    lsn, body = journal.snapshot
    assert lsn == before[-1].lsn and [r.payload["id"] for r in journal.records] == ["after"]
    reader.check_snapshot_body(body, path)
    want, got = reader.fold(before), reader.fold([], body)
    for part in ("requests", "allocations", "checkpoint", "deltas", "epochs", "counts"):
        assert got[part] == want[part], part
    assert "r1" not in got["requests"] and body["ended_compacted"] == 1
    assert journal.logs[0].base_lsn <= lsn + 1
    same_as_kvj(journal, path)


def test_version_1_files_and_their_snapshot_from_kvj_0_1_0():
    path = os.path.join(TESTS, "journal", "data", "journal-0.1.0")
    journal = reader.read_journal(path, modes=False)  # git keeps no file modes
    assert {log.version for log in journal.logs} == {1} and journal.snapshot is not None
    assert all(r.time_ns is None for r in journal.records)
    reader.check_snapshot_body(journal.snapshot[1], path)
    same_as_kvj(journal, path)


# ---------------------------------------------------------------------------- segments


@pytest.mark.parametrize("codec", ["raw", "zstd", "byteplane", "auto"])
def test_kvj_flush_segments_decode_with_every_codec(tmp_path, capsys, codec):
    path = str(tmp_path / "j")
    assert in_process(capsys, "init", "-j", path).returncode == 0
    gen = torch.Generator().manual_seed(23)
    tensors = {"a.npy": (torch.randn(3, 16, 64, generator=gen) * 0.01).to(torch.bfloat16),
               "b.npy": torch.randn(2, 16, 5, 3, generator=gen, dtype=torch.float64),
               "c.npy": torch.randint(-50, 50, (16, 300), generator=gen, dtype=torch.int32)}
    for name, t in tensors.items():
        dest = str(tmp_path / name)
        if t.dtype == torch.bfloat16:
            torch.save({"x": t}, dest.replace(".npy", ".pt"))
        else:
            np.save(dest, t.numpy())
    files = [str(tmp_path / n).replace(".npy", ".pt") if t.dtype == torch.bfloat16 else str(tmp_path / n)
             for n, t in tensors.items()]
    for i, name in enumerate(files):  # a request's blocks share dtype and shape: one request each
        assert in_process(capsys, "record", "start", f"r{i}", "-j", path).returncode == 0
        done = in_process(capsys, "flush", "-j", path, "-r", f"r{i}", "--block-tokens", "16", "--codec", codec,
                          "--layout", "model=m", "--layout", "block=16", name)
        assert done.returncode == 0, done.stderr
    assert in_process(capsys, "flush", "-j", path, "--checkpoint", "7", "--codec", codec, *files).returncode == 0
    journal, store = read_all(path)
    segs = [store[r.payload["key"]] for r in journal.records if r.rtype == 2]
    assert [s.raw for s in segs] == [raw_bytes(t) for t in tensors.values()]
    assert [(s.dtype, s.shape) for s in segs] == [(dtype_name(t), list(t.shape)) for t in tensors.values()]
    if codec != "auto":
        assert {s.header["codec"] for s in store.values()} == {codec}
    assert all(s.layout == {"model": "m", "block": 16} for s in segs)
    (ckpt,) = [r for r in journal.records if r.rtype == 6]
    assert sorted(store[k].raw for k in ckpt.payload["keys"].values()) == sorted(map(raw_bytes, tensors.values()))
    same_as_kvj(journal, path)


def test_row_dedup_segments_rebuild_their_rows(tmp_path, capsys):
    """A tensor of 2 MiB or more whose rows repeat (a shared prefix) is stored with the dedup map."""
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randn(64, 8, 128, generator=gen).to(torch.bfloat16)
    t = torch.cat([prefix, prefix, torch.randn(64, 8, 128, generator=gen).to(torch.bfloat16), prefix] * 4)
    assert t.numel() * 2 >= 2 << 20
    path = str(tmp_path / "j")
    assert in_process(capsys, "init", "-j", path).returncode == 0
    torch.save({"kv": t}, str(tmp_path / "kv.pt"))
    for codec in ("raw", "zstd", "byteplane"):
        assert in_process(capsys, "flush", "-j", path, "--checkpoint", "1", "--codec", codec,
                          "--layout", f"c={codec}", str(tmp_path / "kv.pt")).returncode == 0
    _, store = read_all(path)
    assert len(store) == 3
    for seg in store.values():
        assert seg.header["dedup"] is not None and seg.header["payload_size"] < seg.header["raw_size"] // 3
        assert seg.raw == raw_bytes(t)


_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(_DTYPES), shape=st.lists(st.integers(0, 40), max_size=3),
       codec=st.sampled_from(["raw", "zstd", "byteplane", "auto"]), seed=st.integers(0, 2 ** 32 - 1),
       smooth=st.booleans())
def test_any_tensor_kvj_stores_decodes_to_its_bytes(tmp_path_factory, dtype, shape, codec, seed, smooth):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen, dtype=torch.float64) * (0.001 if smooth else 50)
    t = (base.to(torch.complex128) * (1 + 1j) if dtype.is_complex else base).to(dtype)
    root = str(tmp_path_factory.mktemp("store"))
    with SegmentStore(root) as store:
        info = store.put(t, codec=codec, layout={"x": [1, 0.5, 1e-07, "é"], "y": None})
    seg = reader.read_segment(os.path.join(root, "objects", info.key[:2], f"{info.key}.kvjseg"))
    assert seg.raw == raw_bytes(t) and seg.key == info.key and seg.shape == list(shape)


def test_damaged_segment_bytes_are_refused(tmp_path):
    with SegmentStore(str(tmp_path)) as store:
        info = store.put(torch.randn(5000), codec="zstd")
    path = os.path.join(str(tmp_path), "objects", info.key[:2], f"{info.key}.kvjseg")
    data = bytearray(open(path, "rb").read())
    reader.read_segment(path, bytes(data))
    for at, why in ((100, "chunk 0 CRC mismatch"), (len(data) - 20, "header CRC mismatch"),
                    (len(data) - 3, "no end magic"), (3, "bad magic")):
        bad = bytearray(data)
        bad[at] ^= 1
        with pytest.raises(reader.SpecError, match=why):
            reader.read_segment(path, bytes(bad))


# ---------------------------------------------------------------------------- layouts


def test_kv_blocks_of_the_block_journal(tmp_path):
    from kvj.integrations.blocks import BlockJournal, resume_points
    from kvj.segments.kvblock import KVBlockLayout

    layout = KVBlockLayout("tiny-llama", layers=2, kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)
    path = str(tmp_path / "j")
    prompt = [5, 6, 7, 8, 9, 10]
    tokens = prompt + [11, 12, 13, 14, 15]
    blocks = [torch.randn(layout.shape, generator=gen).to(torch.bfloat16) for _ in range(2)]
    with kvj.Journal.open(path) as j:
        bj = BlockJournal(j, layout)
        bj.start("req", prompt, max_new_tokens=8)
        for b, block in enumerate(blocks):
            bj.flush("req", b, block, tokens[b * 4:(b + 1) * 4 + 1]).result()
        bj.start("other", prompt[:4], max_new_tokens=1)
        bj.flush("other", 0, blocks[0], tokens[:5]).result()  # the same block: the same key
        bj.end("other")
        j.sync()
    journal, store = read_all(path)
    segs = [store[r.payload["key"]] for r in journal.records if r.rtype == 2]
    assert [reader.check_layout(s) for s in segs] == ["kvj-kv-block/2"] * 3 and len(store) == 2
    assert [s.raw for s in segs] == [raw_bytes(blocks[0]), raw_bytes(blocks[1]), raw_bytes(blocks[0])]
    start = next(r.payload for r in journal.records if r.rtype == 1)
    import hashlib
    assert start["prompt_hash"] == hashlib.sha256(np.asarray(prompt, "<i8").tobytes()).hexdigest()
    assert {"max_new_tokens", "block_size", "model"} <= set(start["meta"])
    (point,) = resume_points(kvj.replay(path), layout)
    assert point.position == reader.fold(journal.records)["requests"]["req"]["resume_position"] == 8


def test_paged_kv_blocks_gathered_from_a_paged_cache(tmp_path):
    from kvj.segments.kvblock import gather_block, paged_layout, restore_paged

    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn(6, 2, 4, 2, 8, generator=gen).to(torch.float16) for _ in range(3)]
    layout = paged_layout("m", caches)
    path = str(tmp_path / "j")
    with kvj.Journal.open(path) as j:
        j.start("r")
        infos = [j.store.put(gather_block(caches, b), layout=layout) for b in (4, 1)]
        for i, info in enumerate(infos):
            j.flush("r", i, info=info, token_range=(4 * i, 4 * i + 4)).result()
        j.sync()
        journal, store = read_all(path)
        for info, b in zip(infos, (4, 1)):
            seg = store[info.key]
            assert reader.check_layout(seg) == "kvj-kv-block/2" and seg.layout["order"] == "L2NHD"
            assert seg.raw == b"".join(raw_bytes(c[b]) for c in caches)
        fresh = [torch.zeros_like(c) for c in caches]
        restore_paged(j.store, [i.key for i in infos], fresh, [0, 5], model="m")
        assert all(torch.equal(f[0], c[4]) and torch.equal(f[5], c[1]) for f, c in zip(fresh, caches))


def _leaves_match(saved: Any, got: Any, where: str = "") -> None:
    """A state as saved and the reader's rebuilt tree: tensors and arrays as (dtype, shape, bytes)."""
    if isinstance(saved, torch.Tensor):
        assert got == (dtype_name(saved), list(saved.shape), raw_bytes(saved)), where
    elif isinstance(saved, np.ndarray):
        assert got[1] == list(saved.shape) and got[2] == np.ascontiguousarray(saved).tobytes(), where
    elif isinstance(saved, dict):
        assert set(saved) == set(got), where
        for k in saved:
            _leaves_match(saved[k], got[k], f"{where}/{k}")
    elif isinstance(saved, (list, tuple)):
        assert type(saved) is type(got) and len(saved) == len(got), where
        for i, (a, b) in enumerate(zip(saved, got)):
            _leaves_match(a, b, f"{where}[{i}]")
    else:
        assert saved == got, where


def test_training_full_and_xor_streams_rebuild_the_saved_state(tmp_path):
    from kvj.integrations.training import StateJournal, training_state

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = str(tmp_path / "j")
    noise = torch.Generator().manual_seed(4)
    with kvj.Journal.open(path) as j, StateJournal(j, full_every=5, model="mlp") as sj:
        for step in range(5, 9):  # step 5 is a checkpoint, 6..8 deltas against it
            model(torch.randn(4, 128)).sum().backward()
            opt.step()
            opt.zero_grad()
            # random bytes: their XOR never pays, so the third delta stores them whole
            state = {**training_state(model, opt, step=step, data={"epoch": 0, "seen": step * 4}),
                     "noise": torch.randint(0, 256, (70_000,), generator=noise, dtype=torch.uint8)}
            sj.save(step, state)
    journal, store = read_all(path)
    formats = {s.layout["format"] for s in store.values()}
    assert formats == {"kvj-train/2", "kvj-train-full/1", "kvj-train-xor/1"}
    newest = [r for r in journal.records if r.rtype == 7][-1].payload
    assert newest["step"] == 8 and "noise.uint8" in newest["meta"]["whole"]
    step, tree = reader.training_state(journal, store)
    assert step == 8
    _leaves_match(state, tree)


def test_dcp_shards_and_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    from kvj.integrations.dcp import JournalWriter

    gen = torch.Generator().manual_seed(5)
    state = {"model": {"w": torch.randn(64, 48, generator=gen), "b": torch.randn(48, generator=gen).to(torch.bfloat16)},
             "step": torch.tensor(12), "epoch": 3}
    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves in one process, with no process group
        dcp.save(state, storage_writer=JournalWriter(path, step=12, model="mlp"))
    journal, store = read_all(path)
    step, md, items = reader.dcp_checkpoint(journal, store)
    assert step == 12 and set(md["entries"]) == {"model.w", "model.b", "step", "epoch"}
    by_fqn = {s.layout["fqn"]: s for s in items}
    for fqn, t in (("model.w", state["model"]["w"]), ("model.b", state["model"]["b"]), ("step", state["step"])):
        seg = by_fqn[fqn]
        assert (seg.layout["kind"], seg.dtype, seg.shape, seg.raw) == ("tensor", dtype_name(t), list(t.shape),
                                                                       raw_bytes(t))
        assert md["entries"][fqn]["dtype"] == dtype_name(t) and md["entries"][fqn]["size"] == list(t.shape)
    assert by_fqn["epoch"].layout["kind"] == "bytes" and md["entries"]["epoch"] == {"bytes": True}
    assert torch.load(__import__("io").BytesIO(by_fqn["epoch"].raw), weights_only=True) == 3


def test_the_reader_imports_nothing_from_kvj():
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import spec.reader; "
            "print(sorted(m for m in sys.modules if m == 'kvj' or m.startswith('kvj.')))")
    out = subprocess.run([sys.executable, "-c", code, TESTS], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_stream_of_16_byte_elements_is_stored_whole_in_deltas(tmp_path):
    """complex128 has no integer of its size to XOR as: each delta failed with a KeyError."""
    from kvj.integrations.training import StateJournal

    gen = torch.Generator().manual_seed(9)
    z = torch.randn(8192, generator=gen, dtype=torch.complex128)
    w = torch.randn(20_000, generator=gen)
    path = str(tmp_path / "j")
    with kvj.Journal.open(path) as j, StateJournal(j, full_every=10, model="m") as sj:
        for step in range(3):
            state = {"z": z * (1 + step * 1e-6), "w": w + step * 1e-6}
            sj.save(step, state)
    journal, store = read_all(path)
    assert [r.payload["meta"]["whole"] for r in journal.records if r.rtype == 7] == [["z.complex128"]] * 2
    step, tree = reader.training_state(journal, store)
    assert step == 2
    _leaves_match(state, tree)


def test_packed_segments_read_from_the_page_and_a_dead_member_is_left_out(tmp_path):
    """A batch stored by put_many is one pack (PACKS): the reader lists it from its tail, checks
    every member as a segment file, and leaves out what the dead list names."""
    g = torch.Generator().manual_seed(31)
    tensors = [torch.randn(4, 64, generator=g).to(torch.bfloat16) for _ in range(3)]
    root = str(tmp_path / "store")
    with SegmentStore(root) as store:
        infos = store.put_many([(raw_bytes(t), t.dtype, t.shape, {"i": i}) for i, t in enumerate(tensors)])
        assert os.listdir(os.path.join(root, "packs")) and not os.path.isdir(os.path.join(root, "objects"))
        store.delete(infos[1].key)
    found = reader.read_store(root)
    assert set(found) == {infos[0].key, infos[2].key}
    for i in (0, 2):
        assert found[infos[i].key].raw == raw_bytes(tensors[i]) and found[infos[i].key].layout == {"i": i}
