"""The journal benchmark runs end to end on a small count: every contender reports a rate, how
many records each fdatasync made durable (read back from what it wrote) and its worst-case
loss; its ratios come from the peers of its own section in the same run (the same records
per fdatasync), round by round; the latency rows are ordered; the table says the load average and threads."""

from benchmarks import journal as bench


def test_journal_benchmark_rows_and_table(tmp_path):
    rows = bench.run(str(tmp_path), n=2000, repeat=2)
    rates = {r["system"]: r for r in rows if "records_per_s" in r}
    assert {"kvj Journal.append (schema-checked)", "kvj Journal.append_many, 100 a call",
            "kvj Journal.start (typed, schema-checked)", "kvj writer, payload pre-encoded",
            "kvj Journal.append, groups of 100", bench.SQLITE_BATCH, bench.SQLITE_DELAY, bench.FLOOR_BATCH,
            bench.FLOOR_KVJ} <= set(rates)
    for r in rates.values():
        assert r["records_per_s"] > 0 and r["fsync"] is True and r["loss_window"] and r["threads"]
        sqlite, floor = next(c.peers for c in bench.contenders(1, [1.0], [1.0]) if c.name == r["system"])
        for key, peer in (("vs_sqlite", sqlite), ("vs_floor", floor)):
            if peer is None:
                assert r[key] is None
            else:
                assert rates[peer]["section"] == r["section"] and r[key] > 0
                if r["system"] == peer:
                    assert r[key] == 1.0
    same = [r for r in rates.values() if r["section"] == bench.SAME_RATE]
    assert len(same) == 6 and all(r["records_per_fsync"] == bench.BATCH for r in same)  # like for like
    kvj = rates["kvj Journal.append (schema-checked)"]
    assert kvj["records_per_fsync"] >= 1 and rates[bench.FLOOR_KVJ]["records_per_fsync"] == \
        max(1, round(kvj["records_per_fsync"]))  # the floor synced kvj's median group
    assert rates[bench.SQLITE_DELAY]["records_per_fsync"] >= bench.BATCH
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
    assert "load average" in table and "rec/fsync" in table and "worst-case loss" in table and "threads" in table
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself


def test_records_per_group_reads_what_the_writer_wrote(tmp_path):
    from kvj import CommitPolicy, Journal

    with Journal.open(tmp_path, policy=CommitPolicy(max_group_records=7, max_pending_records=7)) as j:
        for i in range(70):
            j.alloc("cuda:0", i, 1)
        j.sync()
    assert bench.records_per_group(str(tmp_path)) == 7
