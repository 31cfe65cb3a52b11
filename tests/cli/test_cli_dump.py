"""kvj dump (a segment to .npy, .safetensors or .pt, verified) and kvj inspect --segment (its
header and users, without decoding it)."""

from __future__ import annotations

import json
import os

import numpy
import pytest
import torch
from support.cli_helpers import assert_fails, block, build, flip_byte, in_process, kvj, segment_file, tree

import kvj as kvj_lib

USAGE, DATAERR, NOINPUT = 64, 65, 66


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    path = tmp_path_factory.mktemp("dump") / "j"
    written = build(str(path))
    return path, written


@pytest.fixture
def cli(capsys):
    return lambda *args: in_process(capsys, *args)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_dump_by_request_and_segment_to_each_format(tmp_path, journal, cli):
    path, _ = journal
    before = tree(path)
    want = block(0, 1)  # what build() flushed as req-0's segment 1
    for fmt in (".pt", ".safetensors"):
        target = tmp_path / f"seg{fmt}"
        proc = cli("dump", "-j", path, "-r", "req-0", "--segment", "1", "-o", target, "--json")
        assert proc.returncode == 0, proc.stderr
        row = json.loads(proc.stdout)
        assert row["verified"] and row["users"] == [{"request": "req-0", "segment": 1, "tokens": [16, 32], "lsn": 3,
                                                      "ended": False}]
        if fmt == ".pt":
            got = torch.load(target, weights_only=True)
        else:
            from safetensors.torch import load_file

            got = load_file(str(target))["req-0.1"]
        assert _same(got, want)
    assert tree(path) == before  # the journal and store are only read


def test_dump_a_training_tensor_by_key_prefix_to_npy_through_the_real_entry_point(tmp_path, journal):
    path, written = journal
    key = written["training"]["w"]
    target = tmp_path / "w.npy"
    proc = kvj("dump", key[:10], "-j", path, "-o", target)
    assert proc.returncode == 0, proc.stderr
    assert "training step 10 w" in proc.stdout and "verified" in proc.stdout
    assert numpy.array_equal(numpy.load(target), numpy.arange(64, dtype=numpy.float32).reshape(8, 8))


def test_dump_refuses_what_it_cannot_do(tmp_path, journal, cli):
    path, written = journal
    key = written["keys"]["req-0"][0]
    target = tmp_path / "x.npy"
    assert_fails(cli("dump", key, "-j", path, "-o", target), USAGE, "numpy has no bfloat16")
    assert_fails(cli("dump", key[:5], "-j", path, "-o", tmp_path / "x.pt"), USAGE, "at least 8 hex digits")
    assert_fails(cli("dump", "ffffffffff", "-j", path, "-o", tmp_path / "x.pt"), NOINPUT, "no segment key begins")
    assert_fails(cli("dump", key, "-j", path, "-o", tmp_path / "x.txt"), USAGE, ".npy, .safetensors or .pt")
    assert_fails(cli("dump", "-j", path, "-r", "req-0", "--segment", "9", "-o", tmp_path / "x.pt"), USAGE,
                 "no segment 9 of request req-0")
    assert_fails(cli("dump", key, "-j", path), USAGE, "--output")
    assert not any(p.name.startswith("x") for p in tmp_path.iterdir())


def test_a_damaged_segment_is_not_dumped_but_its_header_still_shows(tmp_path, cli):
    path = tmp_path / "j"
    written = build(str(path), requests=1, blocks=2, ended=0, training=False)
    key = written["keys"]["req-0"][1]
    seg = segment_file(str(path), key)
    flip_byte(seg, os.path.getsize(seg) - 100)  # in the first chunk's data; the header is at the end
    target = tmp_path / "bad.pt"
    assert_fails(cli("dump", key, "-j", path, "-o", target), DATAERR, key)
    assert not target.exists()
    proc = cli("inspect", "-j", path, "--segment", key[:12])
    assert proc.returncode == 0, proc.stderr
    assert "bfloat16" in proc.stdout and "[2, 16, 2, 8]" in proc.stdout and f"blake3 {key}" in proc.stdout
    assert "request req-0 segment 1 tokens 16..32, LSN" in proc.stdout


def test_inspect_segment_json_and_orphans(tmp_path, journal, cli):
    path, written = journal
    ended_key = written["keys"]["req-2"][0]  # req-2 ended: its records still refer to the segment
    info = json.loads(cli("inspect", "-j", path, "--segment", ended_key, "--json").stdout)
    assert info["key"] == ended_key and info["codec"] and info["raw_size"] == block(2, 0).nbytes
    assert info["users"] == [{"request": "req-2", "segment": 0, "tokens": [0, 16], "lsn": info["users"][0]["lsn"],
                              "ended": True}]
    with kvj_lib.Journal.open(path) as j:
        stray = j.store.put(torch.ones(3)).key
    proc = cli("inspect", "-j", path, "--segment", stray)
    assert proc.returncode == 0 and "no live record (an orphan" in proc.stdout


@pytest.mark.parametrize("step", ["open", "write"])
def test_a_failed_write_names_the_file_asked_for_not_its_temporary(tmp_path, journal, cli, monkeypatch, step):
    import errno

    from kvj.fileio import FS

    real_open = FS.open

    def open_tmp_refused(self, path, flags, mode=0o600):
        if ".tmp." in os.fspath(path):
            raise OSError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(self, path, flags, mode)

    def write_disk_full(self, fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FS, step, open_tmp_refused if step == "open" else write_disk_full)
    target = tmp_path / "x.pt"
    line = assert_fails(cli("dump", "-j", journal[0], "-r", "req-0", "--segment", "0", "-o", target),
                        77 if step == "open" else 74, f"{target}: ")
    assert ".tmp." not in line and os.listdir(tmp_path) == []


def test_damage_inside_a_chunk_is_reported_with_the_chunk_s_bytes(tmp_path, cli):
    path = tmp_path / "j"
    with kvj_lib.Journal.open(path) as j:  # one raw chunk of 64 KiB
        key = j.store.put(torch.arange(16384, dtype=torch.float32), codec="raw").key
        j.checkpoint(1, {"w": key})
    seg = segment_file(str(path), key)
    with open(seg, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    line = assert_fails(cli("dump", key, "-j", path, "-o", tmp_path / "w.pt"), DATAERR, "chunk 0 CRC mismatch")
    start, end = (int(n) for n in line.rsplit("its bytes ", 1)[1].split(".."))
    assert f"at offset {start}:" in line and start <= 5000 < end  # where the chunk is, and that the damage is in it
