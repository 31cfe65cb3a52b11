"""``kvj bench serve``'s table from a result (the runs themselves need servers: docs/serve.md)."""

from __future__ import annotations

from benchmarks.serve import format_table


def test_the_table_gives_each_system_its_ratio_to_plain_vllm_and_the_restart():
    rows = [{"system": "vllm serve", "ttft_p50": 0.5, "ttft_p95": 0.6, "tokens_per_s": 1000.0,
             "tokens_per_s_range": [900.0, 1100.0], "tokens_ratio": 1.0, "ttft_ratio": 1.0,
             "cpu_ms_per_token": 2.0, "cpu_ratio": 1.0},
            {"system": "kvj serve", "ttft_p50": 0.55, "ttft_p95": 0.7, "tokens_per_s": 950.0,
             "tokens_per_s_range": [800.0, 990.0], "tokens_ratio": 0.95, "ttft_ratio": 1.1,
             "cpu_ms_per_token": 2.4, "cpu_ratio": 1.2}]
    restart = {"conversations": 4, "prompt_tokens": 2062, "known_tokens": 60, "engine_start_s": 28.0,
               "first_resumed_s": [0.3, 0.31], "cold_prefill_s": [0.1, 0.5], "kv_loaded_tokens": 2048}
    table = format_table({"rounds": 6, "clients": 8, "tokens": 256, "rows": rows, "restart": restart}).splitlines()
    assert table[0].startswith("8 concurrent streaming chats x 256 tokens, median of 6 rounds")
    assert "0.95x" in table[4] and "(800-990)" in table[4] and "1.10x" in table[4] and "2.40" in table[4]
    assert "KV of 2048 tokens loaded" in table[6]
    assert "28.0 s" in table[7] and "305 ms (310 ms)" in table[8] and "300 ms (500 ms)" in table[9]
