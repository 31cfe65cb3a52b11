"""Terminal output that fits (issue 14 item 11): help without typer's type names, short prompt
hashes, rates in a unit that suits them, exports that render offline, and fsck that does not
repeat old warnings for ever."""

from __future__ import annotations

import re

import pytest
from support.cli_helpers import build, in_process

from kvj.cli.main import app, command
from kvj.journal.journal import Journal


@pytest.fixture
def cli(capsys):
    return lambda *args: in_process(capsys, *args)


def _commands():
    root = command(app)
    found = [[]]
    for name, sub in root.commands.items():
        found.append([name])
        found += [[name, inner] for inner in getattr(sub, "commands", {})]
    return found


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p) or "kvj")
def test_help_shows_no_internal_type_names(cli, path):
    proc = cli(*path, "--help")
    assert proc.returncode == 0
    assert not re.search(r"<(bool|list|str|int|float)[^>]*>|\{[A-Z_]+(\.\.\.)?\}", proc.stdout), proc.stdout


def test_flush_usage_reads_as_a_man_page_does(cli):
    assert "Usage: kvj flush [OPTIONS] FILE..." in cli("flush", "--help").stdout


@pytest.fixture
def long_ids(tmp_path):
    path = tmp_path / "j"
    with Journal.open(path) as j:
        for i in range(4):
            rid = f"chat-completion-request-{i:04d}-with-a-very-long-uuid-4f1c2b7e9a"
            j.start(rid, prompt_hash="sha256:" + "ab" * 32)
            j.alloc("cuda:0", 4096 * i, 4096, "weights" if i % 2 else f"kv:{rid}")
        j.end(rid)
    return path


def test_long_prompt_hashes_are_shortened_on_a_line_not_in_json(cli, long_ids):
    line = cli("inspect", "-j", long_ids, "-t", "start").stdout.splitlines()[0]
    assert "prompt_hash=sha256:ababa…" in line and "ab" * 20 not in line
    assert '"prompt_hash":"sha256:' + "ab" * 32 + '"' in cli("inspect", "-j", long_ids, "-t", "start", "--json").stdout


def test_exports_render_offline(tmp_path, cli, long_ids):
    for name, args in (("s.svg", ["--stats"]), ("s.html", ["--stats"]), ("r.svg", []), ("r.html", [])):
        assert cli("inspect", "-j", long_ids, *args, "--export", tmp_path / name).returncode == 0
        text = (tmp_path / name).read_text()
        assert not re.search(r"url\(\s*['\"]?https?:", text), name
        assert "<link" not in text and "@import" not in text


def test_a_small_load_is_not_zero_gb_per_s(tmp_path, cli):
    path = tmp_path / "j"
    build(str(path), requests=1, blocks=1, ended=0, training=False)
    out = cli("recover", "-j", path, "--dry-run", "--device", "cpu").stdout
    assert "0.00 GB/s" not in out and re.search(r"in \d+\.\d+ s: \d+(\.\d)? (B|KiB|MiB|GiB)/s", out), out


def test_fsck_does_not_repeat_warnings_from_before_the_last_recovery(tmp_path, cli):
    path = tmp_path / "j"
    with Journal.open(path) as j:
        j.end("never-started")  # replay warns about it
    first = cli("fsck", "-j", path).stdout
    assert "warning: LSN 1: end of a request that never started" in first
    assert cli("recover", "-j", path).returncode == 0
    again = cli("fsck", "-j", path).stdout
    assert "never-started" not in again and "1 replay warnings about records before the last recovery" in again
    with Journal.open(path) as j:
        j.end("another")
    assert "end of a request that never started: another" in cli("fsck", "-j", path).stdout
