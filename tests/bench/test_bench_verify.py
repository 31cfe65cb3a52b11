"""The verification benchmark runs end to end on a small store: fsck reads every segment in
full (or, headers only, all but one), the floor reads every file, and the table names the
threads and the load."""

from benchmarks import verify as bench


def test_verify_benchmark_rows_and_table(tmp_path):
    result = bench.run(40, str(tmp_path), rounds=1)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"kvj fsck", "kvj fsck, headers only", bench.FLOOR}
    assert all(r["segments"] == 40 for r in rows.values())
    assert rows[bench.FLOOR]["vs_floor"] == 1.0 and rows["kvj fsck"]["cpu_vs_floor"] > 0
    assert result["threads"] >= 1 and result["segment_file_bytes"] > 0
    table = bench.format_table(result)
    assert "40 segments" in table and "load average" in table and "CPU x floor" in table
    assert list(tmp_path.iterdir()) == []  # the store and journal are removed
