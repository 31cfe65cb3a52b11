"""Where ``kvj serve`` keeps its files inside the journal directory (no vLLM needed to read them)."""

from __future__ import annotations

import os

from kvj.names import check_request_id

#: The reply journal: an ordinary kvj journal, written by the API process (kvj-journal(5), reply).
REPLIES_DIR = "replies"
#: Cancel markers: an empty file per reply key, made before kvj serve aborts that reply's engine
#: request, so that the connector journals it "cancelled" and not "parked".
CANCEL_DIR = "cancel"
#: The /dev/shm names the last server mapped (``kvj.serve.shm``).
SHM_LEDGER = "shm.json"


def replies_dir(journal: str) -> str:
    """``JOURNAL/replies``: the reply journal."""
    return os.path.join(journal, REPLIES_DIR)


def cancel_marker(journal: str, key: str) -> str:
    """The cancel marker of reply ``key`` (checked: a reply key is a request id)."""
    return os.path.join(journal, REPLIES_DIR, CANCEL_DIR, check_request_id(key))
