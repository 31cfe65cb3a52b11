"""Replication benchmark: kvj's replicator vs boto3 uploading the same files with the same
concurrency to the same local S3 endpoint (moto's server, in its own process), and restore speed.

Both sides get ``THREADS`` threads: kvj's replicator its pool, boto3 a pool of that many
threads each calling ``upload_file`` (with its ``TransferConfig`` allowing as many threads per
file, for files large enough to go in parts). Three rounds, each into fresh buckets, the order
alternating (boto3 first, then kvj first, ...); the table shows medians. Neither side fsyncs:
both read files already durable on the local disk and send them over HTTP; kvj verifies every
segment's CRCs before upload and compares each single-part ETag with the MD5 of what was sent,
and its restore verifies every object. Run ``kvj bench replica [--size MIB] [--segment MIB]``
(needs ``moto[server]`` and ``boto3``: ``pip install kvj[bench]``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
         "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true"}
#: Upload threads on each side (kvj's replicator pool; boto3's thread pool and TransferConfig).
THREADS = 8
ROUNDS = 3
BOTO3 = f"boto3 upload_file, {THREADS} threads"
KVJ = f"kvj replicate (verified, {THREADS} threads)"
RESTORE = f"kvj restore (every object verified, {THREADS} threads)"


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


def _median(values: List[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(size_mib: int = 256, segment_mib: int = 4, directory: Optional[str] = None,
        rounds: int = ROUNDS) -> List[Dict[str, object]]:
    import boto3
    import torch
    from boto3.s3.transfer import TransferConfig

    from kvj.journal.journal import Journal
    from kvj.replica.remote import open_remote
    from kvj.replica.pull import restore
    from kvj.replica.ship import Replicator

    proc, endpoint = _start_moto()
    os.environ.update(CREDS, AWS_ENDPOINT_URL=endpoint)
    work = tempfile.mkdtemp(prefix="kvj-bench-replica-", dir=directory)
    load_before = os.getloadavg()[0]
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
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
        config = TransferConfig(max_concurrency=THREADS)

        def boto3_round(r: int) -> float:
            bucket = f"boto3-{r}"
            client.create_bucket(Bucket=bucket)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=THREADS) as pool:
                for done in [pool.submit(client.upload_file, path, bucket, os.path.relpath(path, journal),
                                         Config=config) for path in files]:
                    done.result()
            return time.perf_counter() - t0

        shipped: List[int] = []
        restored: List[int] = []

        def kvj_round(r: int) -> float:
            client.create_bucket(Bucket=f"kvj-{r}")
            remote = open_remote(f"s3://kvj-{r}/replica")
            t0 = time.perf_counter()
            with Replicator(journal, remote, threads=THREADS) as rep:
                result = rep.round()
            seconds = time.perf_counter() - t0
            shipped.append(result.segment_bytes + result.log_bytes)
            return seconds

        def restore_round(r: int) -> float:
            t0 = time.perf_counter()
            done = restore(open_remote(f"s3://kvj-{r}/replica"), os.path.join(work, f"restored-{r}"), threads=THREADS)
            restored.append(done.bytes)
            return time.perf_counter() - t0

        seconds: Dict[str, List[float]] = {BOTO3: [], KVJ: [], RESTORE: []}
        for r in range(rounds):
            sides = [(BOTO3, boto3_round), (KVJ, kvj_round)]
            for name, side in sides if r % 2 == 0 else sides[::-1]:
                seconds[name].append(side(r))
            seconds[RESTORE].append(restore_round(r))
        boto_s, kvj_s, restore_s = (_median(seconds[k]) for k in (BOTO3, KVJ, RESTORE))
        moved = {BOTO3: total, KVJ: _median([float(b) for b in shipped]), RESTORE: _median([float(b) for b in restored])}
        # paired: each round's kvj MB/s against the same round's boto3
        ratio = _median([(b / k) * (shipped_bytes / total) for b, k, shipped_bytes in
                         zip(seconds[BOTO3], seconds[KVJ], shipped)])
        rows: List[Dict[str, object]] = []
        for name, secs, ratio in ((BOTO3, boto_s, 1.0), (KVJ, kvj_s, ratio), (RESTORE, restore_s, None)):
            rows.append({"what": name, "bytes": int(moved[name]), "seconds": secs, "MB/s": moved[name] / secs / 1e6,
                         "ratio": ratio, "threads": THREADS, "fsync": False, "rounds": rounds,
                         "all_seconds": seconds[name]})
        rows.append({"what": "load average", "before": load_before, "after": os.getloadavg()[0],
                     "cpus": os.cpu_count()})
        return rows
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def format_table(rows: List[Dict[str, object]]) -> str:
    load = next(r for r in rows if r["what"] == "load average")
    timed = [r for r in rows if r["what"] != "load average"]
    lines = [f"median of {timed[0]['rounds']} rounds, order alternating (boto3 first in round 1; vs boto3: the "
             f"median of the rounds' ratios); {THREADS} threads "
             f"each side; no row fsyncs (files already on disk, sent over HTTP to moto); load average "
             f"{load['before']:.2f} before, {load['after']:.2f} after, {load['cpus']} CPUs",
             f"{'':48} {'MiB':>8} {'seconds':>8} {'MB/s':>8} {'vs boto3':>9}  rounds (s)"]
    for r in timed:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        each = " ".join(f"{s:.2f}" for s in r["all_seconds"])  # type: ignore[attr-defined]
        lines.append(f"{r['what']:48} {r['bytes'] / 2**20:8.1f} {r['seconds']:8.2f} {r['MB/s']:8.1f} {ratio:>9}  "
                     f"{each}")
    return "\n".join(lines)
