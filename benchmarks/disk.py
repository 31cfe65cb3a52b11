"""Disk benchmark, like pg_test_fsync for kvj: fsync latency, journal throughput per commit
policy, codec speeds on this machine, and the settings they suggest.

Run ``kvj bench`` on the disk that will hold the journal.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable, Dict, List, Optional

from benchmarks.journal import sample_payload
from kvj.journal.journal import Journal
from kvj.journal.records import RecordType
from kvj.journal.config import CommitPolicy
from kvj.segments.codecs import codec_names

BLOCK = 8192
FILE_SIZE = 16 << 20

#: Commit policies measured: (label, policy). The first is kvj's default.
POLICIES = [
    ("default: 100 ms or 100 records", CommitPolicy()),
    ("10 ms or 10 records", CommitPolicy(max_delay=0.010, max_records=10)),
    ("1 ms or 1000 records", CommitPolicy(max_delay=0.001, max_records=1000)),
    ("1 s or 10000 records", CommitPolicy(max_delay=1.0, max_records=10_000)),
]


def _percentile(sorted_values: List[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def fsync_latency(directory: str, seconds: float, sync: Callable[[int], None], flags: int = 0) -> Dict[str, float]:
    """Overwrite 8 KiB blocks of a preallocated file, syncing each; ops/s and latency in µs."""
    path = os.path.join(directory, "fsync.bench")
    with open(path, "wb") as f:
        f.write(b"\0" * FILE_SIZE)
        f.flush()
        os.fsync(f.fileno())
    block = os.urandom(BLOCK)
    lat: List[float] = []
    fd = os.open(path, os.O_WRONLY | flags)
    try:
        deadline = time.perf_counter() + seconds
        offset = 0
        while time.perf_counter() < deadline or len(lat) < 5:
            t0 = time.perf_counter()
            os.pwrite(fd, block, offset)
            sync(fd)
            lat.append(time.perf_counter() - t0)
            offset = (offset + BLOCK) % FILE_SIZE
    finally:
        os.close(fd)
        os.unlink(path)
    lat.sort()
    return {"ops_per_s": len(lat) / sum(lat), "p50_us": _percentile(lat, 0.5) * 1e6,
            "p99_us": _percentile(lat, 0.99) * 1e6}


def journal_rate(directory: str, seconds: float, policy: CommitPolicy, durable_each: bool = False) -> Dict[str, float]:
    """Durable records/s when one thread appends for ``seconds`` (then syncs)."""
    payloads = [sample_payload(i) for i in range(1024)]
    n = 0
    with Journal.open(directory, policy=policy) as j:
        append = j.writer.append
        t0 = time.perf_counter()
        deadline = t0 + seconds
        while time.perf_counter() < deadline:
            for p in payloads[:64]:
                append(RecordType.SEGMENT, p, durable_each)
            n += 64
        j.sync()
        elapsed = time.perf_counter() - t0
    return {"records_per_s": n / elapsed, "us_per_record": elapsed / n * 1e6}


def codec_speeds(directory: str, size_mib: int) -> List[Dict[str, object]]:
    """Durable save and verified load GB/s of each kvj codec on Gaussian bf16 (the hard case)."""
    from benchmarks import codecs as bench_codecs  # torch: only when codecs are measured

    tensor = bench_codecs.gaussian_bf16(size_mib << 20)
    raw = tensor.numel() * tensor.element_size()
    rows: List[Dict[str, object]] = []
    for codec in codec_names():
        d = tempfile.mkdtemp(dir=directory)
        try:
            stored, save, load, exact = bench_codecs.bench_kvj(tensor, d, codec)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        rows.append({"codec": codec, "ratio": raw / stored, "save_gbps": raw / save / 1e9,
                     "load_gbps": raw / load / 1e9, "exact": exact})
    return rows


def recommend(fsync: Dict[str, Dict[str, float]], journal: List[Dict[str, object]],
              codecs: List[Dict[str, object]]) -> List[str]:
    """Plain-language advice from the measurements."""
    advice: List[str] = []
    fd = fsync["write + fdatasync"]
    if fd["p50_us"] < 50:
        advice.append(f"fdatasync takes {fd['p50_us']:.0f} µs (p50): faster than real flushes to stable storage. "
                      "This is tmpfs, a RAM disk, or a write cache that may not survive power loss; put the "
                      "journal on a disk whose flushes are honoured.")
    if fd["p99_us"] > 10_000:
        advice.append(f"fdatasync p99 is {fd['p99_us'] / 1000:.1f} ms (etcd asks for under 10 ms): keep the "
                      "default policy or a longer delay so groups grow, and give the journal its own fast disk.")
    rate = {str(r["policy"]): float(r["records_per_s"]) for r in journal}  # type: ignore[arg-type]
    default = POLICIES[0][0]
    best = max((label for label, _p in POLICIES), key=lambda label: rate[label])
    per_record = next((r for r in journal if r["policy"] == "durable=True each record"), None)
    if best != default and rate[best] > 1.2 * rate[default]:
        advice.append(f"'{best}' committed {rate[best]:,.0f} records/s against the default's {rate[default]:,.0f}: "
                      "consider it if its delay bound is acceptable.")
    else:
        advice.append(f"The default policy (100 ms or 100 records) sustains {rate[default]:,.0f} durable records/s "
                      "here; keep it.")
    if per_record is not None:
        advice.append(f"Waiting for each record (append(durable=True) or kvj record) costs "
                      f"{float(per_record['us_per_record']):.0f} µs per record here: group them and call sync() "
                      "once per batch instead.")
    if codecs:
        best = max(codecs, key=lambda r: float(r["save_gbps"]))  # type: ignore[arg-type]
        auto = next(r for r in codecs if r["codec"] == "auto")
        if best is auto or float(auto["save_gbps"]) >= 0.9 * float(best["save_gbps"]):  # type: ignore[arg-type]
            advice.append(f"Codec 'auto' saves durably at {float(auto['save_gbps']):.2f} GB/s here "
                          f"(ratio {float(auto['ratio']):.2f}), within 10% of the fastest: keep it.")
        else:
            advice.append(f"Codec '{best['codec']}' saves durably at {float(best['save_gbps']):.2f} GB/s against "
                          f"auto's {float(auto['save_gbps']):.2f} GB/s here: on this disk and CPU it is the faster "
                          "choice when flush bandwidth matters more than space.")
    floor_ms = max(1.0, 10 * fd["p99_us"] / 1000)
    advice.append(f"At low load a record waits up to max_delay before its group commits (that is what a crash "
                  f"can take). A commit costs {fd['p99_us'] / 1000:.2f} ms (p99) here, so max_delay can go as low "
                  f"as {floor_ms:.0f} ms while lone commits keep the disk under 10% busy.")
    return advice


def run(directory: Optional[str] = None, seconds: float = 1.0, with_codecs: bool = True) -> Dict[str, object]:
    """Measure in a fresh temporary directory under ``directory``; returns every result and advice."""
    base = tempfile.mkdtemp(prefix="kvj-bench-", dir=directory)
    try:
        fsync = {
            "write + fdatasync": fsync_latency(base, seconds, os.fdatasync),
            "write + fsync": fsync_latency(base, seconds, os.fsync),
            "O_DSYNC write": fsync_latency(base, seconds, lambda fd: None, os.O_DSYNC),
        }
        journal: List[Dict[str, object]] = []
        for i, (label, policy) in enumerate(POLICIES):
            journal.append({"policy": label, **journal_rate(os.path.join(base, f"j{i}"), seconds, policy)})
        journal.append({"policy": "durable=True each record",
                        **journal_rate(os.path.join(base, "jd"), seconds, CommitPolicy(), durable_each=True)})
        codecs = codec_speeds(base, 16 if seconds >= 0.5 else 2) if with_codecs else []
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"directory": os.path.abspath(directory or tempfile.gettempdir()), "seconds": seconds,
            "fsync": fsync, "journal": journal, "codecs": codecs, "advice": recommend(fsync, journal, codecs)}


def format_table(result: Dict[str, object]) -> str:
    lines = [f"kvj bench on {result['directory']} ({result['seconds']} s per test)", "",
             f"{'sync method (8 KiB writes)':<34} {'ops/s':>10} {'p50 µs':>10} {'p99 µs':>10}", "-" * 67]
    for name, r in result["fsync"].items():  # type: ignore[attr-defined]
        lines.append(f"{name:<34} {r['ops_per_s']:>10,.0f} {r['p50_us']:>10,.1f} {r['p99_us']:>10,.1f}")
    lines += ["", f"{'journal commit policy':<34} {'durable rec/s':>14} {'µs/record':>10}", "-" * 60]
    for r in result["journal"]:  # type: ignore[attr-defined]
        lines.append(f"{r['policy']:<34} {r['records_per_s']:>14,.0f} {r['us_per_record']:>10,.2f}")
    if result["codecs"]:
        lines += ["", f"{'codec (Gaussian bf16, durable)':<34} {'ratio':>7} {'save GB/s':>10} {'load GB/s':>10}",
                  "-" * 64]
        for r in result["codecs"]:  # type: ignore[attr-defined]
            lines.append(f"{r['codec']:<34} {r['ratio']:>7.3f} {r['save_gbps']:>10.2f} {r['load_gbps']:>10.2f}")
    lines += ["", "recommendations:"] + [f"- {a}" for a in result["advice"]]  # type: ignore[attr-defined]
    return "\n".join(lines)
