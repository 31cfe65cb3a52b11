"""``kvj status`` reads the newest log files once for both where the log ends and the last
minute's writes: the one walk gives what ``log_end`` and a record-by-record count give."""

import time

from kvj.journal.framing import RECORD_HEADER_SIZE
from kvj.journal.journal import Journal
from kvj.journal.reader import Scan, list_logs, log_end, read_header
from kvj.journal.records import RecordType
from kvj.journal.config import CommitPolicy
from kvj.ops.status import WINDOW, _newest


def per_record(directory, now):
    """The last minute counted record by record over every log file (what status showed before)."""
    records = nbytes = 0
    times = set()
    for path in list_logs(directory):
        header = read_header(path)
        for raw in Scan(directory, after_lsn=header.base_lsn - 1, logs=[path], reporter=lambda _d: None):
            if raw.time is not None and raw.time >= now - WINDOW:
                records += 1
                nbytes += RECORD_HEADER_SIZE + len(raw.payload)
                times.add(raw.time)
    return records, nbytes, len(times)


def test_one_walk_gives_the_log_end_and_the_last_minute(tmp_path):
    from support.cli_helpers import append_torn_tail

    path = str(tmp_path)
    with Journal.open(path, policy=CommitPolicy(file_size_limit=300)) as j:  # rotates every few groups
        for i in range(12):
            j.append_many([(RecordType.ALLOC, {"device": "cuda:0", "addr": 4 * i + k, "size": 1, "tag": "t"})
                           for k in range(i % 3 + 1)], durable=True)
    with Journal.open(path) as j:
        j.alloc("cuda:0", 1000, 1, durable=True)  # a second writer
    assert len(list_logs(path)) > 3
    for torn in (False, True):
        if torn:
            append_torn_tail(path)
        for now in (time.time(), time.time() + WINDOW + 3600):  # all of it in the window, none of it
            end, minute = _newest(path, list_logs(path), now, 0)
            assert end == log_end(path)
            assert (minute["records"], minute["bytes"], minute["groups"]) == per_record(path, now)
        assert (end.tail is not None) == torn
    assert minute["records"] == 0 and end.lsn == 1 + sum(i % 3 + 1 for i in range(12))


def test_status_counts_the_last_minute_from_the_fold_as_the_walk_does(tmp_path):
    """Status takes where the log ends and the last minute from replay's own walk (``on_group``);
    it is what the walk of the newest files gives (``_newest``, what status shows past damage)."""
    from support.cli_helpers import append_torn_tail

    from kvj.ops.status import status

    path = str(tmp_path)
    with Journal.open(path, policy=CommitPolicy(file_size_limit=300)) as j:
        for i in range(12):
            j.append_many([(RecordType.ALLOC, {"device": "cuda:0", "addr": 4 * i + k, "size": 1, "tag": "t"})
                           for k in range(i % 3 + 1)], durable=True)
    with Journal.open(path) as j:
        j.alloc("cuda:0", 1000, 1, durable=True)
    for torn in (False, True):
        if torn:
            append_torn_tail(path)
        for now in (time.time(), time.time() + WINDOW + 3600):
            end, minute = _newest(path, list_logs(path), now, 0)
            s = status(path, None, now=now)
            assert s["damage"] is None
            assert (s["last_lsn"], s["last_write"], s["incomplete_tail"]) == (
                end.lsn, end.time, end.tail.length if end.tail else 0)
            assert s["last_minute"] == minute
        assert s["incomplete_tail"] > 0 if torn else s["incomplete_tail"] == 0
