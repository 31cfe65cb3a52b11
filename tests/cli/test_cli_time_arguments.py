"""One rule for time arguments in every command: a DURATION needs its unit (7 alone is refused,
0 is zero), a TIME is ISO 8601, @ and Unix seconds, or a DURATION ago (a bare number is refused:
it once meant seconds ago in one command and Unix seconds in another), and each man page of a
command that takes them says so."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
from support.cli_helpers import assert_fails, build, gen_docs, in_process

from kvj.cli import parse
from kvj.cli.parse import parse_duration, parse_time

USAGE = 64


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    path = tmp_path_factory.mktemp("times") / "j"
    build(str(path), requests=1, blocks=1, ended=1, training=False)
    return path


@pytest.mark.parametrize("args, option", [
    (["inspect", "--since", "0"], "--since"), (["inspect", "--since", "1796134025"], "--since"),
    (["inspect", "--until", "20260101"], "--until"), (["prune", "--older-than", "7"], "--older-than"),
    (["compact", "--grace", "3600", "--dry-run"], "--grace"), (["init", "--max-delay", "100"], "--max-delay"),
    (["replicate", "--to", "s3://bucket/p", "--interval", "5"], None),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_a_bare_number_is_refused_wherever_a_time_is_taken(tmp_path, capsys, journal, args, option):
    target = tmp_path / "new" if args[0] == "init" else journal
    line = assert_fails(in_process(capsys, *args, "-j", target), USAGE)
    assert ("bare number" in line or "has no unit" in line) and (option is None or option in line), line
    assert ("@1796134025" if "TIME" in line else "ms, s, m, h, d or w") in line  # the rule, in the error


def test_each_form_of_a_time_means_one_thing(capsys, journal):
    now = 1796134025.0
    assert parse_time("@1796134025", "--since", now=now) == 1796134025.0 and parse_time("@0", now=now) == 0.0
    assert parse_time("10m", now=now) == now - 600 and parse_time("0s", now=now) == now
    assert parse_time("2026-11-29T15:00:00+00:00") == datetime(2026, 11, 29, 15, tzinfo=timezone.utc).timestamp()
    assert parse_duration("0") == 0 and parse_duration("7d") == 7 * 86400 and parse_duration("100ms") == 0.1
    listing = in_process(capsys, "inspect", "-j", journal, "--json", "--since", "@0").stdout.splitlines()
    assert len(listing) == len(in_process(capsys, "inspect", "-j", journal, "--json").stdout.splitlines()) > 0
    assert in_process(capsys, "inspect", "-j", journal, "--json", "--since", f"@{time.time() + 3600}").stdout == ""


def test_every_man_page_of_a_command_taking_times_states_the_rule():
    pages = gen_docs().generate()
    rule = f"{parse.DURATION_RULE}; {parse.TIME_RULE}"
    for name in ("kvj", "kvj-init", "kvj-inspect", "kvj-compact", "kvj-prune", "kvj-replicate", "kvj-restore"):
        text = " ".join(pages[f"man/{name}.1"].split())
        assert "TIME ARGUMENTS" in text and rule in text, name


def test_an_empty_journal_argument_names_no_directory(capsys):
    for args in (["status"], ["recover"], ["init"], ["fsck"]):
        proc = in_process(capsys, *args, "-j", "")
        assert proc.returncode in (USAGE, 16) and "journal" in proc.stderr, (args, proc.stderr)
