"""kvj: a crash-safe write-ahead journal and segment store for KV caches and training state.

The exceptions are imported at once; the rest of the API on first use (PEP 562), so that
``import kvj`` is cheap and the ``kvj`` command can honour Ctrl-C from its first instant.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any, List

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
                        NotFound,
                        SegmentCorrupt,
                        SegmentMissing,
)

if TYPE_CHECKING:
    from kvj.journal.journal import Journal
    from kvj.journal.records import RecordType
    from kvj.journal.replay import replay
    from kvj.journal.state import JournalState, RequestState, SegmentRef
    from kvj.journal.writer import CommitPolicy

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported when the name is first used.
_LAZY = {
    "Journal": "kvj.journal.journal", "RecordType": "kvj.journal.records", "replay": "kvj.journal.replay",
    "JournalState": "kvj.journal.state", "RequestState": "kvj.journal.state", "SegmentRef": "kvj.journal.state",
    "CommitPolicy": "kvj.journal.writer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvj' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CacheFull", "CommitPolicy", "CorruptionError", "FormatError", "InvalidArgument", "InvalidName", "Journal", "JournalClosed",
    "JournalFailed", "JournalLocked", "JournalState", "KvjError", "LayoutMismatch", "NotFound", "RecordType",
    "RequestState", "SegmentCorrupt", "SegmentMissing", "SegmentRef", "replay", "__version__",
]
