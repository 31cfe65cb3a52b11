"""The commit policy: when the commit loop writes a group, how far appends may run ahead of
the disk, and when a log file is rotated; what ``kvj init`` records in ``kvj.conf`` and
``Journal.open(policy=...)`` takes. Apart from the writer, so that reading ``kvj.conf``
(every command, ``kvj status`` too) needs none of the writer's modules."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
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
        buffer would block the first append for ever, a max_delay past a timed wait's limit
        would kill the committer thread): ``InvalidArgument`` naming it."""
        for f in fields(self):
            check_policy_value(f.name, getattr(self, f.name))


#: The longest max_delay: a day. A record left undurable longer is no journal's policy, and
#: the committer's timed wait (``threading.TIMEOUT_MAX``, about 292 years) stays far away.
MAX_DELAY = 24 * 3600.0
#: The largest count or size: what a file offset (off_t) holds.
MAX_COUNT = (1 << 63) - 1
_COUNTS = ("max_records", "max_buffer_bytes", "max_pending_records", "file_size_limit", "max_group_records")


def check_policy_value(name: str, value: object) -> None:
    """Refuse one commit policy value that cannot work (``InvalidArgument`` naming it):
    ``CommitPolicy`` checks each of its fields here, and ``kvj init`` each option it takes."""
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
