"""kvj record's input rules: NDJSON lines and --tokens/--meta, each bad input refused with the
right status and nothing appended; optional fields optional; seed-era lines taken as kvj migrate takes them."""

from __future__ import annotations

import json

import pytest
from support.cli_helpers import assert_fails, in_process, kvj

import kvj as kvj_lib

USAGE, DATAERR = 64, 65


@pytest.fixture
def journal(tmp_path):
    path = tmp_path / "j"
    with kvj_lib.Journal.open(path) as j:
        j.start("r0")
    return path


@pytest.fixture
def cli(capsys):
    return lambda *args, stdin="": _with_stdin(capsys, stdin, *args)


def _with_stdin(capsys, stdin, *args):  # type: ignore[no-untyped-def]
    import io
    import sys

    saved = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        return in_process(capsys, *args)
    finally:
        sys.stdin = saved


def test_optional_fields_are_optional(journal, cli):
    lines = ['{"type": "start", "id": "a"}', '{"type": "start", "id": "b", "tokens": [1, 2]}',
             '{"type": "end", "id": "a"}', '{"type": "alloc", "device": "cuda:0", "addr": 4096, "size": 64}']
    proc = cli("record", "ndjson", "-j", journal, stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    state = kvj_lib.replay(str(journal))
    a, b = state.requests["a"], state.requests["b"]
    assert (a.prompt_hash, a.tokens, a.meta, a.ended, a.status) == (None, None, {}, True, "ok")
    assert b.tokens == [1, 2] and state.allocations["cuda:0"][4096].tag == ""


def test_seed_era_lines_are_taken_as_kvj_migrate_takes_them(journal, tmp_path):
    """A program that writes the seed's records can pipe them in, as with 0.1.0 (issue 41 item 10):
    each becomes the record kvj migrate writes for it."""
    seed = ['{"op": "start", "id": "seed-1", "prompt_hash": "abc"}', '{"op": "start", "id": "seed-2"}',
            '{"op": "end", "id": "seed-1"}', '{"op": "start", "id": "seed-3", "prompt_hash": 42}',
            '{"op": "end", "id": "seed-3", "status": "aborted"}']
    mixed = seed[:2] + ['{"type": "start", "id": "kvj-1"}'] + seed[2:]
    proc = kvj("record", "ndjson", "-j", journal, input="\n".join(mixed) + "\n")
    assert proc.returncode == 0, proc.stderr
    assert "6 records durable" in proc.stdout
    piped = kvj_lib.replay(str(journal)).requests
    assert piped["seed-1"].ended and piped["seed-1"].prompt_hash == "abc" and not piped["seed-2"].ended
    assert piped["seed-3"].status == "aborted" and not piped["kvj-1"].ended

    (tmp_path / "seed.jsonl").write_text("\n".join(seed) + "\n")
    assert kvj("migrate", tmp_path / "seed.jsonl", "-j", tmp_path / "migrated").returncode == 0
    migrated = kvj_lib.replay(str(tmp_path / "migrated")).requests
    fields = ("prompt_hash", "tokens", "meta", "ended", "status")
    assert {rid: [getattr(piped[rid], f) for f in fields] for rid in migrated} == \
        {rid: [getattr(req, f) for f in fields] for rid, req in migrated.items()}
    assert sorted(migrated) == ["seed-1", "seed-2", "seed-3"]


BAD_LINES = {
    "negative token": '{"type": "start", "id": "x", "tokens": [-1]}',
    "float token": '{"type": "start", "id": "x", "tokens": [1.5]}',
    "bool token": '{"type": "start", "id": "x", "tokens": [true]}',
    "token above 2^64": '{"type": "start", "id": "x", "tokens": [%d]}' % (1 << 64),
    "tokens not a list": '{"type": "start", "id": "x", "tokens": "1,2"}',
    "NaN in meta": '{"type": "start", "id": "x", "meta": {"t": NaN}}',
    "Infinity in meta": '{"type": "alloc", "device": "d", "addr": 1, "size": 1, "tag": "t", "x": Infinity}',
    "deep nesting": '{"type": "start", "id": "x", "meta": {"m": ' + "[" * 100_000 + "]" * 100_000 + "}}",
    "bad seed-era op": '{"op": "rename", "id": "x"}',
    "seed-era seg_flush": '{"op": "seg_flush", "id": "r0", "seg": 0, "ptr": 0, "size": 16}',
    "seed-era start without id": '{"op": "start"}',
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_lines_are_refused_and_nothing_is_appended(journal, cli, case):
    before = kvj_lib.replay(str(journal)).last_lsn
    good = '{"type": "start", "id": "fine"}\n'
    proc = cli("record", "ndjson", "-j", journal, stdin=good + BAD_LINES[case] + "\n")
    assert_fails(proc, DATAERR, "NDJSON line 2")
    assert kvj_lib.replay(str(journal)).last_lsn == before


def test_a_line_of_neither_format_is_one_clear_error(journal, cli):
    before = kvj_lib.replay(str(journal)).last_lsn
    proc = cli("record", "ndjson", "-j", journal, stdin='{"type": "start", "id": "fine"}\n{"id": "x"}\n')
    assert_fails(proc, DATAERR, "NDJSON line 2: neither a kvj record", "nor a seed-era one")
    assert kvj_lib.replay(str(journal)).last_lsn == before


@pytest.mark.parametrize("tokens", ["1,,2", ",1", "1,", "", "1,-2", "1.5", "a", str(1 << 64)])
def test_bad_token_lists_are_usage_errors(journal, cli, tokens):
    before = kvj_lib.replay(str(journal)).last_lsn
    assert_fails(cli("record", "start", "x", "-j", journal, "--tokens", tokens), USAGE, "--tokens")
    assert kvj_lib.replay(str(journal)).last_lsn == before


def test_meta_nan_stays_text_and_json_output_stays_json(journal, cli):
    proc = cli("record", "start", "x", "-j", journal, "--meta", "t=NaN", "--meta", "n=3", "--tokens", "1, 2,3")
    assert proc.returncode == 0, proc.stderr
    req = kvj_lib.replay(str(journal)).requests["x"]
    assert req.meta == {"t": "NaN", "n": 3} and req.tokens == [1, 2, 3]
    proc = cli("inspect", "-j", journal, "--json", "-r", "x")
    json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def test_nan_written_by_an_older_kvj_is_printed_as_json_text(tmp_path, cli):
    from kvj.journal.records import RecordType
    from kvj.journal.config import CommitPolicy
    from kvj.journal.writer import LogWriter

    path = tmp_path / "old"
    path.mkdir()
    writer = LogWriter(str(path), next_seq=1, next_lsn=1, policy=CommitPolicy())  # below the schema, as 0.1.0 did
    writer.append(RecordType.START, {"id": "x", "prompt_hash": None, "tokens": None, "meta": {"t": float("nan")}})
    writer.close()
    proc = cli("inspect", "-j", path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["meta"] == {"t": "NaN"}


def test_deep_nesting_through_the_real_entry_point(journal):
    deep = '{"type": "start", "id": "x", "meta": {"m": ' + "[" * 100_000 + "]" * 100_000 + "}}\n"
    assert_fails(kvj("record", "ndjson", "-j", journal, input=deep), DATAERR, "NDJSON line 1", "nested too deeply")


@pytest.mark.parametrize("args", [["end", "bad id"], ["start", "x", "--meta", "a.b"]], ids=" ".join)
def test_refused_command_line_records_are_usage_errors(journal, cli, args):
    assert_fails(cli("record", *args, "-j", journal), USAGE)
