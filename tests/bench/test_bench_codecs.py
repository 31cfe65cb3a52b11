"""The codec benchmark runs end to end on a small size: every contender round-trips exactly,
per-block rows (one segment per block, and packs) report blocks per second and the fsyncs
their saves made, and the table says how they compare with the whole."""

from benchmarks import codecs as bench


def test_codec_benchmark_rows_and_table(tmp_path):
    rows = bench.run(1, str(tmp_path), only=["kv-small-model-bf16"])
    methods = [r["method"] for r in rows]
    assert {"kvj auto", "kvj auto, per-block flush", "torch.save", "safetensors", "safetensors (mmap)",
            "zstd-1"} <= set(methods)
    assert all(r["exact"] for r in rows) and {r["dataset"] for r in rows} == {"kv-small-model-bf16"}
    block = next(r for r in rows if r["method"] == "kvj auto, per-block flush")
    assert block["block_bytes"] == 24 * 2 * 16 * 2 * 64 * 2 and block["blocks"] >= 4
    assert block["blocks_per_s_save"] > 0 and block["save_vs_whole"] > 0 and block["load_vs_whole"] > 0
    packed = next(r for r in rows if r["method"] == "kvj auto, per-block flush, packs")
    assert packed["exact"] and packed["blocks"] == block["blocks"] and packed["load_vs_whole"] > 0
    assert packed["file_syncs"] == packed["steps"] < block["file_syncs"]  # one fdatasync per step, one fsync per block
    assert packed["save_cpu_s"] > 0 and packed["save_cpu_vs_whole"] > 0
    table = bench.format_table(rows)
    assert "kv-small-model-bf16 per-block flush, packs:" in table and "blocks/s" in table
    assert list(bench.codec_names()) == [m.split()[1] for m in methods if m.startswith("kvj ") and "," not in m]
