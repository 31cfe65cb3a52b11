"""A person's view of a journal of 10^4 requests lists the first ROWS of them and counts the rest
(issue 41 item 11): kvj replay and kvj recover built a rich table of every request, 40 times
slower than --json (30 s against 0.7 s for 66k requests), for output nobody reads. The work the
text view does is counted in table rows, so the test does not depend on the machine's speed."""

from __future__ import annotations

import json
import os

import pytest
from rich.table import Table
from support.cli_helpers import build, in_process, segment_file

from kvj.cli.render import ROWS
from kvj.journal.journal import Journal
from kvj.journal.records import RecordType
from kvj.journal.replay import RecordStream

CROWD = 10_000


@pytest.fixture
def crowd(tmp_path):
    """A journal of CROWD requests in flight, each with two segments (the same two for all), the
    second of them lost from the store: every request falls back to its first."""
    path = str(tmp_path / "j")
    written = build(path, requests=1, blocks=2, ended=0, training=False)
    segments = [rec.payload for rec in RecordStream(path) if rec.rtype == RecordType.SEGMENT]
    records = []
    for i in range(1, CROWD):
        records.append((RecordType.START, {"id": f"req-{i}", "prompt_hash": None, "tokens": [1, 2], "meta": {}}))
        records += [(RecordType.SEGMENT, {**seg, "id": f"req-{i}"}) for seg in segments]
    with Journal.open(path) as j:
        j.append_many(records)
        j.sync()
    os.unlink(segment_file(path, written["keys"]["req-0"][1]))
    return path


@pytest.fixture
def rows(monkeypatch):
    """How many table rows the command under test laid out."""
    added = [0]
    original = Table.add_row

    def counted(self, *cells, **kw):  # type: ignore[no-untyped-def]
        added[0] += 1
        return original(self, *cells, **kw)

    monkeypatch.setattr(Table, "add_row", counted)
    return added


def test_replay_lists_the_first_rows_and_counts_the_rest(crowd, capsys, rows):
    proc = in_process(capsys, "replay", "-j", crowd)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"in flight: {CROWD} requests" in lines
    assert f"... and {CROWD - ROWS:,} more requests in flight (kvj replay --json lists them all)" in lines
    assert rows[0] <= ROWS + 1 and len(lines) < ROWS + 20
    assert [line.split()[0] for line in lines if line.startswith("req-")] == [f"req-{i}" for i in range(ROWS)]
    listed = json.loads(in_process(capsys, "replay", "-j", crowd, "--json").stdout)
    assert sum(not r["ended"] for r in listed["requests"]) == CROWD


def test_recover_lists_the_first_rows_and_counts_the_rest(crowd, capsys, rows):
    proc = in_process(capsys, "recover", "-j", crowd, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"requests to resume: {CROWD}  (ended: 0)" in lines
    more = CROWD - ROWS
    for what in ("requests to resume", "requests that fell back to an older segment", "fallbacks"):
        assert f"... and {more:,} more {what} (kvj recover --json lists them all)" in lines
    assert f"tokens: {16 * CROWD} restorable from segments, {16 * CROWD} lost" in lines
    assert rows[0] <= ROWS + 1 and len(lines) < 3 * ROWS + 20
    manifest = json.loads(in_process(capsys, "recover", "-j", crowd, "--dry-run", "--json").stdout)["manifest"]
    assert len(manifest["requests"]) == len(manifest["fallbacks"]) == CROWD
