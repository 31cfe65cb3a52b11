"""A journal's settings: the commit policy, and ``kvj.conf``, which ``kvj init`` writes and every
path that opens the journal reads (the commit policy, the segment store, its byte budget).

An argument given explicitly (``Journal.open(store=..., policy=...)``, ``--store``/``KVJ_STORE``)
wins over the file; without the file, the store is ``JOURNAL/segments`` and the policy the default.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from kvj.errors import FormatError, InvalidArgument
from kvj.untrusted import read_json

CONFIG = "kvj.conf"
CONFIG_VERSION = 1
STORE_DIR = "segments"
#: A configuration is a few hundred bytes: anything far larger is not one.
MAX_CONFIG_BYTES = 1 << 16
#: The longest max_delay: a day (the committer's timed wait, ``threading.TIMEOUT_MAX``, stays far away).
MAX_DELAY = 24 * 3600.0
#: The largest count or size: what a file offset (off_t) holds.
MAX_COUNT = (1 << 63) - 1
_COUNTS = ("max_records", "max_buffer_bytes", "max_pending_records", "file_size_limit", "max_group_records")


@dataclass(frozen=True)
class CommitPolicy:
    """When the commit loop writes a group (whichever bound is reached first), how far appends
    may run ahead of the disk, and when a log file is rotated."""

    max_delay: float = 0.100  # seconds a record may wait before its group is committed
    max_records: int = 100  # commit as soon as this many records are pending
    max_buffer_bytes: int = 64 << 20  # append blocks beyond this (backpressure, not memory growth)
    #: append blocks while this many records are appended but not yet durable: the most a crash
    #: can lose, however slow the disk's fsync gets (groups never grow past it)
    max_pending_records: int = 10_000
    file_size_limit: int = 64 << 20  # rotate to a new log file after this many bytes
    #: at most this many records per commit group (None: all that is pending), so that records
    #: per fdatasync stay fixed under bulk load while the next group fills
    max_group_records: Optional[int] = None

    def __post_init__(self) -> None:
        """Refuse, where the policy is made, a value the writer cannot work with."""
        for f in fields(self):
            check_policy_value(f.name, getattr(self, f.name))


def check_policy_value(name: str, value: object) -> None:
    """Refuse one commit policy value that cannot work (``InvalidArgument`` naming it): a zero
    buffer would block the first append for ever, a huge max_delay kill the committer thread."""
    if name == "max_delay":
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not 0 <= value <= MAX_DELAY):
            raise InvalidArgument(f"commit policy: max_delay must be a finite number of seconds >= 0 and at most "
                                  f"{MAX_DELAY:g} (a day), not {value!r}")
    elif name in _COUNTS:
        if name == "max_group_records" and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            none = "None or " if name == "max_group_records" else ""
            raise InvalidArgument(f"commit policy: {name} must be {none}an integer >= 1 and below 2^63, not {value!r}")
    else:
        raise InvalidArgument(f"commit policy: no setting named {name!r}")


def read_config(journal: str) -> Optional[Dict[str, Any]]:
    """The journal's ``kvj.conf``, or None without one (or for a path that is no directory). A
    file that is not a valid configuration is ``FormatError``: a journal is never used with
    settings other than its own."""
    path = os.path.join(journal, CONFIG)
    try:
        config = read_json(path, max_bytes=MAX_CONFIG_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except FormatError as exc:
        raise FormatError(f"not a kvj configuration: {exc}") from None
    if not isinstance(config, dict) or config.get("kvj_config") != CONFIG_VERSION:
        raise FormatError(f"{path}: not a kvj configuration of version {CONFIG_VERSION}")
    store = config.get("store")
    if store is not None and (not isinstance(store, str) or not os.path.isabs(store) or "\0" in store):
        raise FormatError(f"{path}: 'store' must be an absolute path or null, not {store!r}")
    policy = config.get("policy")
    if policy is not None and not isinstance(policy, dict):
        raise FormatError(f"{path}: 'policy' must be an object, not {policy!r}")
    budget = config.get("max_store_bytes")
    if budget is not None and (type(budget) is not int or budget < 0):
        raise FormatError(f"{path}: 'max_store_bytes' must be a non-negative integer or null, not {budget!r}")
    return config


def config_policy(journal: str) -> Optional[CommitPolicy]:
    """The commit policy ``kvj.conf`` records, or None; a value ``CommitPolicy`` refuses is
    ``FormatError`` naming the file."""
    config = read_config(journal)
    if not config or not config.get("policy"):
        return None
    known = {f.name for f in fields(CommitPolicy)}
    try:
        return CommitPolicy(**{k: v for k, v in config["policy"].items() if k in known})
    except InvalidArgument as exc:
        raise FormatError(f"{os.path.join(journal, CONFIG)}: {exc}") from None


def config_store(journal: str) -> Optional[str]:
    """The segment store ``kvj.conf`` names (``kvj init --store``), or None."""
    config = read_config(journal)
    return config.get("store") or None if config else None


def default_store_path(journal: str) -> str:
    """The journal's segment store when none is given: the one ``kvj.conf`` names, else
    ``segments/`` inside it."""
    return config_store(journal) or os.path.join(journal, STORE_DIR)


def config_max_store_bytes(journal: str) -> Optional[int]:
    """The store's byte budget ``kvj.conf`` records (what ``kvj compact`` evicts down to), or None."""
    config = read_config(journal)
    return config.get("max_store_bytes") if config else None
