"""The limits kvj-journal(5) states (Limits): a writer never writes what a reader refuses.

Both were enforced only when reading: a record over 16 MiB, or a group over 1 GiB (a policy
whose buffer allows one), was acknowledged durable, then read back as a torn tail and cut."""

from __future__ import annotations

import pytest

import kvj
from kvj.journal import framing, records, writer
from kvj.journal.config import CommitPolicy


def test_a_record_over_16_mib_is_refused_when_appended_not_lost_after_it_was_acknowledged(tmp_path):
    path = str(tmp_path / "j")
    with kvj.Journal.open(path) as j:
        j.start("small", meta={"x": "y" * (15 << 20)}, durable=True)  # large, but inside the limit
        with pytest.raises(kvj.FormatError, match="16 MiB"):
            j.start("huge", meta={"x": "y" * (16 << 20)}, durable=True)
        j.end("small", durable=True)
    state = kvj.replay(path)
    assert state.tail is None and state.counts == {"start": 1, "end": 1}
    assert len(state.requests["small"].meta["x"]) == 15 << 20


@pytest.fixture
def small_limits(monkeypatch):
    """Groups of at most 64 KiB and records of at most 8 KiB, on both sides, for a test that
    cannot write a gigabyte."""
    for module in (framing, writer, records):
        for name, value in (("MAX_GROUP_BODY", 64 << 10), ("MAX_RECORD_PAYLOAD", 8 << 10)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value)


def test_a_buffer_allowed_to_outgrow_a_group_is_committed_in_groups_a_reader_accepts(tmp_path, small_limits):
    path = str(tmp_path / "j")
    policy = CommitPolicy(max_delay=30.0, max_records=100_000, max_buffer_bytes=1 << 30)  # never due by itself
    with kvj.Journal.open(path, policy=policy) as j:
        lsns = [j.start(f"r{i}", meta={"pad": "p" * 4000}) for i in range(60)]  # ~240 KiB
        j.sync()
    state = kvj.replay(path)
    assert state.tail is None and state.last_lsn == lsns[-1] and len(state.requests) == 60
    with pytest.raises(kvj.FormatError, match="more than"):
        records.encode(1, {"id": "x", "prompt_hash": None, "tokens": None, "meta": {"pad": "p" * 9000}})
