"""Replication benchmark: kvj's replicator vs a plain boto3 ``upload_file`` of the same bytes
to the same local S3 endpoint (moto's server, in its own process), and restore speed.

Run ``kvj bench replica [--size MIB] [--segment MIB]`` (needs ``moto[server]`` and
``boto3``: ``pip install kvj[bench]``). Verification stays on for kvj: every segment's CRCs
are checked before upload and each single-part ETag is compared with the MD5 of what was sent.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
         "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> "tuple[subprocess.Popen, str]":
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def run(size_mib: int = 256, segment_mib: int = 4, directory: str = None) -> List[Dict[str, object]]:
    import boto3
    import torch

    from kvj.journal.journal import Journal
    from kvj.replica.remote import open_remote
    from kvj.replica.restore import restore
    from kvj.replica.ship import Replicator

    proc, endpoint = _start_moto()
    os.environ.update(CREDS, AWS_ENDPOINT_URL=endpoint)
    work = tempfile.mkdtemp(prefix="kvj-bench-replica-", dir=directory)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for bucket in ("kvj", "boto3"):
            client.create_bucket(Bucket=bucket)
        journal = os.path.join(work, "journal")
        n = max(1, size_mib // segment_mib)
        gen = torch.Generator().manual_seed(1)
        with Journal.open(journal) as j:
            for i in range(n):
                j.start(f"r{i}")
                data = torch.randn(segment_mib << 18, generator=gen)  # fp32: 4 bytes each, incompressible
                j.flush(f"r{i}", 0, data, token_range=(0, 16)).result()
            j.sync()
        files = [os.path.join(root, name) for root, _, names in os.walk(journal) for name in names
                 if name.endswith((".kvjseg", ".log"))]
        total = sum(os.path.getsize(f) for f in files)

        t0 = time.perf_counter()
        for path in files:
            client.upload_file(path, "boto3", os.path.relpath(path, journal))
        boto_s = time.perf_counter() - t0

        remote = open_remote("s3://kvj/replica")
        t0 = time.perf_counter()
        with Replicator(journal, remote) as rep:
            result = rep.round()
        kvj_s = time.perf_counter() - t0
        shipped = result.segment_bytes + result.log_bytes

        t0 = time.perf_counter()
        restored = restore(remote, os.path.join(work, "restored"))
        restore_s = time.perf_counter() - t0
        rows: List[Dict[str, object]] = [
            {"what": "boto3 upload_file, one file at a time", "bytes": total, "seconds": boto_s,
             "MB/s": total / boto_s / 1e6, "ratio": 1.0},
            {"what": "kvj replicate (verified, 8 threads)", "bytes": shipped, "seconds": kvj_s,
             "MB/s": shipped / kvj_s / 1e6, "ratio": (shipped / kvj_s) / (total / boto_s)},
            {"what": "kvj restore (every object verified)", "bytes": restored.bytes, "seconds": restore_s,
             "MB/s": restored.bytes / restore_s / 1e6, "ratio": None},
        ]
        return rows
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def format_table(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'':40} {'MiB':>8} {'seconds':>8} {'MB/s':>8} {'vs boto3':>9}"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        lines.append(f"{r['what']:40} {r['bytes'] / 2**20:8.1f} {r['seconds']:8.2f} {r['MB/s']:8.1f} {ratio:>9}")
    return "\n".join(lines)
