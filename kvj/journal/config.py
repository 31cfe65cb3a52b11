"""``kvj.conf``: the settings a journal was made with, read by every path that opens it.

``kvj init`` writes it (JSON) into the journal directory: the commit policy, the
segment store and its byte budget (``max_store_bytes``, what ``kvj compact`` evicts down to). ``Journal.open``, the commands, recovery, fsck, compaction and the
integrations all take the store and the policy from here, so a journal made with
``kvj init --store DIR`` keeps its segments in DIR whoever writes it. An argument given
explicitly (``Journal.open(store=..., policy=...)``, ``--store``/``KVJ_STORE``) wins over
the file; without the file, the store is ``JOURNAL/segments`` and the policy the default.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any, Dict, Optional

from kvj.errors import FormatError, InvalidArgument
from kvj.journal.policy import CommitPolicy
from kvj.untrusted import read_json

CONFIG = "kvj.conf"
CONFIG_VERSION = 1
STORE_DIR = "segments"
#: A configuration is a few hundred bytes: anything far larger is not one.
MAX_CONFIG_BYTES = 1 << 16


def read_config(journal: str) -> Optional[Dict[str, Any]]:
    """The journal's ``kvj.conf``, or None for a journal made without ``kvj init`` (or a
    path that is no directory: a seed-era journal file). A file that is not a valid
    configuration is ``FormatError`` naming it: a journal is never used with settings
    other than its own."""
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
    """The commit policy ``kvj.conf`` records (None: no file, or it records none). A value
    ``CommitPolicy`` refuses is ``FormatError`` naming the file."""
    config = read_config(journal)
    if not config or not config.get("policy"):
        return None
    known = {f.name for f in fields(CommitPolicy)}
    try:
        return CommitPolicy(**{k: v for k, v in config["policy"].items() if k in known})
    except InvalidArgument as exc:
        raise FormatError(f"{os.path.join(journal, CONFIG)}: {exc}") from None


def config_store(journal: str) -> Optional[str]:
    """The segment store ``kvj.conf`` names (``kvj init --store``), or None: ``JOURNAL/segments``."""
    config = read_config(journal)
    return config.get("store") or None if config else None


def config_max_store_bytes(journal: str) -> Optional[int]:
    """The store's byte budget ``kvj.conf`` records (``kvj init --max-store-bytes``; what
    ``kvj compact`` evicts down to), or None: no budget."""
    config = read_config(journal)
    return config.get("max_store_bytes") if config else None
