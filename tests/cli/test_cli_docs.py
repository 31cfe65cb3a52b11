"""Man pages and shell completions are generated from the CLI definition and must be current."""

from __future__ import annotations

import os
import subprocess

import pytest
from support.cli_helpers import KVJ, ROOT, env, gen_docs, kvj

from kvj.cli.main import app, command

generate, stale, write = gen_docs().generate, gen_docs().stale, gen_docs().write


def test_man_pages_and_completions_are_current():
    bad = stale(ROOT)
    assert not bad, f"stale generated files {bad}: run python scripts/gen_docs.py"


def test_generation_is_deterministic_and_covers_every_command(tmp_path):
    write(str(tmp_path))
    assert stale(str(tmp_path)) == []
    files = generate()
    for name in command(app).commands:
        page = files[f"man/kvj-{name}.1"]
        assert page.startswith(f".TH KVJ\\-{name.upper()} 1") and ".SH EXIT STATUS" in page
        assert f"kvj\\-{name}(1)" in files["man/kvj.1"]
    assert ".SH KVJ RECORD NDJSON" in files["man/kvj-record.1"] and "e2fsck" in files["man/kvj-fsck.1"]
    assert "\\fB75\\fR" in files["man/kvj.1"] and "\\fB16\\fR" in files["man/kvj-fsck.1"]
    for shell_file in ("completions/kvj.bash", "completions/_kvj", "completions/kvj.fish",
                       "completions/journal_replay.bash"):
        assert "_COMPLETE" in files[shell_file]


def test_man_pages_render_without_warnings(tmp_path):
    write(str(tmp_path))
    man = os.path.join(str(tmp_path), "man")
    for page in sorted(os.listdir(man)):
        proc = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", os.path.join(man, page)], capture_output=True,
                              text=True)
        assert proc.returncode == 0 and proc.stderr == "", (page, proc.stderr)


@pytest.mark.skipif(not KVJ[0].endswith("kvj"), reason="kvj console script not installed")
def test_completion_scripts_call_back_into_kvj():
    proc = kvj(extra_env={"_KVJ_COMPLETE": "complete_bash", "COMP_WORDS": "kvj re", "COMP_CWORD": "1"})
    assert proc.returncode == 0 and proc.stdout.split() == ["replay", "recover", "replicate", "restore", "record"]
    proc = kvj(extra_env={"_KVJ_COMPLETE": "complete_fish", "_TYPER_COMPLETE_FISH_ACTION": "get-args",
                          "_TYPER_COMPLETE_ARGS": "kvj inspect --type "})
    assert "checkpoint" in proc.stdout.split()
    bash = os.path.join(ROOT, "completions", "kvj.bash")
    script = f"source {bash}; COMP_WORDS=(kvj fs); COMP_CWORD=1; _kvj_completion kvj; echo ${{COMPREPLY[@]}}"
    path = os.path.dirname(KVJ[0]) + os.pathsep + os.environ.get("PATH", "")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env(PATH=path))
    assert proc.stdout.split() == ["fsck"], proc.stderr
