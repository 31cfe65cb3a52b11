"""``kvj bench vllm``: medians, ratios and the printed table from engines' job results, and its
usage errors. (A whole run takes minutes of engine time: it is a benchmark, not a test.)"""

from __future__ import annotations

import subprocess
import sys

from kvj.bench.vllm import format_table, summarize


def test_medians_ratios_and_table() -> None:
    decode = {"plain": [{"generated": 2048, "seconds": s} for s in (2.0, 1.0, 4.0)],
              "kvj": [{"generated": 2048, "seconds": s} for s in (2.5, 9.0, 2.2)]}
    ttft = {"plain": [{"seconds": s, "cached": 0} for s in (0.3, 0.5, 0.2)],
            "kvj-restarted": [{"seconds": s, "cached": c} for s, c in ((0.2, 2048), (0.1, 2016), (0.4, 2048))],
            "example-restarted": [{"seconds": 0.1, "cached": 2048}] * 3}
    result = summarize(decode, ttft, 3, prompt=2056, shared=2048)
    rows = {(r["measure"], r["system"]): r for r in result["rows"]}
    assert rows["decode", "no connector"]["tokens_per_s"] == 1024  # median of 512, 1024, 2048
    assert rows["decode", "kvj"]["ratio"] == 2048 / 2.5 / 1024
    assert rows["ttft", "cold prefill"]["seconds"] == 0.3
    assert rows["ttft", "kvj"]["ratio"] == 0.2 / 0.3
    assert rows["ttft", "kvj"]["loaded"] == 2016  # the fewest tokens any round loaded
    table = format_table(result).splitlines()
    assert table[0].split() == ["measure", "system", "median", "of", "3", "ratio"]
    assert table[2].startswith("decode tok/s") and table[2].split()[-2:] == ["1,024", "1.00"]
    assert table[3].split()[-2:] == ["819", "0.80"] and not table[3].startswith("decode")
    assert table[4].startswith("TTFT after restart, 2056 tokens, 2048 shared")
    assert "kvj (2016 tokens loaded, verified)" in table[5] and table[5].split()[-3:] == ["200", "ms", "0.67"]
    assert table[6].split()[-3:] == ["100", "ms", "0.33"]


def test_cli_refuses_extra_config_that_is_not_an_object() -> None:
    for bad in ("[1]", "{threads"):
        run = subprocess.run([sys.executable, "-m", "kvj.cli.main", "bench", "vllm", "--extra-config", bad],
                             capture_output=True, text=True)
        assert run.returncode == 64, run.stderr
        assert run.stderr.count("\n") == 1 and "--extra-config" in run.stderr
