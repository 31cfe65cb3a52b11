"""``kvj serve``'s command line (no engine started): vLLM's parser reads every flag, kvj's group adds
its options, the connector is injected as vLLM would parse it, modes kvj serve does not run are
refused in one line with a usage status, ``kvj --help`` lists serve, and an unwritable journal at
start is one line and status 77."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from support.cli_helpers import KVJ, env, kvj

from kvj.cli.errors import NOPERM, USAGE


def test_vllm_flags_pass_through_and_the_connector_is_injected_as_vllm_parses_it(tmp_path):
    from kvj.cli.serve import parse

    journal = str(tmp_path / "j")
    args, options = parse(["some/model", "--journal", journal, "--port", "8123", "--max-model-len", "512",
                           "--retention", "15m", "--retention-bytes", "64MiB", "--admission", "durable",
                           "--enable-prompt-tokens-details"])
    assert args.model == "some/model" and args.port == 8123 and args.max_model_len == 512
    assert args.enable_prompt_tokens_details is True
    transfer = args.kv_transfer_config
    assert transfer.kv_connector == "KvjConnector" and transfer.kv_connector_module_path == "kvj.integrations.vllm"
    assert transfer.kv_connector_extra_config == {"journal": journal, "max_store_bytes": 16 << 30}
    assert transfer.kv_load_failure_policy == "recompute"
    assert (options.journal, options.retention, options.retention_bytes, options.admission) == \
        (journal, 900.0, 64 << 20, "durable")


def test_a_config_file_works_as_for_vllm_serve(tmp_path):
    from kvj.cli.serve import parse

    config = tmp_path / "serve.yaml"
    config.write_text("port: 8777\nmax-model-len: 1024\n")
    args, options = parse(["m", "--journal", str(tmp_path / "j"), "--config", str(config), "--store-bytes", "1GiB"])
    assert args.port == 8777 and args.max_model_len == 1024
    assert args.kv_transfer_config.kv_connector_extra_config["max_store_bytes"] == 1 << 30 == options.store_bytes


@pytest.mark.parametrize("extra, why", [
    (["--kv-transfer-config", '{"kv_connector": "X"}'], "configures the KV connector itself"),
    (["--headless"], "--headless"),
    (["--api-server-count", "2"], "--api-server-count"),
    (["--data-parallel-size", "2"], "data parallelism"),
    (["--retention", "7"], "has no unit"),
    (["--admission", "eventually"], "invalid choice"),
], ids=["kv-transfer-config", "headless", "api-server-count", "data-parallel", "bare-duration", "admission"])
def test_what_kvj_serve_does_not_run_is_refused_in_one_line_with_a_usage_status(tmp_path, capsys, extra, why):
    from kvj.cli.serve import main

    assert main(["m", "--journal", str(tmp_path / "j"), *extra]) == USAGE
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "Triton" not in line]
    assert len(lines) == 1 and lines[0].startswith("kvj serve: error: ") and why in lines[0], err
    assert not os.path.exists(tmp_path / "j")  # refused before anything was made


def test_kvj_help_lists_serve_and_serve_help_lists_kvj_s_options(tmp_path):
    from kvj.cli.serve import OPTIONS

    top = kvj("--help")
    assert top.returncode == 0 and " serve " in top.stdout
    group = kvj("serve", "--help=kvj")
    assert group.returncode == 0, group.stderr
    for flag, *_rest in OPTIONS:
        assert flag in group.stdout, flag
    from kvj.cli.main import app, command

    click_serve = command(app, ["serve"]).commands["serve"]
    documented = {opt for param in click_serve.params for opt in param.opts if opt.startswith("--")} - {"--help"}
    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "man", "kvj-serve.1")).read()
    for flag, *_rest in OPTIONS:  # the generated man page lists every kvj option
        assert flag.replace("-", "\\-") in page, flag
    assert documented == {flag for flag, *_r in OPTIONS}  # the typer command (docs) and the parser agree


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.ci_required
@pytest.mark.skipif(not _unshare_works(), reason="this machine allows no private mount namespace (unshare -rm)")
def test_an_unwritable_journal_at_start_is_one_line_and_status_77(tmp_path):
    journal = tmp_path / "ro"
    journal.mkdir()
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(journal), *KVJ, "serve", "m",
                           "--journal", str(journal)], capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == NOPERM, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"kvj serve: error: permission denied: {journal}/replies: Read-only file system"], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_engine_computes_a_token_the_same_way_whatever_else_runs_unless_the_operator_chose():
    """kvj serve turns off the CPU attention's split of a long sequence among threads, whose sums
    depend on the batch: with it on, a 346-token prompt prefilled gave logprobs up to 6.2e-06 off
    the decode steps that first computed it; with it off, bit-equal (docs/serve.md)."""
    from kvj.serve.launch import engine_environment

    env: dict = {}
    engine_environment(env)
    assert env == {"VLLM_CPU_ATTN_SPLIT_KV": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    chosen = {"VLLM_CPU_ATTN_SPLIT_KV": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}
    engine_environment(chosen)
    assert chosen == {"VLLM_CPU_ATTN_SPLIT_KV": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}
