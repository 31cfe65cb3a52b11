"""kvj serve's reply journal in the operations commands: ``kvj status`` shows the replies running and
held, ``kvj fsck`` checks the reply journal as a journal of its own (damage in it is an error naming it)."""

from __future__ import annotations

import json
import os

from support.cli_helpers import kvj

import kvj as lib
from kvj.journal.reader import list_logs
from kvj.journal.records import RecordType
from kvj.serve.paths import replies_dir
from kvj.serve.replies import REPLY_FORMAT


def served(path: str) -> None:
    with lib.Journal.open(path) as j:
        j.start("e-1", None, [1, 2], {"prompt_len": 2, "client": "chatcmpl-a"}, durable=True)
    with lib.Journal.open(replies_dir(path)) as j:
        for key in ("chatcmpl-a", "chatcmpl-b"):
            j.start(key, "h", None, {"format": REPLY_FORMAT, "kind": "chat", "body": {"x": 1}, "created": 1,
                                     "stream": True}, durable=True)
            j.tokens(key, 0, [5, 6, 7])
            j.sync()
        j.append(RecordType.REPLY, {"id": "chatcmpl-b", "status": "completed", "count": 3, "at": 1.0}, durable=True)


def test_status_shows_the_replies_and_fsck_checks_the_reply_journal(tmp_path):
    path = str(tmp_path / "j")
    served(path)
    status = kvj("status", "-j", path)
    assert status.returncode == 0 and "1 running, 1 held" in status.stdout, status.stdout
    clean = kvj("fsck", "-j", path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    log = list_logs(replies_dir(path))[0]
    with open(log, "r+b") as f:  # one bit of the first group's payload: damage mid-log, records after it
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0x10]))
    bad = kvj("fsck", "-j", path)
    assert bad.returncode == 4 and "replies/ (kvj serve's reply journal)" in bad.stdout, bad.stdout + bad.stderr
    assert os.path.exists(log)  # checked, not repaired
    damaged = kvj("status", "-j", path, "--json")
    assert damaged.returncode == 0 and "corruption" in json.loads(damaged.stdout)["replies"]["damage"]
