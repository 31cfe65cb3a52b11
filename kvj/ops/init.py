"""Creating a journal on purpose (``kvj init``: the directory, a durable ``kvj.conf``, its first
log file), so that writing commands can refuse a mistyped path; and ``kvj migrate`` of a
seed-era JSON-lines journal into a new one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional

from kvj.errors import FormatError, InvalidArgument, NotFound
from kvj.fileio import atomic_write, makedirs_durable
from kvj.journal.config import CONFIG, CONFIG_VERSION, CommitPolicy
from kvj.journal.journal import Journal
from kvj.journal.legacy import LegacyScan
from kvj.journal.records import RecordType
from kvj.trust import check_owner

def init(journal: str, *, store: Optional[str] = None, policy: Optional[CommitPolicy] = None,
         migrated_from: Optional[str] = None, mirror: Optional[str] = None,
         max_store_bytes: Optional[int] = None) -> Dict[str, Any]:
    """Create a journal at ``journal`` (a missing or empty directory), mirrored into ``mirror``
    if given (the journal records it), its store's byte budget ``max_store_bytes`` (None:
    none); returns its config."""
    journal = os.path.abspath(journal)
    if os.path.lexists(journal) and (not os.path.isdir(journal) or os.listdir(journal)):
        raise InvalidArgument(f"{journal} exists and is not an empty directory: kvj init makes a new journal")
    for directory in (journal, store):  # refused before anything is written, as Journal.open would
        if directory is not None:
            check_owner(directory)
    if max_store_bytes is not None and (type(max_store_bytes) is not int or max_store_bytes < 0):
        raise InvalidArgument(f"the store's byte budget must be a non-negative integer, not {max_store_bytes!r}")
    config = {"kvj_config": CONFIG_VERSION, "created": time.time(),
              "store": os.path.abspath(store) if store is not None else None,
              "policy": asdict(policy or CommitPolicy()), "migrated_from": migrated_from,
              "max_store_bytes": max_store_bytes}
    makedirs_durable(journal)
    atomic_write(os.path.join(journal, CONFIG), (json.dumps(config, indent=1, sort_keys=True) + "\n").encode())
    Journal.open(journal, policy=policy, mirror=mirror).close()  # the first log file: a journal from now on
    return config


def migrate(seed: str, journal: str, *, store: Optional[str] = None, drop_segments: bool = False) -> Dict[str, Any]:
    """Write the records of seed-era JSON-lines journal ``seed`` into a new kvj journal.

    Starts and ends carry over. A seed ``seg_flush`` points at bytes in the seed's KV file,
    which a kvj journal cannot refer to (its segments are content-addressed and verified):
    with such records the migration is refused unless ``drop_segments``, and then each
    request they belonged to resumes at token 0 (the result counts them per request). A
    torn last line (no newline) is left out and reported; a complete line that is not a
    valid record is ``CorruptionError``, the last one too, and nothing is created.
    """
    seed = os.path.abspath(seed)
    if not os.path.isfile(seed):
        raise NotFound(f"no seed-era journal file at {seed}")
    scan = LegacyScan(seed)
    records = list(scan)
    if not records:
        why = f": its only line is torn (no newline; {scan.tail_reason})" if scan.tail else ""
        raise FormatError(f"{seed} holds no seed-era journal record{why}")
    pointers: Dict[str, int] = {}
    for _lsn, rtype, payload in records:
        if rtype == RecordType.SEGMENT:
            pointers[payload["id"]] = pointers.get(payload["id"], 0) + 1
    if pointers and not drop_segments:
        raise InvalidArgument(f"{seed} has {sum(pointers.values())} seg_flush records pointing into the seed's KV "
                              "file, which a kvj journal cannot refer to: pass --drop-segments to migrate without "
                              "them (those requests resume at token 0; the seed journal and its KV file are only "
                              "read)")
    init(journal, store=store, migrated_from=seed)
    written: List[int] = []
    with Journal.open(journal) as j:
        for _lsn, rtype, payload in records:
            if rtype != RecordType.SEGMENT:
                written.append(j.append(rtype, payload))
        j.sync()
    return {"seed": seed, "journal": os.path.abspath(journal), "records": len(written),
            "first_lsn": written[0] if written else None, "last_lsn": written[-1] if written else None,
            "segments_dropped": pointers, "torn_last_line": scan.tail.to_dict() if scan.tail else None}
