"""Commit groups carry wall-clock time (format version 2; 0.1.0 journals still read), a cheap
``log_end`` for status displays, and a writer that continues a clean newest log file
(issue 14 items 2 and 10)."""

import os
import shutil
import time

import kvj
from kvj.journal import framing as F
from kvj.journal.journal import Journal
from kvj.journal.reader import Scan, list_logs, log_end, read_header
from kvj.journal.config import CommitPolicy

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_every_record_carries_its_groups_time(tmp_path):
    before = time.time()
    with Journal.open(tmp_path) as j:
        j.alloc("cuda:0", 1, 1, durable=True)
        middle = time.time()
        j.alloc("cuda:0", 2, 1, durable=True)
    after = time.time()
    first, second = Scan(str(tmp_path)).records()
    assert before <= first.time <= middle <= second.time <= after
    assert read_header(list_logs(str(tmp_path))[0]).version == F.FORMAT_VERSION == 2
    end = log_end(str(tmp_path))
    assert (end.lsn, end.time, end.tail) == (2, second.time, None)


def test_log_end_skips_an_empty_newest_file_and_reports_a_torn_tail(tmp_path):
    from support.cli_helpers import append_torn_tail

    with Journal.open(tmp_path, policy=CommitPolicy(file_size_limit=1)) as j:  # each group rotates
        for i in range(3):
            j.alloc("cuda:0", i, 1, durable=True)
    end = log_end(str(tmp_path))
    assert end.lsn == 3 and end.time is not None and end.path != list_logs(str(tmp_path))[-1]
    last, size, _ = append_torn_tail(str(tmp_path))
    end = log_end(str(tmp_path))
    assert end.lsn == 3 and end.tail is not None and (end.tail.path, end.tail.offset) == (last, size)


def test_a_0_1_0_journal_has_no_times_and_a_writer_goes_on_in_a_new_current_file(tmp_path):
    path = str(tmp_path / "j")
    shutil.copytree(os.path.join(DATA, "journal-0.1.0"), path)
    old = list_logs(path)
    assert all(r.time is None for r in Scan(path, after_lsn=3).records())
    assert log_end(path).time is None
    with Journal.open(path) as j:
        lsn = j.end("chat-1", durable=True)
    new = list_logs(path)
    assert new[:-1] == old and read_header(new[-1]).version == 2  # never a version 2 group in a 0.1.0 file
    state = kvj.replay(path)
    assert state.last_lsn == lsn and state.requests["chat-1"].ended
    assert [r.time is not None for r in Scan(path, after_lsn=lsn - 1).records()] == [True]


def test_a_writer_continues_the_newest_file_when_its_tail_is_clean(tmp_path):
    for i in range(3):
        with Journal.open(tmp_path) as j:  # what each `kvj record` call does
            j.alloc("cuda:0", i, 1)
    assert len(list_logs(str(tmp_path))) == 1
    assert sorted(kvj.replay(str(tmp_path)).allocations["cuda:0"]) == [0, 1, 2]


def test_a_writer_starts_a_new_file_after_a_torn_tail_or_a_full_file(tmp_path):
    from support.cli_helpers import append_torn_tail

    with Journal.open(tmp_path) as j:
        j.alloc("cuda:0", 0, 1)
    append_torn_tail(str(tmp_path))
    with Journal.open(tmp_path) as j:  # cuts the tail (kept in torn/), then a new file
        assert j.cut_tail is not None
        j.alloc("cuda:0", 1, 1)
    assert len(list_logs(str(tmp_path))) == 2
    with Journal.open(tmp_path, policy=CommitPolicy(file_size_limit=50)) as j:  # the newest is full
        j.alloc("cuda:0", 2, 1)
    assert len(list_logs(str(tmp_path))) >= 3
    assert sorted(kvj.replay(str(tmp_path)).allocations["cuda:0"]) == [0, 1, 2]
