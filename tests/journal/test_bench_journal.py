"""The journal benchmark runs end to end on a small count: every contender reports a rate and
its ratios to SQLite and the floor come from the same run; the latency rows are ordered."""

from kvj.bench import journal as bench


def test_journal_benchmark_rows_and_table(tmp_path):
    rows = bench.run(str(tmp_path), n=500, repeat=1)
    rates = {r["system"]: r for r in rows if "records_per_s" in r}
    assert {"kvj Journal.append (schema-checked)", "kvj Journal.append_many, 100 a call",
            "kvj Journal.start (typed, schema-checked)", "kvj writer, payload pre-encoded"} <= set(rates)
    sqlite = next(r for name, r in rates.items() if name.startswith("SQLite"))
    floor = next(r for name, r in rates.items() if name.startswith("floor"))
    assert sqlite["vs_sqlite"] == 1.0 and floor["vs_floor"] == 1.0
    for r in rates.values():
        assert r["records_per_s"] > 0
        assert abs(r["vs_sqlite"] * sqlite["records_per_s"] - r["records_per_s"]) < 1e-6 * r["records_per_s"]
    mirrored = {name: r["vs_unmirrored"] for name, r in rates.items() if "vs_unmirrored" in r}
    assert set(mirrored) == {m for m, _plain in bench.MIRROR_ROWS}
    for name, plain in bench.MIRROR_ROWS:  # the ratio to the same run's row without a mirror
        rate = rates[name]["records_per_s"]
        assert abs(mirrored[name] * rates[plain]["records_per_s"] - rate) < 1e-6 * rate
    latency = [r for r in rows if "p50_us" in r]
    assert [r["system"] for r in latency] == ["kvj Journal.append, caller thread", "kvj Journal.start, caller thread"]
    assert all(0 < r["p50_us"] <= r["p99_us"] for r in latency)
    table = bench.format_table(rows)
    assert all(name in table for name in rates) and "p99" in table and "without a mirror" in table
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself
