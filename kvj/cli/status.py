"""``kvj status``: a journal at a glance, the first command in an incident."""

from __future__ import annotations

from typing import Optional

from kvj.cli.common import JournalArg, JsonArg, StoreArg, emit_json, journal_path, out, store_path
from kvj.errors import FormatError


def status(journal: JournalArg = None, store: StoreArg = None, as_json: JsonArg = False) -> None:
    """Show a journal at a glance: writer, last write, rates, what is in flight, sizes, damage.

    Whether a writer holds the journal (its pid), the last complete commit group's LSN and
    how long ago it was written, records/s and bytes/s over the last minute and the commit
    lag (the longest interval between two commit groups of one writer in that minute, the
    most a record can have waited for its group; the pauses between writers, a dead
    writer's last group and recovery's epoch record or the next writer's first group, are
    left out: no record waited through them), requests in
    flight and ended, the training step, journal and store sizes (and the store's byte budget
    kvj.conf records, and its hit rate: loads a serving engine asked of it and how many it
    served), what kvj set aside (torn/,
    recovery/, quarantine) and the free space of their disks, the mirror (whether both
    copies reach the same LSN), the last recovery epoch
    and the last compaction, replay's warnings and any damage, with what to run about it.
    Like systemctl status or pg_controldata: the first command in an incident. Read-only:
    it writes nothing and takes no lock.
    """
    from kvj.ops.status import status as journal_status

    path = journal_path(journal)
    try:
        root: Optional[str] = store_path(path, store)
    except FormatError:  # a kvj.conf that cannot be read: status shows it, it does not stop at it
        root = None
    info = journal_status(path, root)
    if as_json:
        emit_json(info)
        return
    from kvj.cli.render import status_view  # rich's tables only for a person: --json starts sooner

    out.print(status_view(info))

