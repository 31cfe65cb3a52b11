"""The crash checker's fold is its own (``crashcheck.Model``, from kvj-journal(5)), not kvj's
``JournalState.apply``: a fold that gets one record type wrong passes replay's record-by-record
checks but not the checker, which this test shows for each kind of mistake (issue 24 §2.3)."""

from __future__ import annotations

import random

import pytest
from support.crashcheck import Truth, check_journal, random_record

from kvj import Journal, RecordType
from kvj.journal.state import JournalState

SEED = 2417  # fixed: the records below are the same every run


def write_journal(path: str) -> Truth:
    """Records of every type the checker models, appended and acknowledged durable."""
    rng, truth = random.Random(SEED), Truth()
    with Journal.open(path) as j:
        for _ in range(300):
            rtype, payload = random_record(rng)
            truth.add(j.append(rtype, payload), rtype, payload)
        truth.ack(j.append(RecordType.ALLOC, {"device": "cuda:0", "addr": 1 << 20, "size": 1, "tag": "last"},
                           durable=True))
        truth.add(truth.acked, RecordType.ALLOC, {"device": "cuda:0", "addr": 1 << 20, "size": 1, "tag": "last"})
    return truth


def _skip(rtype: int):
    """A fold that ignores every record of ``rtype``."""
    real = JournalState.apply

    def apply(self, t, p, lsn):
        if t == rtype:
            self.last_lsn = lsn
            return None
        return real(self, t, p, lsn)
    return apply


def _keep_deltas_at_checkpoint():
    """A fold that forgets that a checkpoint clears the deltas before it."""
    real = JournalState.apply

    def apply(self, t, p, lsn):
        kept = list(self.deltas)
        real(self, t, p, lsn)
        if t == RecordType.CHECKPOINT:
            self.deltas = kept
    return apply


MUTANTS = {
    "end ignored": lambda: _skip(int(RecordType.END)),
    "free ignored": lambda: _skip(int(RecordType.FREE)),
    "delta ignored": lambda: _skip(int(RecordType.DELTA)),
    "checkpoint keeps deltas": _keep_deltas_at_checkpoint,
}


def test_the_checker_passes_kvj_s_own_fold(tmp_path):
    truth = write_journal(str(tmp_path / "j"))
    assert check_journal(str(tmp_path / "j"), truth, truth.acked, check_fsck=False) == truth.acked


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_wrong_fold_fails_the_checker(tmp_path, monkeypatch, mutant):
    truth = write_journal(str(tmp_path / "j"))
    monkeypatch.setattr(JournalState, "apply", MUTANTS[mutant]())
    with pytest.raises(AssertionError, match="replayed state differs from the model"):
        check_journal(str(tmp_path / "j"), truth, truth.acked, check_fsck=False)
