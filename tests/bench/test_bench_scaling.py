"""The scaling benchmark on tiny sizes: the data it builds is what it says, every operation
runs to success in its own process, compact collects the unreferenced half, and the table
shows cost per unit and growth between sizes."""

import os

from benchmarks import scaling
from kvj.journal.replay import replay
from kvj.segments.store import SegmentStore


def test_built_store_and_journal_then_every_operation(tmp_path):
    store, journal = str(tmp_path / "store"), str(tmp_path / "journal")
    infos = scaling.build_store(store, 16)
    with SegmentStore(store) as s:
        assert sorted(s.keys()) == sorted({i.key for i in infos}) and len(infos) == 16
        assert all(s.verify(i.key) == i for i in infos[:3])
    scaling.build_journal(journal, store, infos, 19, live_every=2)  # requests 0 (live) and 1 (ended)
    state = replay(journal)
    assert state.last_lsn == 19
    live = state.in_flight()
    assert [r.id for r in live] == ["req-0000000"] and len(live[0].segments) == 8
    referenced = set(state.referenced_keys())
    assert referenced == {i.key for i in infos[:8]}

    rows = scaling.measure("store", 16, "segment", journal, store, str(tmp_path))
    assert [r["operation"] for r in rows] == [name for name, _args in scaling.STARTUP] + [scaling.LIBRARY_REPLAY] + \
        [name for name, _args, _copy in scaling.OPERATIONS]
    for r in rows:
        assert r["status"] == 0, r
        assert r["seconds"] > 0 and r["rss_mib"] > 0
    startup = rows[:len(scaling.STARTUP)]
    assert [r["torch"] for r in startup] == [False] * len(startup)  # the incident commands load no torch
    assert all(r["seconds"] == r["wall"] for r in startup)  # timed as whole processes
    with SegmentStore(store) as s:
        assert set(s.keys()) == referenced  # compact --grace 0 collected the ended request's 8
    assert not os.path.exists(tmp_path / "journal-copy")  # recover ran on a copy, since removed
    assert not os.path.exists(os.path.join(journal, "recovery"))


def test_run_builds_measures_and_cleans_up(tmp_path, monkeypatch):
    # every operation ran in the test above; here one is enough to see run() build, measure and clean up
    monkeypatch.setattr(scaling, "OPERATIONS", scaling.OPERATIONS[:1])
    result = scaling.run(str(tmp_path), records=[19], segments=[])
    assert [(r["operation"], r["size"]) for r in result["rows"]] == \
        [(name, 19) for name, _args in scaling.STARTUP] + [(scaling.LIBRARY_REPLAY, 19)] + \
        [(name, 19) for name, _args, _copy in scaling.OPERATIONS]
    assert all(r["status"] == 0 for r in result["rows"]) and result["baseline"]["status"] == 0
    table = scaling.format_table(result)
    assert "built journal of 19 records" in table and "load average" in table and "CPUs" in table
    assert os.listdir(tmp_path) == []  # the work directory is removed


def test_table_cost_per_unit_and_growth():
    def row(op, size, seconds, rss, status=0):
        return {"axis": "journal", "operation": op, "size": size, "unit": "record", "status": status,
                "seconds": seconds, "wall": seconds + 1, "rss_mib": rss, "stderr": "kvj: error: boom" if status else ""}

    table = scaling.format_table({"baseline": {"wall": 0.5, "rss_mib": 100.0}, "builds": [], "rows": [
        row("replay", 10_000, 0.1, 110.0), row("replay", 100_000, 1.5, 220.0), row("fsck", 10_000, 0.2, 120.0, 65),
        {**row("status (process)", 10_000, 0.3, 60.0), "torch": False}]})
    lines = table.splitlines()
    assert lines[5].split()[-4:] == ["whole", "process,", "no", "torch"]
    assert lines[2].split() == ["replay", "10,000", "records", "0.100", "10.00", "110", "MiB"]
    assert lines[3].split() == ["replay", "100,000", "records", "1.500", "15.00", "15.0", "220", "MiB", "2.00"]
    assert lines[4].endswith("exit 65: kvj: error: boom")
