"""A zstd bomb: a small segment file (about 450 KB) whose valid header declares 8 GiB of raw
bytes, 8192 chunks of a 49-byte zstd frame of 1 MiB of zeros, every CRC correct, the header's
digest forged to be the key its file is stored under. Checking it (store.verify, kvj fsck,
kvj recover --dry-run, kvj dump) once took as much memory as it declares (8.4 GB and 31 s for
fsck); now a check decodes and hashes a chunk at a time, and the forged digest is caught in a
few megabytes. A header whose digest is not its key is refused before any chunk is decoded.

Each command runs in a child capped at 3 GiB of address space (the old code could not
allocate the declared size there) and its peak RSS, read by wait4, must stay under 512 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, NamedTuple

import msgpack
import pytest
import torch
import zstandard
from crc32c import crc32c
from support.cli_helpers import KVJ, build, env, segment_file

import kvj
from kvj.errors import SegmentCorrupt
from kvj.segments import segfile as seg
from kvj.segments.store import SegmentStore

DECLARED = 8 << 30
#: Address space of each child: torch and the thread pools fit, the declared size does not.
ADDRESS_SPACE = 3 << 30
#: What a check of the bomb may take (the old code: the declared 8 GiB).
MAX_RSS = 512 << 20
TIMEOUT = 300
DATAERR = 65


def bomb(digest: bytes) -> bytes:
    """The segment file: DECLARED bytes of zeros in 1 MiB zstd chunks, CRCs right, ``digest`` claimed."""
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(seg.CHUNK_SIZE))
    n = DECLARED // seg.CHUNK_SIZE
    m = {"dtype": "uint8", "shape": [DECLARED], "layout": None, "codec": "zstd",
         "params": {"level": 19, "long": False}, "raw_size": DECLARED, "chunk_size": seg.CHUNK_SIZE,
         "payload_size": DECLARED, "chunks": [[len(frame), crc32c(frame)]] * n, "stored_size": len(frame) * n,
         "digest_alg": seg.DIGEST_ALG, "digest": digest, "dedup": None}
    pre = seg.PREAMBLE.pack(seg.MAGIC, seg.VERSION, 0, 0)
    head = msgpack.packb(m, use_bin_type=True)
    return pre + frame * n + head + seg.TRAILER.pack(len(head), crc32c(head, crc32c(pre)), seg.END_MAGIC)


def plant(path: str, data: bytes) -> None:
    """Replace the segment file at ``path`` with ``data``."""
    os.chmod(path, 0o600)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture(scope="module")
def bombed(tmp_path_factory):
    """A journal whose one request's one segment is the bomb, under its own key; (journal, key)."""
    path = str(tmp_path_factory.mktemp("bomb") / "j")
    build(path, requests=1, blocks=1, ended=0, training=False)
    key = kvj.replay(path).requests["req-0"].segments[0].key
    plant(segment_file(path, key), bomb(bytes.fromhex(key)))
    return path, key


class Run(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    max_rss: int


#: Runs argv[3:] capped at argv[1] bytes of address space, writes "status maxrss_kib" to argv[2].
#: A child's ru_maxrss counts the memory of the process it was forked from, so the command is
#: forked from this small launcher, not from the test process.
LAUNCHER = textwrap.dedent("""
    import os, resource, subprocess, sys, threading
    cap, report, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    proc = subprocess.Popen(argv, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    timer = threading.Timer(float(os.environ["BOMB_TIMEOUT"]), proc.kill)
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    with open(report, "w") as f:
        f.write(f"{proc.returncode} {usage.ru_maxrss}")
""")


def run_capped(argv: List[str], tmp_path: Path) -> Run:
    """Run ``argv`` capped at ADDRESS_SPACE; its status, output and own peak RSS (wait4's)."""
    report = tmp_path / "report"
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(ADDRESS_SPACE), str(report), *argv],
                          capture_output=True, text=True, env=env(BOMB_TIMEOUT=str(TIMEOUT)), timeout=TIMEOUT + 60)
    status, max_rss_kib = map(int, report.read_text().split())
    assert status != -9, f"{argv} ran past {TIMEOUT} s"
    return Run(status, done.stdout, done.stderr, max_rss_kib << 10)


def _kvj(*args: str) -> List[str]:
    return [*KVJ, *args]


VERIFY = textwrap.dedent("""
    import sys
    from kvj.errors import KvjError
    from kvj.segments.store import SegmentStore
    with SegmentStore(sys.argv[1]) as store:
        try:
            store.verify(sys.argv[2])
            print("verified")
        except KvjError as exc:
            print(type(exc).__name__, exc)
""")


def _bounded(run: Run) -> None:
    assert "Traceback" not in run.stderr, run.stderr
    assert run.max_rss < MAX_RSS, f"peak RSS {run.max_rss >> 20} MiB checking a bomb: {run.stdout}{run.stderr}"


def test_store_verify_refuses_the_bomb_in_a_chunk_s_memory(bombed, tmp_path):
    path, key = bombed
    run = run_capped([sys.executable, "-c", VERIFY, os.path.join(path, "segments"), key], tmp_path)
    _bounded(run)
    assert run.stdout.startswith("SegmentCorrupt") and "digest mismatch" in run.stdout, run.stdout


def test_fsck_reports_the_bomb_damaged_in_a_chunk_s_memory(bombed, tmp_path):
    path, key = bombed
    run = run_capped(_kvj("fsck", "-j", path), tmp_path)
    _bounded(run)
    assert run.returncode == 4, run.stdout + run.stderr
    assert f"needs segment {key}" in run.stdout and "digest mismatch" in run.stdout, run.stdout


def test_recover_dry_run_drops_the_bomb_in_a_chunk_s_memory(bombed, tmp_path):
    path, key = bombed
    run = run_capped(_kvj("recover", "--dry-run", "-j", path, "--json"), tmp_path)
    _bounded(run)
    assert run.returncode == 0, run.stdout + run.stderr
    (request,) = json.loads(run.stdout)["manifest"]["requests"]
    (dropped,) = request["fallback"]["dropped"]
    assert dropped["key"] == key and dropped["problem"] == "segment-damaged"
    assert "digest mismatch" in dropped["reason"], dropped


def test_dump_refuses_the_bomb_in_a_chunk_s_memory(bombed, tmp_path):
    path, key = bombed
    target = tmp_path / "out.npy"
    run = run_capped(_kvj("dump", key, "-j", path, "-o", str(target)), tmp_path)
    _bounded(run)
    assert run.returncode == DATAERR and "digest mismatch" in run.stderr, run.stdout + run.stderr
    assert not target.exists()


def test_a_header_whose_digest_is_not_its_key_is_refused_before_a_chunk_is_decoded(tmp_path, monkeypatch):
    """What kvj inspect --segment did cheaply, verify, get and dump now do first: a header
    claiming another digest than its key is refused without decoding anything."""
    from kvj.ops.dump import dump_segment
    from kvj.segments.codecs import zstd

    with SegmentStore(tmp_path / "store", threads=2) as store:
        key = store.put(torch.zeros(4096, dtype=torch.uint8), codec="zstd").key
        plant(store.backend.path(key), bomb(bytes(32)))

        def decoded(*args: object) -> None:
            raise AssertionError("a chunk was decoded before the header's digest was checked against the key")
        monkeypatch.setattr(zstd, "zstd_decompress_into", decoded)
        for check in (store.verify, store.get, lambda k: dump_segment(store, k, str(tmp_path / "x.npy"))):
            with pytest.raises(SegmentCorrupt, match="header digest does not match the key"):
                check(key)
        assert not (tmp_path / "x.npy").exists()
