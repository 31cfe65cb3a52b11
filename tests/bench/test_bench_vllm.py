"""``kvj bench vllm``: medians, ratios and the printed tables from engines' job results, and its
usage errors. (A whole run takes minutes of engine time: it is a benchmark, not a test.)"""

from __future__ import annotations

import subprocess
import sys

from benchmarks.vllm import format_table, summarize


def _run(seconds: float, generated: int, prompt: int = 0, **counters: int) -> dict:
    return {"seconds": seconds, "generate_seconds": seconds / 2, "generated": generated, "prompt": prompt,
            "cached": counters.pop("cached", 0), "counters": counters}


def test_medians_ratios_and_tables() -> None:
    kv = {"fsyncs": 30, "steps": 20, "bytes_stored": 4096, "blocks_saved": 60}
    decode = {"plain": [_run(s, 2048) for s in (2.0, 1.0, 4.0)],
              "kvj": [_run(s, 2048, **kv) for s in (2.5, 9.0, 2.2)],
              "kvj-raw": [_run(s, 2048, **kv) for s in (2.0, 2.0, 2.0)]}
    prefill = {"plain": [_run(1.0, 16, 4096)] * 3, "kvj": [_run(2.0, 16, 4096, **kv)] * 3}
    ttft = {"plain": [_run(s, 1) for s in (0.6, 1.0, 0.4)], "kvj": [_run(0.6, 1, **kv)] * 3,
            "kvj-durable": [_run(0.8, 1, **kv)] * 3}
    restart = {"plain": [_run(0.6, 1)] * 3, "kvj-restarted": [_run(0.2, 1, cached=2048), _run(0.4, 1, cached=2016),
                                                              _run(0.2, 1, cached=2048)],
               "example-restarted": [_run(0.2, 1, cached=2048)] * 3}
    samples = [{"t": 1.0, "generated": 100, "tokens_durable": 90, "blocks_durable": 6, "backlog_blocks": 4},
               {"t": 10.5, "generated": 1000, "tokens_durable": 1000, "blocks_durable": 50, "backlog_blocks": 0}]
    sustained = {"plain": {"samples": [{"t": 10.0, "generated": 1100}], "generate_seconds": 10.0, "requests": 9,
                           "blocks": 50},
                 "kvj": {"samples": samples, "generate_seconds": 10.0, "requests": 8, "blocks": 50}}
    result = summarize({"decode": decode, "prefill": prefill, "ttft": ttft, "restart": restart}, sustained, 3,
                       prompt=2056, shared=2048)
    rows = {(r["measure"], r["system"]): r for r in result["rows"]}
    assert rows["decode", "plain"]["tokens_per_s"] == 1024  # median of 512, 1024, 2048
    assert rows["decode", "kvj"]["ratio"] == 2048 / 2.5 / 1024 and rows["decode", "kvj-raw"]["ratio"] == 1.0
    assert rows["decode", "kvj"]["fsyncs_per_step"] == 1.5 and rows["decode", "kvj"]["blocks_per_fsync"] == 2
    assert rows["decode", "kvj"]["bytes_per_token"] == 2
    assert rows["prefill", "kvj"]["ratio"] == 0.5
    assert rows["ttft", "plain"]["seconds"] == 0.3 and rows["ttft", "kvj-durable"]["ratio"] == 0.4 / 0.3
    assert rows["restart", "kvj-restarted"]["loaded"] == 2016  # the fewest tokens any round loaded
    s = result["sustained"]
    assert s["generated_per_s"] == 100 and s["tokens_durable_per_s"] == 1000 / 10.5 and s["backlog_max"] == 4
    assert s["blocks_per_s"] == 5 and s["all_durable"] and round(s["drain_seconds"], 2) == 0.5

    table = format_table(result).splitlines()
    assert table[0].split()[:6] == ["measure", "system", "median", "of", "3", "ratio"]
    assert table[2].startswith("decode tok/s") and table[2].split()[-2:] == ["1,024", "1.00"]
    assert "0.80  1.50 fsyncs/step, 2 B/token, 2.00 blocks/fsync" in table[3]
    assert any("kvj, admission durable" in line and "400 ms" in line for line in table)
    assert any("kvj (2016 tokens loaded, verified)" in line and "100 ms" in line for line in table)
    text = "\n".join(table)
    assert "tokens made durable 95 tok/s (0.95x)" in text
    assert "at most 4 blocks and 10 tokens generated but not yet durable, 0 blocks at the end" in text
    assert "made durable 4.8/s (0.95x; 50 of 50)" in text


def test_cli_refuses_extra_config_that_is_not_an_object() -> None:
    for bad in ("[1]", "{threads"):
        run = subprocess.run([sys.executable, "-m", "kvj.cli.main", "bench", "vllm", "--extra-config", bad],
                             capture_output=True, text=True)
        assert run.returncode == 64, run.stderr
        assert run.stderr.count("\n") == 1 and "--extra-config" in run.stderr


def test_loads_per_block_whole_and_floor_side_by_side(tmp_path) -> None:
    """The connector's per-block load, a whole load of the same bytes and the floor, in one run:
    every figure a rate of the same bytes, the ratios paired by round, all in the printed lines."""
    from benchmarks import vllm_loads
    from kvj.segments.kvblock import LHNC, KVBlockLayout

    layout = KVBlockLayout("bench-small", "bfloat16", 4, 2, 64, 16, LHNC)
    result = vllm_loads.run(str(tmp_path), blocks=6, rounds=2, layout=layout, threads=2)
    assert result["bytes"] == 6 * layout.nbytes and result["rounds"] == 2 and result["threads"] == 2
    assert all(result["gbps"][k] > 0 for k in ("per_block", "whole", "floor"))
    assert result["per_block_vs_whole"] > 0 and result["per_block_vs_floor"] > 0
    text = vllm_loads.format_table(result)
    assert "per block / whole" in text and "(goal >= 0.8x)" in text and "per block / floor" in text
    assert list(tmp_path.iterdir()) == []  # its work files are gone


def test_cli_loads_only_needs_no_vllm_and_prints_the_three_side_by_side(tmp_path) -> None:
    import json

    run = subprocess.run([sys.executable, "-m", "kvj.cli.main", "bench", "vllm", "--loads-only", "--rounds", "1",
                          "--dir", str(tmp_path), "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["blocks"] == 64 and doc["block_bytes"] == 2 << 20 and set(doc["gbps"]) == {"per_block", "whole", "floor"}
