"""kvj: a crash-safe write-ahead journal and segment store for KV caches and training state.

The whole API is imported on first use (PEP 562), the exceptions too, so that ``import kvj``
imports nothing that is not loaded already: the ``kvj`` command installs its Ctrl-C handler
as its first act (``kvj.cli.launch``), and nothing may run before it that Ctrl-C could
interrupt with a traceback.
"""

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, List

    from kvj.errors import (
                            CacheFull,
                            CorruptionError,
                            FormatError,
                            InvalidArgument,
                            InvalidName,
                            JournalClosed,
                            JournalFailed,
                            JournalLocked,
                            KvjError,
                            LayoutMismatch,
                            LegacyJournal,
                            NotFound,
                            SegmentCorrupt,
                            SegmentMissing,
    )
    from kvj.journal.journal import Journal
    from kvj.journal.records import RecordType
    from kvj.journal.replay import replay
    from kvj.journal.config import CommitPolicy
    from kvj.journal.state import JournalState, RequestState, SegmentRef

__version__ = "0.1.0"

_ERRORS = ("CacheFull", "CorruptionError", "FormatError", "InvalidArgument", "InvalidName", "JournalClosed",
           "JournalFailed", "JournalLocked", "KvjError", "LayoutMismatch", "LegacyJournal", "NotFound",
           "SegmentCorrupt", "SegmentMissing")

#: Public name -> the module that defines it, imported when the name is first used.
_LAZY = {
    **{name: "kvj.errors" for name in _ERRORS},
    "Journal": "kvj.journal.journal", "RecordType": "kvj.journal.records", "replay": "kvj.journal.replay",
    "JournalState": "kvj.journal.state", "RequestState": "kvj.journal.state", "SegmentRef": "kvj.journal.state",
    "CommitPolicy": "kvj.journal.config",
}


def __getattr__(name: str) -> "Any":
    if name in _LAZY:
        __import__(_LAZY[name])
        value = getattr(sys.modules[_LAZY[name]], name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvj' has no attribute {name!r}")


def __dir__() -> "List[str]":
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CacheFull", "CommitPolicy", "CorruptionError", "FormatError", "InvalidArgument", "InvalidName", "Journal", "JournalClosed",
    "JournalFailed", "JournalLocked", "JournalState", "KvjError", "LayoutMismatch", "NotFound", "RecordType",
    "RequestState", "SegmentCorrupt", "SegmentMissing", "SegmentRef", "replay", "__version__",
]
