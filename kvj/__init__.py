"""kvj: a crash-safe write-ahead journal and segment store for KV caches and training state."""

from kvj.errors import (
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
from kvj.journal.journal import Journal
from kvj.journal.records import RecordType
from kvj.journal.replay import replay
from kvj.journal.state import JournalState, RequestState, SegmentRef
from kvj.journal.writer import CommitPolicy

__version__ = "0.1.0"

__all__ = [
    "CommitPolicy", "CorruptionError", "FormatError", "InvalidArgument", "InvalidName", "Journal", "JournalClosed", "JournalFailed",
    "JournalLocked", "JournalState", "KvjError", "LayoutMismatch", "NotFound", "RecordType", "RequestState", "SegmentCorrupt",
    "SegmentMissing", "SegmentRef", "replay", "__version__",
]
