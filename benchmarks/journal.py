"""Journal benchmark: kvj's group commit against what a user would pick instead, like for like.

Side by side in one run, on the same disk, with the same record (a segment-flush record of
a realistic size). Every row fsyncs before it counts a record durable, and every row says
how many records each fdatasync made durable and what a crash can lose at worst, because
those decide the rate: a journal that syncs ten times less often is not ten times faster.
Three sections, each compared with the peers that sync as often:

1. *100 records per fdatasync*: kvj with groups capped at 100 records
   (``max_group_records``: the next group fills while one is synced, so up to 200 are
   pending), kvj with at most 100 pending (the same loss window as the peers: nothing
   overlaps the sync), against SQLite in WAL mode with synchronous=FULL committing every 100
   records, the floor (pre-encoded bytes, one write and fdatasync per 100 records) and the
   seed's JSON lines with an fsync per 100;
2. *kvj's default policy* (a group takes everything pending, written at 100 pending or
   after ``max_delay``): through the public, schema-checked ``Journal.append``, through
   ``append_many`` (100 records a call), through a typed method (``Journal.start``), through
   the writer alone with an already encoded payload, and with a synchronous mirror; against
   SQLite committing every ``max_delay`` (the same loss window in time) and the floor syncing
   as many records at once as kvj's groups held in that round;
3. *every call durable*: ``THREADS`` threads each appending with ``durable=True`` (every
   acknowledgement waits for its group's fdatasync), with and without a mirror, and the
   seed's JSON line plus fsync per record (run for as long as kvj's default row took, not
   for the same count, which would take minutes).

Then the caller-thread cost of ``append`` and ``start`` at the default policy (p50, p99).
Every contender but the floor and kvj's writer rows starts from the same Python dicts, so
encoding is inside each timing (kvj: the schema check, MessagePack and framing; the others:
``json.dumps``). Contenders run interleaved, in fresh directories, the order reversed every
other round; the table shows medians. Disks here are shared and noisy: compare the ratio
columns, which come from one run. Run ``kvj bench journal``.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from kvj.journal.framing import FILE_HEADER_SIZE, GROUP_HEADERS, decode_file_header, group_header_at
from kvj.journal.journal import Journal
from kvj.journal.reader import list_logs
from kvj.journal.records import RecordType, encode_payload
from kvj.journal.config import CommitPolicy

BATCH = 100
#: Threads appending durable records at once in section 3 (a serving loop's request threads).
THREADS = 8
DEFAULT = CommitPolicy()
#: kvj at the peers' records per fdatasync: groups of BATCH, the next one filling during the sync.
GROUPS_OF_BATCH = CommitPolicy(max_group_records=BATCH, max_pending_records=2 * BATCH)
#: kvj at the peers' records per fdatasync and loss window: at most BATCH appended but not durable.
PENDING_BATCH = CommitPolicy(max_pending_records=BATCH)

SAME_RATE, DEFAULT_POLICY, DURABLE = (f"1. {BATCH} records per fdatasync", "2. kvj's default policy",
                                      "3. every call durable")
SQLITE_BATCH = f"SQLite WAL, synchronous=FULL, commit per {BATCH}"
SQLITE_DELAY = f"SQLite WAL, synchronous=FULL, commit every {DEFAULT.max_delay * 1000:.0f} ms"
FLOOR_BATCH = f"floor: raw bytes, fdatasync per {BATCH}"
FLOOR_KVJ = "floor: raw bytes, fdatasync per kvj's group"
KVJ_DEFAULT = "kvj Journal.append (schema-checked)"
#: The mirror rows: (name, the same without a mirror).
MIRROR_ROWS = (("kvj Journal.append, mirrored", KVJ_DEFAULT),
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


@dataclass
class Run:
    """One contender's run: records durable per second, and records per fdatasync it made."""

    rate: float
    per_sync: float


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def records_per_group(directory: str) -> float:
    """Records per commit group (one fdatasync each) in the journal at ``directory``."""
    records = groups = 0
    for path in list_logs(directory):
        with open(path, "rb") as f:
            data = f.read()
        header = decode_file_header(data)
        if header is None:
            continue
        off = FILE_HEADER_SIZE
        while (head := group_header_at(data, off, header.salt, header.version)) is not None:
            records, groups = records + head[1], groups + 1
            off += GROUP_HEADERS[header.version].size + head[0]
    return records / groups if groups else 0.0


def _journal_run(directory: str, n: int, work: Callable[[Journal], None], policy: Optional[CommitPolicy] = None,
                 mirror: Optional[str] = None) -> Run:
    with Journal.open(directory, policy=policy, mirror=mirror) as j:
        seconds = _timed(lambda: work(j))
    return Run(n / seconds, records_per_group(directory))


def bench_kvj(directory: str, n: int, policy: Optional[CommitPolicy] = None, mirror: Optional[str] = None) -> Run:
    """``Journal.append`` until ``sync`` returns: the schema check, encoding, framing, group
    commit (into ``mirror`` too when given)."""
    payloads = [sample_payload(i) for i in range(n)]

    def work(j: Journal) -> None:
        append = j.append
        for p in payloads:
            append(RecordType.SEGMENT, p)
        j.sync()
    return _journal_run(directory, n, work, policy, mirror)


def bench_kvj_many(directory: str, n: int) -> Run:
    """``Journal.append_many``, ``BATCH`` records a call (all checked first)."""
    batches = [[(RecordType.SEGMENT, sample_payload(i)) for i in range(start, min(start + BATCH, n))]
               for start in range(0, n, BATCH)]

    def work(j: Journal) -> None:
        for batch in batches:
            j.append_many(batch)
        j.sync()
    return _journal_run(directory, n, work)


def bench_kvj_typed(directory: str, n: int) -> Run:
    """The typed ``Journal.start`` (the same schema check, built from arguments)."""
    calls = [sample_start(i) for i in range(n)]

    def work(j: Journal) -> None:
        start = j.start
        for c in calls:
            start(**c)
        j.sync()
    return _journal_run(directory, n, work)


def bench_kvj_encoded(directory: str, n: int, policy: Optional[CommitPolicy] = None) -> Run:
    """The writer alone, payloads already encoded: framing and group commit."""
    payloads = [encode_payload(sample_payload(i)) for i in range(n)]

    def work(j: Journal) -> None:
        append = j.writer.append
        for p in payloads:
            append(RecordType.SEGMENT, p)
        j.sync()
    return _journal_run(directory, n, work, policy)


def bench_kvj_durable(directory: str, n: int, mirror: Optional[str] = None) -> Run:
    """``THREADS`` threads each appending its share of ``n`` records with ``durable=True``
    (each call returns once its group is fdatasynced, in ``mirror`` too)."""
    payloads = [sample_payload(i) for i in range(n)]
    share = [payloads[t::THREADS] for t in range(THREADS)]

    def work(j: Journal) -> None:
        def one(mine: List[Dict[str, object]]) -> None:
            for p in mine:
                j.append(RecordType.SEGMENT, p, durable=True)
        threads = [threading.Thread(target=one, args=(mine,)) for mine in share]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return _journal_run(directory, n, work, mirror=mirror)


def append_latency(directory: str, n: int, typed: bool = False) -> List[float]:
    """Caller-thread nanoseconds per checked ``Journal.append`` of a segment record (or, with
    ``typed``, per ``Journal.start``) at the default policy, committer running."""
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


def bench_jsonl(directory: str, n: int, every: int, budget: Optional[float] = None) -> Run:
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
    return Run(done / elapsed, float(every))


def bench_sqlite(directory: str, n: int, interval: Optional[float] = None) -> Run:
    """SQLite in WAL mode with synchronous=FULL, a commit per ``BATCH`` records, or with
    ``interval``, a commit once that many seconds passed since the last (checked every
    ``BATCH`` records)."""
    payloads = [sample_payload(i) for i in range(n)]
    db = sqlite3.connect(os.path.join(directory, "journal.db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE rec (lsn INTEGER PRIMARY KEY, body TEXT)")
    commits = 0

    def work() -> None:
        nonlocal commits
        last = time.perf_counter()
        db.execute("BEGIN")
        for start in range(0, n, BATCH):
            db.executemany("INSERT INTO rec VALUES (?, ?)",
                           [(i, json.dumps(payloads[i])) for i in range(start, min(start + BATCH, n))])
            now = time.perf_counter()
            if interval is None or now - last >= interval or start + BATCH >= n:
                db.execute("COMMIT")
                commits += 1
                last = now
                if start + BATCH < n:
                    db.execute("BEGIN")
    try:
        return Run(n / _timed(work), n / commits)
    finally:
        db.close()


def bench_floor(directory: str, n: int, batch: int = BATCH) -> Run:
    """Pre-encoded bytes, one write and fdatasync per ``batch`` records: no per-record work."""
    record = json.dumps(sample_payload(0)).encode()
    chunk = record * batch
    path = os.path.join(directory, "floor.bin")

    def work() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for _ in range(0, n, batch):
                os.write(fd, chunk)
                os.fdatasync(fd)
        finally:
            os.close(fd)
    return Run(n / _timed(work), float(batch))


@dataclass(frozen=True)
class Contender:
    name: str
    section: str
    threads: str  # appending threads, and what kvj adds
    loss: str  # the most a crash can lose, in records or time
    run: Callable[[str], Run]
    peers: Tuple[Optional[str], Optional[str]] = (None, None)  # (SQLite, floor) at the same records per fdatasync
    after_kvj: bool = False  # runs after kvj's default row in its round (it takes that row's time or group size)


def contenders(n: int, kvj_time: List[float], kvj_group: List[float]) -> List[Contender]:
    durable_n = max(THREADS, n // 20)  # each durable group waits for an fdatasync: fewer records
    same, dflt = (SQLITE_BATCH, FLOOR_BATCH), (SQLITE_DELAY, FLOOR_KVJ)
    delay = f"{DEFAULT.max_delay:g} s"
    kvj_loss = f"{DEFAULT.max_pending_records:,} rec or {delay} + 2 syncs"

    def kvj_default(d: str) -> Run:
        run = bench_kvj(d, n)
        kvj_time[0], kvj_group[0] = n / run.rate, run.per_sync
        return run

    return [
        Contender(f"kvj Journal.append, groups of {BATCH}", SAME_RATE, "1 +committer",
                  f"{GROUPS_OF_BATCH.max_pending_records} rec", lambda d: bench_kvj(d, n, GROUPS_OF_BATCH), same),
        Contender(f"kvj writer, pre-encoded, groups of {BATCH}", SAME_RATE, "1 +committer",
                  f"{GROUPS_OF_BATCH.max_pending_records} rec", lambda d: bench_kvj_encoded(d, n, GROUPS_OF_BATCH),
                  same),
        Contender(f"kvj Journal.append, {BATCH} pending at most", SAME_RATE, "1 +committer", f"{BATCH} rec",
                  lambda d: bench_kvj(d, n, PENDING_BATCH), same),
        Contender(f"seed batched: fsync per {BATCH} lines", SAME_RATE, "1", f"{BATCH} rec",
                  lambda d: bench_jsonl(d, n, BATCH), same),
        Contender(SQLITE_BATCH, SAME_RATE, "1", f"{BATCH} rec", lambda d: bench_sqlite(d, n), same),
        Contender(FLOOR_BATCH, SAME_RATE, "1", f"{BATCH} rec", lambda d: bench_floor(d, n), same),
        Contender(KVJ_DEFAULT, DEFAULT_POLICY, "1 +committer", kvj_loss, kvj_default, dflt),
        Contender(f"kvj Journal.append_many, {BATCH} a call", DEFAULT_POLICY, "1 +committer", kvj_loss,
                  lambda d: bench_kvj_many(d, n), dflt),
        Contender("kvj Journal.start (typed, schema-checked)", DEFAULT_POLICY, "1 +committer", kvj_loss,
                  lambda d: bench_kvj_typed(d, n), dflt),
        Contender("kvj writer, payload pre-encoded", DEFAULT_POLICY, "1 +committer", kvj_loss,
                  lambda d: bench_kvj_encoded(d, n), dflt),
        Contender(MIRROR_ROWS[0][0], DEFAULT_POLICY, "1 +committer +mirror", kvj_loss,
                  lambda d: bench_kvj(os.path.join(d, "j"), n, mirror=os.path.join(d, "m")), dflt),
        Contender(SQLITE_DELAY, DEFAULT_POLICY, "1", delay,
                  lambda d: bench_sqlite(d, n, DEFAULT.max_delay), dflt),
        Contender(FLOOR_KVJ, DEFAULT_POLICY, "1", "its rec/fsync",
                  lambda d: bench_floor(d, n, max(1, round(kvj_group[0]))), dflt, after_kvj=True),
        Contender(MIRROR_ROWS[1][1], DURABLE, f"{THREADS} +committer", f"{THREADS} rec, none acked",
                  lambda d: bench_kvj_durable(d, durable_n)),
        Contender(MIRROR_ROWS[1][0], DURABLE, f"{THREADS} +committer +mirror", f"{THREADS} rec, none acked",
                  lambda d: bench_kvj_durable(os.path.join(d, "j"), durable_n, mirror=os.path.join(d, "m"))),
        Contender("seed: JSON line + fsync per record (kvj's time)", DURABLE, "1", "1 rec",
                  lambda d: bench_jsonl(d, n, 1, budget=kvj_time[0]), after_kvj=True),
    ]


def _order(table: List[Contender], reverse: bool) -> List[Tuple[int, Contender]]:
    """The contenders in table order (or reversed), each ``after_kvj`` one moved right after
    kvj's default row."""
    order = list(enumerate(table))[::-1 if reverse else 1]
    rest = [o for o in order if not o[1].after_kvj]
    at = next(k for k, (_i, c) in enumerate(rest) if c.name == KVJ_DEFAULT) + 1
    return rest[:at] + [o for o in order if o[1].after_kvj] + rest[at:]


def _median(values: List[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(directory: Optional[str] = None, n: int = 100_000,
        repeat: int = 3) -> List[Dict[str, object]]:
    """Run every contender ``repeat`` times, interleaved (the order reversed every other round),
    in fresh directories; median rates and records per fdatasync, and the load average. A
    ratio is the median over rounds of the ratio within a round (each against the peer's run of
    the same round), which a machine whose load changes during the run shifts less."""
    base = tempfile.mkdtemp(prefix="kvj-bench-", dir=directory)
    kvj_time, kvj_group = [1.0], [float(BATCH)]
    table = contenders(n, kvj_time, kvj_group)
    runs: Dict[str, List[Run]] = {c.name: [] for c in table}
    load_before = os.getloadavg()[0]
    try:
        for round_ in range(repeat):
            for i, c in _order(table, reverse=round_ % 2 == 1):
                path = os.path.join(base, f"{round_}-{i}")
                os.mkdir(path)
                runs[c.name].append(c.run(path))
                shutil.rmtree(path)
        lat = {}
        for name, typed in (("kvj Journal.append, caller thread", False), ("kvj Journal.start, caller thread", True)):
            lat_dir = os.path.join(base, f"latency-{typed}")
            os.mkdir(lat_dir)
            lat[name] = append_latency(lat_dir, n, typed)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rate = {name: _median([r.rate for r in rs]) for name, rs in runs.items()}
    rows: List[Dict[str, object]] = []
    for c in table:
        row: Dict[str, object] = {"system": c.name, "section": c.section, "fsync": True, "threads": c.threads,
                                  "records_per_fsync": _median([r.per_sync for r in runs[c.name]]),
                                  "loss_window": c.loss, "records_per_s": rate[c.name]}
        for key, peer in zip(("vs_sqlite", "vs_floor"), c.peers):  # paired: each round against its own peer run
            row[key] = _median([mine.rate / theirs.rate for mine, theirs in zip(runs[c.name], runs[peer])]) \
                if peer else None
        plain = dict(MIRROR_ROWS).get(c.name)
        if plain is not None:
            row["vs_unmirrored"] = rate[c.name] / rate[plain]
        rows.append(row)
    for name, ns in lat.items():
        rows.append({"system": name, "p50_us": ns[len(ns) // 2] / 1000, "p99_us": ns[int(len(ns) * 0.99)] / 1000})
    rows.append({"system": "load average", "before": load_before, "after": os.getloadavg()[0],
                 "cpus": os.cpu_count(), "records": n, "rounds": repeat})
    return rows


def format_table(rows: List[Dict[str, object]]) -> str:
    load = next(r for r in rows if r["system"] == "load average")
    lines = [f"{load['records']:,} records of about 300 B per row, median of {load['rounds']} rounds (interleaved, "
             f"order reversed every other round); load average {load['before']:.2f} before, {load['after']:.2f} "
             f"after, {load['cpus']} CPUs",
             "every row fsyncs (fdatasync; SQLite synchronous=FULL) before it counts a record durable; threads: "
             "appending threads, and the threads kvj adds; x SQLite, x floor: against the rows of the same "
             "section, which sync as often (median of the rounds' ratios)",
             f"{'system':<48} {'threads':>21} {'rec/fsync':>9} {'worst-case loss':>26} {'median rec/s':>13} "
             f"{'x SQLite':>8} {'x floor':>8}"]
    section = None
    for row in rows:
        if "records_per_s" not in row:
            continue
        if row["section"] != section:
            section = row["section"]
            lines.append(f"-- {section} " + "-" * (141 - len(str(section))))
        ratios = [f"{row[k]:>8.2f}" if row[k] is not None else f"{'-':>8}" for k in ("vs_sqlite", "vs_floor")]
        lines.append(f"{row['system']:<48} {row['threads']:>21} {row['records_per_fsync']:>9,.0f} "
                     f"{row['loss_window']:>26} {row['records_per_s']:>13,.0f} {ratios[0]} {ratios[1]}")
    for row in rows:
        if "vs_unmirrored" in row:
            lines.append(f"{row['system']:<48} {row['vs_unmirrored']:.2f} x the same without a mirror")
    for row in rows:
        if "p50_us" in row:
            lines.append(f"{row['system']:<48} p50 {row['p50_us']:.2f} us, p99 {row['p99_us']:.2f} us "
                         "(default policy)")
    return "\n".join(lines)
