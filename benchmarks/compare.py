"""Two versions of kvj side by side on the same data: replay, status, fsck, append latency, restore.

``python -m benchmarks.compare --base REV`` exports revision REV's ``kvj/`` (``git archive``) next to
this checkout's and runs each measurement in a fresh process of each version in turn, the order
swapped every round; the table shows medians and the ratio new/base (times: below 1 the new code is
faster; GB/s: above 1). The journals and the store are built once, by this checkout's code: the on-disk formats
are the same for both. Machines here are shared and noisy: read the ratio column.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

from benchmarks.scaling import build_journal, build_store

#: (name, unit, child code): the code prints one JSON number, measured inside the child.
CHILD = {
    "replay": ("us/record", """
import json, sys, time, kvj
t = time.perf_counter(); state = kvj.replay(sys.argv[1]); took = time.perf_counter() - t
print(json.dumps(took / state.last_lsn * 1e6))"""),
    "append": ("us p50/p99", """
import json, sys, time, kvj
from kvj.journal.records import RecordType
lat = []
with kvj.Journal.open(sys.argv[1]) as j:
    for i in range(20000):
        t = time.perf_counter_ns(); j.append(RecordType.ALLOC, {"device": "d", "addr": i, "size": 1, "tag": "x"})
        lat.append(time.perf_counter_ns() - t)
lat.sort()
print(json.dumps([lat[len(lat) // 2] / 1e3, lat[len(lat) * 99 // 100] / 1e3]))"""),
    "restore": ("GB/s", """
import json, sys, time, torch
from kvj.segments.store import SegmentStore
with SegmentStore(sys.argv[1]) as store:
    key = sys.argv[2]; out = torch.empty(int(sys.argv[3]), dtype=torch.uint8)
    store.get(key, out=out)
    t = time.perf_counter(); store.get(key, out=out); took = time.perf_counter() - t
print(json.dumps(int(sys.argv[3]) / took / 1e9))"""),
}
#: Commands timed as whole processes (wall clock, start-up included): name -> kvj arguments.
COMMANDS = {"kvj status": ["status", "--json"], "kvj fsck": ["fsck", "-n", "--json"]}


def export(rev: str, where: str) -> str:
    """``kvj/`` of revision ``rev`` under ``where``; the directory to put on PYTHONPATH."""
    tree = os.path.join(where, f"kvj-{rev}")
    os.makedirs(tree)
    archive = subprocess.run(["git", "archive", rev, "kvj"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def child(tree: str, code: str, *args: str) -> object:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def command(tree: str, args: List[str]) -> float:
    import time
    env = {**os.environ, "PYTHONPATH": tree}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvj.cli.main", *args], env=env, capture_output=True, check=False)
    return time.perf_counter() - t


def run(base: str, rounds: int = 3, directory: str | None = None) -> Dict[str, Tuple[str, object, object]]:
    """Medians per version: {measurement: (unit, base, new)}."""
    import torch

    from kvj.segments.store import SegmentStore

    work = tempfile.mkdtemp(prefix="kvj-compare-", dir=directory)
    try:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        trees = {"base": export(base, work), "new": here}
        store = os.path.join(work, "segments")
        infos = build_store(store, 1000)
        journals = {}
        for n in (100_000, 1_000_000):
            journals[n] = os.path.join(work, f"j{n}")
            build_journal(journals[n], store, infos, n, live_every=10)
        raw = 256 << 20
        with SegmentStore(store) as s:
            big = s.put(torch.randn(raw // 2).to(torch.bfloat16), layout={"compare": 1}).key
        results: Dict[str, Dict[str, List[object]]] = {}
        for r in range(rounds):
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            for version in order:
                tree = trees[version]
                for n, path in journals.items():
                    results.setdefault(f"replay {n:,} records", {}).setdefault(version, []).append(
                        child(tree, CHILD["replay"][1], path))
                for name, args in COMMANDS.items():
                    results.setdefault(f"{name} at 100,000 records", {}).setdefault(version, []).append(
                        command(tree, [*args, "-j", journals[100_000], "--store", store]))
                scratch = os.path.join(work, f"append-{version}-{r}")
                results.setdefault("append (caller thread)", {}).setdefault(version, []).append(
                    child(tree, CHILD["append"][1], scratch))
                results.setdefault("restore (verified load)", {}).setdefault(version, []).append(
                    child(tree, CHILD["restore"][1], store, big, str(raw)))
        units = {"append (caller thread)": "us p50/p99", "restore (verified load)": "GB/s"}
        out: Dict[str, Tuple[str, object, object]] = {}
        for name, by in results.items():
            unit = units.get(name, "us/record" if name.startswith("replay") else "s")
            out[name] = (unit, _median(by["base"]), _median(by["new"]))
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _median(values: List[object]) -> object:
    if isinstance(values[0], list):
        return [statistics.median(v[i] for v in values) for i in range(len(values[0]))]  # type: ignore[index]
    return statistics.median(values)  # type: ignore[arg-type]


def format_table(base: str, result: Dict[str, Tuple[str, object, object]]) -> str:
    lines = [f"{'measurement':34} {'unit':>11} {'base ' + base[:9]:>18} {'new':>18} {'new/base':>9}"]
    for name, (unit, old, new) in result.items():
        if isinstance(old, list):
            shown_old, shown_new = "/".join(f"{v:.2f}" for v in old), "/".join(f"{v:.2f}" for v in new)  # type: ignore
            ratio = "/".join(f"{n / o:.2f}x" for o, n in zip(old, new))  # type: ignore[arg-type]
        else:
            shown_old, shown_new, ratio = f"{old:.3f}", f"{new:.3f}", f"{new / old:.2f}x"  # type: ignore[operator]
        lines.append(f"{name:34} {unit:>11} {shown_old:>18} {shown_new:>18} {ratio:>9}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare with (git rev)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    print(format_table(args.base, run(args.base, args.rounds, args.dir)))
