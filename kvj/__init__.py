"""kvj: a crash-safe write-ahead journal and segment store for KV caches and training state.

Every public name is imported on first use (PEP 562), so ``import kvj`` loads nothing new:
the ``kvj`` command installs its Ctrl-C handler first (``kvj.cli.launch``).
"""

import sys

__version__ = "0.2.0"

#: Public name -> the module that defines it.
_LAZY = {
    **dict.fromkeys(("CacheFull", "CorruptionError", "FormatError", "InvalidArgument", "InvalidName",
                     "JournalClosed", "JournalFailed", "JournalLocked", "KvjError", "LayoutMismatch",
                     "LegacyJournal", "NotFound", "SegmentCorrupt", "SegmentMissing"), "kvj.errors"),
    "Journal": "kvj.journal.journal", "RecordType": "kvj.journal.records", "replay": "kvj.journal.replay",
    "JournalState": "kvj.journal.state", "RequestState": "kvj.journal.state", "SegmentRef": "kvj.journal.state",
    "CommitPolicy": "kvj.journal.config",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> object:
    """Import the public ``name`` from its module, once."""
    if name not in _LAZY:
        raise AttributeError(f"module 'kvj' has no attribute {name!r}")
    __import__(_LAZY[name])
    value = globals()[name] = getattr(sys.modules[_LAZY[name]], name)
    return value


def __dir__() -> "list[str]":
    return sorted(set(globals()) | set(_LAZY))
