"""The commit policy: when the commit loop writes a group, how far appends may run ahead of
the disk, and when a log file is rotated; what ``kvj init`` records in ``kvj.conf`` and
``Journal.open(policy=...)`` takes. Apart from the writer, so that reading ``kvj.conf``
(every command, ``kvj status`` too) needs none of the writer's modules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from kvj.errors import InvalidArgument


@dataclass(frozen=True)
class CommitPolicy:
    """When the committer writes a group: whichever bound is reached first."""

    max_delay: float = 0.100  # seconds a record may wait before its group is committed
    max_records: int = 100  # commit as soon as this many records are pending
    max_buffer_bytes: int = 64 << 20  # append blocks beyond this (backpressure, not memory growth)
    #: append blocks while this many records are appended but not yet durable: the most a crash
    #: can lose, however slow the disk's fsync gets (groups never grow past it)
    max_pending_records: int = 10_000
    file_size_limit: int = 64 << 20  # rotate to a new log file after this many bytes
    #: at most this many records per commit group (None: a group takes all that is pending), so
    #: that records per fdatasync stay fixed under bulk load while the next group fills
    max_group_records: Optional[int] = None

    def __post_init__(self) -> None:
        """Refuse, where the policy is made, a value the writer cannot work with (a zero
        buffer would block the first append for ever): ``InvalidArgument`` naming it."""
        delay = self.max_delay
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay) or delay < 0:
            raise InvalidArgument(f"commit policy: max_delay must be a finite number of seconds >= 0, not {delay!r}")
        for name in ("max_records", "max_buffer_bytes", "max_pending_records", "file_size_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"commit policy: {name} must be an integer >= 1, not {value!r}")
        cap = self.max_group_records
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise InvalidArgument(f"commit policy: max_group_records must be None or an integer >= 1, not {cap!r}")
