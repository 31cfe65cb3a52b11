"""Scaling benchmark: time and peak memory of replay, recover, fsck, compact and
``inspect --stats`` as a journal grows (records) and as a store grows (segments), and how
long the commands an incident starts with (``status``, ``inspect --stats``, ``fsck -n``) take
as whole processes.

Each operation runs as ``kvj ...`` in a fresh child process: its time is measured inside
the child around the command (interpreter start-up and imports excluded), its peak RSS is
the child's own high-water mark (``VmHWM``, imports included: the same child running
``kvj --version`` is printed as the baseline; ``wait4``'s ``ru_maxrss``, used where there
is no ``/proc``, also counts the pages the child shared with this process, torch's among them,
before it ran ``kvj``). The start-up rows (``status (process)``...)
are the wall time of a plain ``kvj`` process instead, everything included, and say whether
it imported torch. Per-record or per-segment cost and the growth
ratio to the previous size make linearity visible: for linear work the time grows by the
size ratio (10x for 10x the records) and the cost per unit stays flat.

Data is built with kvj's own writer and store, fast:

- the store: 256-byte float16 tensors, each under its own layout (so its own key), put by ``SegmentStore`` (one file each,
  the real format and digests) through an FS whose fsyncs are no-ops, then one ``sync()``;
- the journal: requests of START, 8 SEGMENT and END records appended with
  ``Journal.append_many`` (records checked against the schema, framed and group-committed
  by the real writer, 10,000 records per commit).

Journal axis: a store of 1,000 segments, every tenth request left live (recover plans and
verifies it). Segment axis: each segment named by one record, every other request live,
so half the store is referenced (recover and fsck verify it) and half is collectable
(compact, run last with ``--grace 0``, deletes it). ``recover`` (real) runs on a copy of
the journal; the others run on the original.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from kvj.fileio import FS

JOURNAL_SIZES = (10_000, 100_000, 1_000_000)
SEGMENT_SIZES = (1_000, 10_000, 100_000)
JOURNAL_AXIS_SEGMENTS = 1_000
SEGMENTS_PER_REQUEST = 8
RECORDS_PER_REQUEST = SEGMENTS_PER_REQUEST + 2  # START, the segments, END
TENSOR_ELEMENTS = 128  # float16: 256 raw bytes per segment

#: (name, kvj arguments after the journal and store options, runs on a copy of the journal)
OPERATIONS: List[Tuple[str, List[str], bool]] = [
    ("replay", ["replay", "--json"], False),
    ("recover --dry-run", ["recover", "--dry-run", "--json"], False),
    ("recover", ["recover", "--json"], True),
    ("fsck", ["fsck", "--json"], False),
    ("inspect --stats", ["inspect", "--stats", "--json"], False),
    ("status", ["status", "--json"], False),
    ("compact", ["compact", "--grace", "0", "--json"], False),  # last: it changes the journal and store
]
STORE_OPTION = {"replay": False, "inspect": False}
#: The row of the library call ``kvj.journal.replay.replay`` (in a fresh process, before the commands).
LIBRARY_REPLAY = "kvj.replay()"
#: (name, kvj arguments after the journal and store options): timed as whole processes.
STARTUP: List[Tuple[str, List[str]]] = [
    ("status (process)", ["status", "--json"]),
    ("inspect --stats (process)", ["inspect", "--stats", "--json"]),
    ("fsck -n (process)", ["fsck", "-n", "--json"]),
]

#: What a child reports when it is done: seconds, whether it imported torch, its peak RSS (kB).
_REPORT = ("def report(t0):\n"
           "    try:\n"
           "        hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
           "    except (OSError, IndexError):\n"
           "        hwm = ''\n"
           "    sys.stderr.write(f'\\nkvj-bench-seconds {time.perf_counter() - t0:.6f}\\n'\n"
           "                     f'kvj-bench-torch {int(\"torch\" in sys.modules)}\\nkvj-bench-hwm {hwm}\\n')\n")
#: The child imports what the commands import lazily before the clock starts.
_CHILD = ("import sys, time\n" + _REPORT +
          "import torch, kvj.ops.compact, kvj.ops.fsck, kvj.ops.inspection, kvj.ops.recover, kvj.segments.check, kvj.segments.store\n"
          "from kvj.cli.main import app, run\n"
          "t0 = time.perf_counter()\n"
          "status = run(app, sys.argv[1:], 'kvj')\n"
          "report(t0)\n"
          "sys.exit(status)\n")
#: ``kvj.journal.replay.replay`` itself, the library call (``kvj replay --json`` adds printing every request).
_LIBRARY_CHILD = ("import sys, time\n" + _REPORT +
                  "from kvj.journal.replay import replay\n"
                  "t0 = time.perf_counter()\n"
                  "state = replay(sys.argv[1])\n"
                  "report(t0)\n")
#: A plain ``kvj`` process, imports and all.
_PLAIN_CHILD = ("import sys, time\n" + _REPORT +
                "t0 = time.perf_counter()\n"
                "from kvj.cli.main import app, run\n"
                "try:\n"
                "    status = run(app, sys.argv[1:], 'kvj')\n"
                "finally:\n"
                "    report(t0)\n"
                "sys.exit(status)\n")


class _NoSyncFS(FS):
    """Build-time only: the store's fsyncs are skipped (one ``os.sync()`` follows the build)."""

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: Any) -> None:
        pass


def build_store(root: str, count: int) -> List[Any]:
    """Put ``count`` distinct small tensors into a segment store at ``root``; their ``SegmentInfo``s."""
    import torch

    from kvj.segments.store import SegmentStore

    base = torch.arange(TENSOR_ELEMENTS, dtype=torch.float16)
    infos = []
    with SegmentStore(root, fs=_NoSyncFS(), threads=1) as store:
        for i in range(count):
            infos.append(store.put(base, codec="raw", layout={"block": i}))  # the layout makes each key distinct
    os.sync()
    return infos


def _requests(infos: Sequence[Any], records: int, live_every: int) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(type, payload) records: requests of START, segments and END; every ``live_every``-th has no END."""
    from kvj.journal.records import RecordType

    n = 0
    request = 0
    k = 0
    while n < records:
        rid = f"req-{request:07d}"
        yield RecordType.START, {"id": rid, "prompt_hash": None, "tokens": [1, 2, 3], "meta": {}}
        n += 1
        for seg in range(SEGMENTS_PER_REQUEST):
            if n >= records:
                return
            info = infos[k % len(infos)]
            k += 1
            yield RecordType.SEGMENT, {"id": rid, "seg": seg, "key": info.key, "tokens": [16 * seg, 16 * seg + 16],
                                       "layout": info.layout or {}, "raw_size": info.raw_size,
                                       "stored_size": info.stored_size, "digest": info.digest, "codec": info.codec}
            n += 1
        if n >= records:
            return
        if request % live_every:
            yield RecordType.END, {"id": rid, "status": "ok"}
            n += 1
        request += 1


def build_journal(path: str, store: str, infos: Sequence[Any], records: int, live_every: int) -> None:
    """Append ``records`` records (see ``_requests``) to a new journal at ``path`` with kvj's writer."""
    from kvj.journal.journal import Journal
    from kvj.journal.config import CommitPolicy

    batch: List[Tuple[int, Dict[str, Any]]] = []
    with Journal.open(path, store=store, policy=CommitPolicy(max_delay=1.0, max_records=10_000)) as j:
        for rec in _requests(infos, records, live_every):
            batch.append(rec)
            if len(batch) == 1000:
                j.append_many(batch)
                batch = []
        if batch:
            j.append_many(batch)
        j.sync()


def run_child(argv: List[str], cwd: Optional[str] = None, plain: bool = False,
              child: Optional[str] = None) -> Dict[str, Any]:
    """Run ``kvj argv`` in a fresh interpreter; its exit status, seconds (inside; with ``plain``
    the whole process from its first line, and whether it imported torch) and peak RSS.
    ``child``: another child script, given ``argv``, instead."""
    script = child or (_PLAIN_CHILD if plain else _CHILD)
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", script, *argv],
                                stdout=subprocess.DEVNULL, stderr=err,
                                cwd=cwd, env={**os.environ, "COLUMNS": "200"})
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read().decode(errors="replace")
    seconds = torch = None
    rss_kb = usage.ru_maxrss
    for line in text.splitlines():
        if line.startswith("kvj-bench-seconds "):
            seconds = float(line.split()[1])
        elif line.startswith("kvj-bench-torch "):
            torch = line.split()[1] == "1"
        elif line.startswith("kvj-bench-hwm ") and line.split()[1:]:
            rss_kb = int(line.split()[1])
    message = [line for line in text.splitlines() if line.strip() and not line.startswith("kvj-bench-")]
    row = {"status": proc.returncode, "seconds": seconds, "wall": wall, "rss_mib": rss_kb / 1024,
           "stderr": message[-1] if message else ""}
    if plain:
        row.update(seconds=wall if seconds is not None else None, torch=torch)
    return row


def measure(axis: str, size: int, unit: str, journal: str, store: str, work: str,
            log: Any = None) -> List[Dict[str, Any]]:
    """Run every operation on ``journal`` and ``store`` (the start-up rows first, then the library's
    replay, compact last: it changes both); one row each."""
    rows = []
    def argv(args: List[str], target: str) -> List[str]:
        return [args[0], "-j", target] + (["--store", store] if STORE_OPTION.get(args[0], True) else []) + args[1:]

    for name, args in STARTUP:
        child = run_child(argv(args, journal), plain=True)
        rows.append({"axis": axis, "operation": name, "size": size, "unit": unit, **child})
        if log:
            torch = "imported" if child["torch"] else "not imported"
            log(f"{name} on {size} {unit}s: {child['seconds'] or 0:.3f} s, torch {torch}, exit {child['status']}")
    child = run_child([journal], child=_LIBRARY_CHILD)
    rows.append({"axis": axis, "operation": LIBRARY_REPLAY, "size": size, "unit": unit, **child})
    if log:
        log(f"{LIBRARY_REPLAY} on {size} {unit}s: {child['seconds'] or 0:.3f} s, {child['rss_mib']:.0f} MiB, "
            f"exit {child['status']}")
    for name, args, on_copy in OPERATIONS:
        target = journal
        if on_copy:
            target = os.path.join(work, "journal-copy")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(journal, target)
        child = run_child(argv(args, target))
        rows.append({"axis": axis, "operation": name, "size": size, "unit": unit, **child})
        if log:
            log(f"{name} on {size} {unit}s: {child['seconds'] or 0:.3f} s, {child['rss_mib']:.0f} MiB, "
                f"exit {child['status']}")
        if on_copy:
            shutil.rmtree(target)
    return rows


def run(directory: Optional[str] = None, records: Sequence[int] = JOURNAL_SIZES,
        segments: Sequence[int] = SEGMENT_SIZES, log: Any = None) -> Dict[str, Any]:
    """Build each journal and store and time every operation on it; rows plus the baseline child.

    ``log`` (a callable taking a line) hears about each build, as the largest take minutes.
    """
    say = log or (lambda _line: None)
    work = tempfile.mkdtemp(prefix="kvj-bench-scaling-", dir=directory)
    rows: List[Dict[str, Any]] = []
    builds: List[Dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    try:
        baseline = run_child(["--version"])
        say(f"baseline: kvj --version {baseline['wall']:.2f} s, {baseline['rss_mib']:.0f} MiB")
        store = os.path.join(work, "store-journal-axis")
        infos = build_store(store, JOURNAL_AXIS_SEGMENTS) if records else []
        for n in records:
            path = os.path.join(work, f"journal-{n}")
            t0 = time.perf_counter()
            build_journal(path, store, infos, n, live_every=10)
            builds.append({"what": f"journal of {n} records", "seconds": time.perf_counter() - t0})
            say(f"built {builds[-1]['what']} in {builds[-1]['seconds']:.1f} s")
            rows += measure("journal", n, "record", path, store, work, say)
            shutil.rmtree(path)
        shutil.rmtree(store, ignore_errors=True)
        for s in segments:
            store = os.path.join(work, f"store-{s}")
            path = os.path.join(work, f"journal-{s}-segments")
            t0 = time.perf_counter()
            infos = build_store(store, s)
            build_journal(path, store, infos, -(-s // SEGMENTS_PER_REQUEST) * RECORDS_PER_REQUEST, live_every=2)
            builds.append({"what": f"store of {s} segments", "seconds": time.perf_counter() - t0})
            say(f"built {builds[-1]['what']} (and its journal) in {builds[-1]['seconds']:.1f} s")
            rows += measure("store", s, "segment", path, store, work, say)
            shutil.rmtree(path)
            shutil.rmtree(store)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"baseline": baseline, "builds": builds, "rows": rows,
            "load": {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()}}


def format_table(result: Dict[str, Any]) -> str:
    """One line per operation and size: seconds, µs per unit, peak RSS, growth over the previous size."""
    base = result["baseline"]
    lines = [f"each operation: kvj in a fresh process; seconds inside it (start-up and imports excluded: "
             f"{base['wall']:.2f} s), peak RSS of the whole process (imports alone: {base['rss_mib']:.0f} MiB)",
             f"{'operation':<18} {'size':>16} {'seconds':>9} {'µs/unit':>9} {'x time':>7} "
             f"{'peak RSS':>10} {'x RSS':>6}  note"]
    previous: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for r in result["rows"]:
        key = (r["axis"], r["operation"])
        size = f"{r['size']:,} {r['unit']}s"
        note = "" if r["status"] == 0 else f"exit {r['status']}: {r['stderr']}"
        if "torch" in r:
            whole = "whole process, imports torch" if r["torch"] else "whole process, no torch"
            note = f"{whole}; {note}" if note else whole
        if r["seconds"] is None:
            lines.append(f"{r['operation']:<18} {size:>16} {'-':>9} {'-':>9} {'':>7} "
                         f"{r['rss_mib']:>7.0f} MiB {'':>6}  {note}")
            continue
        per = r["seconds"] / r["size"] * 1e6
        growth = rss = ""
        prev = previous.get(key)
        if prev is not None and prev["seconds"]:
            growth = f"{r['seconds'] / prev['seconds']:.1f}"
            rss = f"{r['rss_mib'] / prev['rss_mib']:.2f}"
        lines.append(f"{r['operation']:<18} {size:>16} {r['seconds']:>9.3f} {per:>9.2f} {growth:>7} "
                     f"{r['rss_mib']:>7.0f} MiB {rss:>6}  {note}")
        previous[key] = r
    lines.append("x time, x RSS: against the previous size of the same operation (10x the size: 10.0 is linear)")
    for b in result["builds"]:
        lines.append(f"built {b['what']} in {b['seconds']:.1f} s")
    load = result.get("load")
    if load:
        lines.append(f"{load['cpus']} CPUs, load average {load['before']:.2f} before the run, {load['after']:.2f} "
                     "after; every command runs on one thread, except fsck's and recover's segment checks "
                     "(8 threads); no row fsyncs except recover's and compact's own writes")
    return "\n".join(lines)
