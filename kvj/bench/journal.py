"""Journal benchmark: kvj's group commit against what a user would pick instead.

Side by side in one run, on the same disk, with the same record (a segment-flush
record of a realistic size):

- kvj at the default commit policy (records/s until ``sync`` returns), through the public,
  schema-checked ``Journal.append``, through ``append_many`` (100 records a call), through a
  typed method (``Journal.start`` with a start record of about the same size), and through the
  writer alone with an already encoded payload (what the framing and group commit cost without
  the schema check);
- the seed design: one JSON line plus fsync per record (it runs for the same wall time as
  kvj did in that round rather than the same count, which would take minutes), and its
  batched variant (fsync every 100 lines);
- SQLite in WAL mode, synchronous=FULL, committing every 100 records;
- the floor: pre-encoded bytes, one fdatasync per 100 records;
- the caller-thread cost of ``append`` and ``start`` (p50, p99);
- the synchronous mirror (``Journal.open(mirror=...)``): durable records/s with a mirror
  against the same run without one, bulk (``append`` then ``sync``) and with ``THREADS``
  threads each appending ``durable=True`` (every acknowledgement waits for both copies'
  fdatasync). Both copies are on the measured disk; a mirror on its own device syncs in
  parallel with the journal's, so that is the harder case.

Every other contender writes the same number of records. Every contender but the floor and
kvj's writer row starts from the same Python dicts, so encoding is inside each timing (kvj:
the schema check, MessagePack and framing; the others: ``json.dumps``).

Run ``kvj bench journal``. Disks here are shared and
noisy, so compare the ratio columns, which come from one run.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

from kvj.journal.journal import Journal
from kvj.journal.records import RecordType, encode_payload
from kvj.journal.writer import CommitPolicy

BATCH = 100
#: Threads appending durable records at once in the mirror rows (a serving loop's request threads).
THREADS = 8
#: The mirror rows: (name, the same without a mirror).
MIRROR_ROWS = (("kvj Journal.append, mirrored", "kvj Journal.append (schema-checked)"),
               (f"kvj durable=True x{THREADS} threads, mirrored", f"kvj durable=True x{THREADS} threads"))


def sample_payload(i: int) -> Dict[str, object]:
    """A realistic segment-flush record (about 300 bytes encoded)."""
    return {"id": f"req-{i % 64:04d}", "seg": i, "key": f"{i:064x}", "tokens": [i * 16, i * 16 + 16],
            "layout": {"model": "llama-3-8b", "block_size": 16, "layers": 32, "kv_heads": 8, "head_dim": 128,
                       "dtype": "bfloat16"},
            "raw_size": 2097152, "stored_size": 1503221, "digest": f"{i:064x}", "codec": "byteplane"}


def sample_start(i: int) -> Dict[str, object]:
    """The arguments of a realistic ``Journal.start`` (a start record of about 300 bytes)."""
    return {"request_id": f"req-{i:08d}", "prompt_hash": f"{i:064x}",
            "tokens": [(i * 7919 + t * 104729) % 128_000 for t in range(48)],
            "meta": {"model": "llama-3-8b", "tenant": f"t{i % 16}"}}


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_kvj(directory: str, n: int, policy: Optional[CommitPolicy] = None, mirror: Optional[str] = None) -> float:
    """Records/s through ``Journal.append``: the schema check, encoding, framing, group commit
    (into ``mirror`` too when given)."""
    payloads = [sample_payload(i) for i in range(n)]
    with Journal.open(directory, policy=policy, mirror=mirror) as j:
        append = j.append

        def work() -> None:
            for p in payloads:
                append(RecordType.SEGMENT, p)
            j.sync()
        return n / _timed(work)


def bench_kvj_many(directory: str, n: int) -> float:
    """Records/s through ``Journal.append_many``, ``BATCH`` records a call (all checked first)."""
    batches = [[(RecordType.SEGMENT, sample_payload(i)) for i in range(start, min(start + BATCH, n))]
               for start in range(0, n, BATCH)]
    with Journal.open(directory) as j:
        append_many = j.append_many

        def work() -> None:
            for batch in batches:
                append_many(batch)
            j.sync()
        return n / _timed(work)


def bench_kvj_typed(directory: str, n: int) -> float:
    """Records/s through the typed ``Journal.start`` (the same schema check, built from arguments)."""
    calls = [sample_start(i) for i in range(n)]
    with Journal.open(directory) as j:
        start = j.start

        def work() -> None:
            for c in calls:
                start(**c)
            j.sync()
        return n / _timed(work)


def bench_kvj_encoded(directory: str, n: int) -> float:
    """Records/s through the writer alone, payloads already encoded: framing and group commit."""
    payloads = [encode_payload(sample_payload(i)) for i in range(n)]
    with Journal.open(directory) as j:
        append = j.writer.append

        def work() -> None:
            for p in payloads:
                append(RecordType.SEGMENT, p)
            j.sync()
        return n / _timed(work)


def bench_kvj_durable(directory: str, n: int, mirror: Optional[str] = None) -> float:
    """Records/s of ``THREADS`` threads each appending its share of ``n`` records with
    ``durable=True`` (each call returns once its group is fdatasynced, in ``mirror`` too)."""
    payloads = [sample_payload(i) for i in range(n)]
    share = [payloads[t::THREADS] for t in range(THREADS)]
    with Journal.open(directory, mirror=mirror) as j:
        append = j.append

        def one(mine: List[Dict[str, object]]) -> None:
            for p in mine:
                append(RecordType.SEGMENT, p, durable=True)

        def work() -> None:
            threads = [threading.Thread(target=one, args=(mine,)) for mine in share]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return n / _timed(work)


def append_latency(directory: str, n: int, typed: bool = False) -> List[float]:
    """Caller-thread nanoseconds per checked ``Journal.append`` of a segment record (or, with
    ``typed``, per ``Journal.start``), committer running."""
    lat = []
    clock = time.perf_counter_ns
    with Journal.open(directory) as j:
        if typed:
            start = j.start
            for c in [sample_start(i) for i in range(n)]:
                t0 = clock()
                start(**c)
                lat.append(clock() - t0)
        else:
            append = j.append
            for p in [sample_payload(i) for i in range(n)]:
                t0 = clock()
                append(RecordType.SEGMENT, p)
                lat.append(clock() - t0)
        j.sync()
    lat.sort()
    return lat


def bench_jsonl(directory: str, n: int, every: int, budget: Optional[float] = None) -> float:
    """The seed's JSON lines, fsync every ``every`` lines: ``n`` records, or as many as fit in
    ``budget`` seconds when given (the per-record-fsync variant is too slow for the same count)."""
    payloads = [sample_payload(i) for i in range(n)]
    path = os.path.join(directory, "journal.jsonl")
    done = 0

    def work() -> None:
        nonlocal done
        deadline = time.perf_counter() + budget if budget is not None else None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for i, payload in enumerate(payloads, 1):
                os.write(fd, (json.dumps(payload) + "\n").encode())
                if i % every == 0 or i == n:
                    os.fsync(fd)
                    done = i
                    if deadline is not None and time.perf_counter() >= deadline:
                        return
        finally:
            os.close(fd)
    elapsed = _timed(work)
    return done / elapsed


def bench_sqlite(directory: str, n: int) -> float:
    payloads = [sample_payload(i) for i in range(n)]
    db = sqlite3.connect(os.path.join(directory, "journal.db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE rec (lsn INTEGER PRIMARY KEY, body TEXT)")

    def work() -> None:
        for start in range(0, n, BATCH):
            db.execute("BEGIN")
            db.executemany("INSERT INTO rec VALUES (?, ?)",
                           [(i, json.dumps(payloads[i])) for i in range(start, min(start + BATCH, n))])
            db.execute("COMMIT")
    try:
        return n / _timed(work)
    finally:
        db.close()


def bench_floor(directory: str, n: int) -> float:
    record = json.dumps(sample_payload(0)).encode()
    chunk = record * BATCH
    path = os.path.join(directory, "floor.bin")

    def work() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for _ in range(0, n, BATCH):
                os.write(fd, chunk)
                os.fdatasync(fd)
        finally:
            os.close(fd)
    return n / _timed(work)


def run(directory: Optional[str] = None, n: int = 100_000,
        repeat: int = 3) -> List[Dict[str, object]]:
    """Run every contender ``repeat`` times, interleaved, in fresh directories; median rates.

    Each contender writes ``n`` records, except the per-record-fsync seed, which runs for as
    long as kvj took in the same round (a wall-time budget, said in its name).
    """
    base = tempfile.mkdtemp(prefix="kvj-bench-", dir=directory)
    sqlite_name = f"SQLite WAL, synchronous=FULL, commit per {BATCH}"
    durable_n = max(THREADS, n // 20)  # each durable group waits for an fdatasync: fewer records
    kvj_time = [1.0]

    def kvj_checked(d: str) -> float:
        rate = bench_kvj(d, n)
        kvj_time[0] = n / rate
        return rate

    contenders: Dict[str, Callable[[str], float]] = {
        "kvj Journal.append (schema-checked)": kvj_checked,
        f"kvj Journal.append_many, {BATCH} a call": lambda d: bench_kvj_many(d, n),
        "kvj Journal.start (typed, schema-checked)": lambda d: bench_kvj_typed(d, n),
        "kvj writer, payload pre-encoded": lambda d: bench_kvj_encoded(d, n),
        MIRROR_ROWS[0][0]: lambda d: bench_kvj(os.path.join(d, "j"), n, mirror=os.path.join(d, "m")),
        MIRROR_ROWS[1][1]: lambda d: bench_kvj_durable(d, durable_n),
        MIRROR_ROWS[1][0]: lambda d: bench_kvj_durable(os.path.join(d, "j"), durable_n, mirror=os.path.join(d, "m")),
        "seed: JSON line + fsync per record (kvj's time)": lambda d: bench_jsonl(d, n, 1, budget=kvj_time[0]),
        f"seed batched: fsync per {BATCH} lines": lambda d: bench_jsonl(d, n, BATCH),
        sqlite_name: lambda d: bench_sqlite(d, n),
        f"floor: raw bytes, fdatasync per {BATCH}": lambda d: bench_floor(d, n),
    }
    rates: Dict[str, List[float]] = {name: [] for name in contenders}
    try:
        for round_ in range(repeat):
            for i, (name, fn) in enumerate(contenders.items()):
                path = os.path.join(base, f"{round_}-{i}")
                os.mkdir(path)
                rates[name].append(fn(path))
                shutil.rmtree(path)
        lat = {}
        for name, typed in (("kvj Journal.append, caller thread", False), ("kvj Journal.start, caller thread", True)):
            lat_dir = os.path.join(base, f"latency-{typed}")
            os.mkdir(lat_dir)
            lat[name] = append_latency(lat_dir, n, typed)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    median = {name: sorted(r)[len(r) // 2] for name, r in rates.items()}
    floor = median[f"floor: raw bytes, fdatasync per {BATCH}"]
    rows: List[Dict[str, object]] = [{"system": name, "records_per_s": rate, "vs_sqlite": rate / median[sqlite_name],
                                      "vs_floor": rate / floor} for name, rate in median.items()]
    for row in rows:
        plain = dict(MIRROR_ROWS).get(row["system"])  # type: ignore[call-overload]
        if plain is not None:
            row["vs_unmirrored"] = row["records_per_s"] / median[plain]  # type: ignore[operator]
    for name, ns in lat.items():
        rows.append({"system": name, "p50_us": ns[len(ns) // 2] / 1000, "p99_us": ns[int(len(ns) * 0.99)] / 1000})
    return rows


def format_table(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'system':<48} {'median rec/s':>13} {'x SQLite':>9} {'x floor':>8}", "-" * 81]
    for row in rows:
        if "records_per_s" in row:
            lines.append(f"{row['system']:<48} {row['records_per_s']:>13,.0f} {row['vs_sqlite']:>9.2f} "
                         f"{row['vs_floor']:>8.2f}")
    for row in rows:
        if "vs_unmirrored" in row:
            lines.append(f"{row['system']:<48} {row['vs_unmirrored']:.2f} x the same without a mirror")
    for row in rows:
        if "p50_us" in row:
            lines.append(f"{row['system']:<48} p50 {row['p50_us']:.2f} us, p99 {row['p99_us']:.2f} us")
    return "\n".join(lines)
