"""Segment verification benchmark: ``fsck`` of a store of many small segments against the floor.

The store is built as ``kvj bench scaling`` builds its segment axis (``SegmentStore.put`` of
256-byte float16 tensors, each under its own layout, so each its own file); the journal is
empty, so every segment is an orphan that fsck reads in full (header, chunk CRC, decode,
digest against its key), as it reads the segments a journal needs. Side by side, in rounds
interleaved, from a warm page cache:

- ``kvj fsck``: ``kvj.ops.fsck.fsck`` of that journal and store (listing included);
- ``kvj fsck, headers only``: the same with ``sample`` so small that one segment is read in
  full and the others have their header checked (``--read-data-subset``);
- the floor: what reading the segments costs at the least, the way ``cat`` reads them, on as
  many threads as fsck's checks: the files listed, then each opened, read whole, closed and
  its bytes hashed with BLAKE3, in tasks of fsck's batch size.

Run ``kvj bench verify [--segments N]``; the ratio columns are kvj's wall-clock and CPU time
(every thread of the process) over the floor's in the same round (median of the rounds): on a
shared machine the CPU time moves less with the load than the wall clock.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import blake3

from benchmarks.scaling import build_store
from kvj.ops.fsck import FsckResult, fsck
from kvj.ops.fsck_segments import VERIFY_BATCH, verify_threads
from kvj.ops.init import init
from kvj.segments.local import SEGMENT_SUFFIX


FLOOR = "floor: read + BLAKE3"


def _checked(result: FsckResult, full: bool) -> int:
    """How many segments fsck read in full (``full``) or checked at all; errors are a bug here."""
    if result.errors:
        raise RuntimeError(f"fsck found errors in the benchmark's store: {result.errors[0].message}")
    return result.data_verified if full else result.data_verified + result.headers_checked


def floor(objects: str, threads: int) -> int:
    """List every segment file under ``objects`` and read and hash each whole on ``threads``
    threads, ``VERIFY_BATCH`` files a task; how many files it read."""
    paths = [entry.path for fan in sorted(os.scandir(objects), key=lambda e: e.name) if fan.is_dir()
             for entry in sorted(os.scandir(fan.path), key=lambda e: e.name) if entry.name.endswith(SEGMENT_SUFFIX)]

    def read(batch: List[str]) -> None:
        for path in batch:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            blake3.blake3(data).digest()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(read, [paths[i:i + VERIFY_BATCH] for i in range(0, len(paths), VERIFY_BATCH)]))
    return len(paths)


def run(segments: int = 10_000, directory: Optional[str] = None, rounds: int = 3) -> Dict[str, Any]:
    """Build a store of ``segments`` segments, then time fsck (full, headers only) and the floor
    ``rounds`` times, interleaved; seconds per row and round."""
    base = tempfile.mkdtemp(prefix="kvj-bench-verify-", dir=directory)
    load_before = os.getloadavg()[0]
    try:
        store, journal = os.path.join(base, "store"), os.path.join(base, "journal")
        t0 = time.perf_counter()
        build_store(store, segments)
        built = time.perf_counter() - t0
        init(journal, store=store)
        threads = verify_threads()
        contenders: Dict[str, Callable[[], int]] = {
            "kvj fsck": lambda: _checked(fsck(journal, store), full=True),
            "kvj fsck, headers only": lambda: _checked(fsck(journal, store, sample=1e-12), full=False),
            FLOOR: lambda: floor(os.path.join(store, "objects"), threads)}
        times: Dict[str, List[Tuple[float, float]]] = {method: [] for method in contenders}
        checked: Dict[str, int] = {}
        for _ in range(rounds):
            for method, contender in contenders.items():
                t, cpu = time.perf_counter(), time.process_time()
                checked[method] = contender()
                times[method].append((time.perf_counter() - t, time.process_time() - cpu))
        rows = []
        for method, ts in times.items():
            wall, cpu = statistics.median(w for w, _c in ts), statistics.median(c for _w, c in ts)
            rows.append({"method": method, "segments": checked[method], "threads": threads, "seconds": wall,
                         "us_per_segment": wall / segments * 1e6, "cpu_us_per_segment": cpu / segments * 1e6,
                         "vs_floor": statistics.median(w / f[0] for (w, _c), f in zip(ts, times[FLOOR])),
                         "cpu_vs_floor": statistics.median(c / f[1] for (_w, c), f in zip(ts, times[FLOOR])),
                         "rounds": ts})
        return {"segments": segments, "rounds": rounds, "threads": threads, "cpus": os.cpu_count(),
                "segment_file_bytes": os.path.getsize(next(
                    os.path.join(d, n) for d, _s, names in os.walk(os.path.join(store, "objects"))
                    for n in names if n.endswith(SEGMENT_SUFFIX))),
                "build_seconds": built, "load_before": load_before, "load_after": os.getloadavg()[0],
                "rows": rows}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def format_table(result: Dict[str, Any]) -> str:
    """The rows as a plain-text table, then the threads, CPUs and load average."""
    lines = [f"{result['segments']:,} segments of {result['segment_file_bytes']} B (one file each), warm page cache, "
             f"median of {result['rounds']} interleaved rounds",
             f"{'method':26s} {'segments':>9s} {'threads':>7s} {'seconds':>8s} {'µs/segment':>10s} {'x floor':>7s} "
             f"{'CPU µs/segment':>14s} {'CPU x floor':>11s}"]
    for r in result["rows"]:
        lines.append(f"{r['method']:26s} {r['segments']:>9,} {r['threads']:>7} {r['seconds']:>8.3f} "
                     f"{r['us_per_segment']:>10.1f} {r['vs_floor']:>7.2f} {r['cpu_us_per_segment']:>14.1f} "
                     f"{r['cpu_vs_floor']:>11.2f}")
    lines.append(f"x floor: kvj's time (CPU: this process's CPU time, every thread) over the floor's in the same "
                 f"round (median); built the store in "
                 f"{result['build_seconds']:.1f} s; {result['cpus']} CPUs, load average {result['load_before']:.2f} "
                 f"before the run, {result['load_after']:.2f} after")
    return "\n".join(lines)
