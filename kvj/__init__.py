"""kvj: a crash-safe write-ahead journal and segment store for KV caches and training state."""

from .errors import (CorruptionError, FormatError, InvalidName, JournalClosed, JournalFailed, JournalLocked,
                     KvjError, LayoutMismatch, SegmentCorrupt, SegmentMissing)
from .journal import Journal
from .records import RecordType
from .replay import replay
from .state import JournalState, RequestState, SegmentRef
from .writer import CommitPolicy

__version__ = "0.1.0"

__all__ = [
    "CommitPolicy", "CorruptionError", "FormatError", "InvalidName", "Journal", "JournalClosed", "JournalFailed",
    "JournalLocked", "JournalState", "KvjError", "LayoutMismatch", "RecordType", "RequestState", "SegmentCorrupt",
    "SegmentMissing", "SegmentRef", "replay", "__version__",
]
