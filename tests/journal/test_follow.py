"""Following a live journal through rotation and compaction, as ``tail -F`` follows a file
through rotation: the library ``Follower`` and ``kvj inspect --follow`` with a real ``kvj compact``."""

import json
import os
import queue
import signal
import threading

from support.cli_helpers import KVJ, interruptible
from support.cli_helpers import kvj as kvj_proc
from support.wait import wait_for

from kvj.fileio import FS
from kvj.journal.follow import Follower
from kvj.journal.journal import Journal
from kvj.journal.reader import LOG_RE, list_logs, read_header
from kvj.journal.snapshot import list_snapshots
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact

EVERY_GROUP_ROTATES = CommitPolicy(file_size_limit=1)


class HeldRotation(FS):
    """Creating a log file waits while ``gate`` is clear: a test can hold the writer between a
    group becoming durable and the next file existing (when the old one is sealed but newest)."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def open(self, path, flags, mode=0o600):
        if LOG_RE.match(os.path.basename(path)) and flags & os.O_CREAT:
            assert self.gate.wait(60), "rotation held for too long"
        return super().open(path, flags, mode)


def lsns(records):
    return [r.lsn for r in records]


def test_follower_goes_on_when_compaction_deletes_the_file_it_reads(tmp_path):
    path = str(tmp_path / "j")
    fs = HeldRotation()
    with Journal.open(path, policy=EVERY_GROUP_ROTATES, fs=fs) as j:
        follower = Follower(path)
        fs.gate.clear()
        j.alloc("cuda:0", 0, 1, durable=True)  # durable in file 1; the rotation to file 2 waits
        assert lsns(follower.poll()) == [1]
        reading = follower.position[0]
        assert reading == list_logs(path)[-1]
        fs.gate.set()
        wait_for(lambda: len(list_logs(path)) == 2 and read_header(list_logs(path)[-1]) is not None,
                 "the rotation to file 2")
        compact(path, collect=False)
        assert not os.path.exists(reading)  # the file the follower was positioned in is gone
        for i in range(1, 6):
            j.alloc("cuda:0", i, 1, durable=True)
        assert lsns(follower.poll()) == [2, 3, 4, 5, 6]
        assert follower.skipped == []


def test_follower_that_falls_behind_a_compaction_says_what_it_could_not_show(tmp_path):
    path = str(tmp_path / "j")
    with Journal.open(path, policy=EVERY_GROUP_ROTATES) as j:
        follower = Follower(path)
        j.alloc("cuda:0", 0, 1, durable=True)
        assert lsns(follower.poll()) == [1]
        for i in range(1, 30):
            j.alloc("cuda:0", i, 1, durable=True)
        compact(path, collect=False)  # folds LSNs 2.. into a snapshot before the follower saw them
        snap = list_snapshots(path)[0][0]
        j.alloc("cuda:0", 30, 1, durable=True)
        batch = follower.poll()
    assert batch and lsns(batch) == list(range(batch[0].lsn, 32))
    assert follower.skipped == [(2, batch[0].lsn - 1)] and batch[0].lsn - 1 <= snap


def test_follower_keeps_waiting_for_an_incomplete_group(tmp_path):
    """The newest file's incomplete end is read again from the same offset, never shown half."""
    from support.cli_helpers import append_torn_tail

    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        j.alloc("cuda:0", 0, 1)
    follower = Follower(path)
    assert lsns(follower.poll()) == [1]
    last, size, _ = append_torn_tail(path, 40)
    assert follower.poll() == [] and follower.position == (last, size)
    with Journal.open(path) as j:  # cuts the torn tail, then appends
        j.alloc("cuda:0", 1, 1)
    assert lsns(follower.poll()) == [2]


def _lines(proc):
    """A queue of the lines ``proc`` prints (read on a thread, so waiting can time out)."""
    lines = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_inspect_follow_goes_on_through_kvj_compact(tmp_path):
    """A writer rotating through files, ``kvj compact`` deleting every sealed one (including the
    one ``kvj inspect -f`` was reading) after each round: every record still shows, in order."""
    path = str(tmp_path / "j")
    with Journal.open(path) as j:
        j.alloc("cuda:0", 0, 1, "first")
    follower = interruptible([*KVJ, "inspect", "-j", path, "--follow", "--json"])
    lines = _lines(follower)
    shown = []

    def show_through(lsn):
        while not shown or shown[-1] < lsn:
            shown.append(json.loads(lines.get(timeout=60))["lsn"])

    try:
        show_through(1)
        n = 1
        with Journal.open(path, policy=CommitPolicy(file_size_limit=300)) as j:
            for _round in range(2):
                for _ in range(12):
                    j.alloc("cuda:0", n, 1, f"r{_round}", durable=True)
                    n += 1
                show_through(n)
                proc = kvj_proc("compact", "-j", path)
                assert proc.returncode == 0, proc.stderr
                assert len(list_logs(path)) == 1
        with Journal.open(path) as j:  # a new writer after the compaction
            j.alloc("cuda:0", n, 1, "after")
            n += 1
        show_through(n)
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=30)
        err = follower.stderr.read()
    assert shown == list(range(1, n + 1))
    assert follower.returncode == 0 and "Traceback" not in err
