"""Replay: fold a journal (snapshot plus log files) into state.

By default replay recovers to the last consistent point: a torn tail ends the log and is
reported in ``state.tail``. ``strict=True`` fails on any damage. Damage in the middle of
the log is always an error (``CorruptionError`` with file and offset), never skipped. In
a mirrored journal, what one copy lacks or holds damaged is read from the other, and
``state.warnings`` says which copy was bad. A seed-era JSON-lines journal is refused
(``LegacyJournal``, see ``check_journal``): only ``kvj migrate`` reads it.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Callable, Dict, Iterator, List, Optional

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.journal.legacy import SEED_SUFFIXES, is_seed, refused
from kvj.journal.mirror import mirror_of
from kvj.journal.reader import LOG_RE, Group, Record, Scan, fields_of, list_logs
from kvj.journal.snapshot import SNAP_RE, list_snapshots, load_latest
from kvj.journal.state import JournalState


def holds_journal(directory: str, names: Optional[List[str]] = None) -> bool:
    """Whether ``directory`` (listing ``names``) holds a kvj journal: log files or a snapshot,
    or a mirror that names it back (which holds them while its own copies are lost)."""
    names = os.listdir(directory) if names is None else names
    return any(LOG_RE.match(n) or SNAP_RE.match(n) for n in names) or mirror_of(directory) is not None


def check_journal(path: str) -> None:
    """Refuse, before anything reads or writes it, a ``path`` that is a seed-era JSON-lines
    journal (``LegacyJournal``, pointing at ``kvj migrate``): the file, or a directory holding
    one and no kvj journal. Any other file is ``FormatError``; a missing path or another
    directory passes."""
    if os.path.isfile(path):
        if is_seed(os.path.realpath(path)):  # through a link the caller named
            raise refused(path)
        raise FormatError(f"{path} is not a journal: a file, neither a kvj journal directory nor a seed-era "
                          "JSON-lines journal (nothing was changed)")
    if os.path.isdir(path):
        names = os.listdir(path)
        if not holds_journal(path, names):
            for name in sorted(n for n in names if n.endswith(SEED_SUFFIXES)):
                if is_seed(os.path.join(path, name)):
                    raise refused(os.path.join(path, name))


class RecordStream:
    """Decoded records of a kvj journal after ``after_lsn``; ``tail`` is known once exhausted."""

    def __init__(self, path: str, *, after_lsn: int = 0, strict: bool = False):
        if not os.path.exists(path):
            raise FormatError(f"no journal at {path}")
        check_journal(path)
        self._scan = Scan(path, after_lsn=after_lsn, strict=strict)
        self.after_lsn = after_lsn

    @property
    def tail(self) -> Optional[Dict[str, Any]]:
        return self._scan.tail.to_dict() if self._scan.tail else None

    @property
    def copy_warnings(self) -> List[str]:
        """What one copy of a mirrored journal lacked or held damaged (read from the other)."""
        return [f"{d.path}" + (f" at offset {d.offset}" if d.offset is not None else "") + f": {d.reason}"
                for d in self._scan.copies]

    def __iter__(self) -> Iterator[Record]:
        yield from self._scan.records()

    def fold(self, state: JournalState, at_lsn: Optional[int] = None,
             on_group: Optional[Callable[[Group], None]] = None) -> None:
        """Apply the records (up to ``at_lsn``) to ``state``: what iterating and applying each
        does, group by group, without a ``Record`` per record, each payload decoded once
        (``fields_of``), and with the cycle collector paused (see ``collector_paused``).
        ``on_group`` is shown each commit group read, before its records are applied."""
        apply = state.apply
        after = self._scan.after_lsn
        last = float("inf") if at_lsn is None else at_lsn
        with collector_paused():
            for group in self._scan.groups():
                if on_group is not None:
                    on_group(group)
                for raw in group.records:
                    lsn = raw.lsn
                    if lsn > after:
                        if lsn > last:
                            return
                        apply(raw.rtype, fields_of(raw), lsn)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector (replay's fold and fsck's walk): a fold allocates a few acyclic objects per record and
    keeps many of them, and the collector's passes over the growing state took ~40% of
    replay's time (1,000,000 records: hundreds of passes). Nothing a fold builds is a cycle,
    so nothing waits for the collector; it runs again afterwards (unless it was off).

    What the fold kept is then moved to the collector's oldest generation without a pass
    (``gc.freeze`` and ``gc.unfreeze``): else the first allocation after it walked every
    object the fold made (~10% of a replay of 10^5 records). Not in a process that froze
    objects of its own (a server may, after loading its model): unfreezing would move them too."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def replay(path: str, *, at_lsn: Optional[int] = None, strict: bool = False,
           on_group: Optional[Callable[[Group], None]] = None) -> JournalState:
    """Fold the kvj journal directory at ``path`` into a ``JournalState``, up to ``at_lsn`` if
    given. A seed-era JSON-lines journal is ``LegacyJournal`` (``kvj migrate`` converts it).
    ``on_group`` sees each commit group folded (``kvj status`` counts the last minute's from
    the same walk); a pass repeated after a concurrent compaction shows its groups again."""
    if not os.path.exists(path):
        raise FormatError(f"no journal at {path}")
    check_journal(path)
    for _ in range(COMPACTION_RETRIES + 1):
        before = (list_snapshots(path), list_logs(path))
        try:
            state = _replay_once(path, at_lsn, strict, on_group)
        except (CorruptionError, FileNotFoundError):
            # A compactor may have written a newer snapshot and deleted the files this pass
            # was reading; then the journal is fine and a fresh pass sees it consistently
            # (and when the passes run out, the journal is not called corrupt for it).
            if (list_snapshots(path), list_logs(path)) == before:
                raise
            continue
        # A compactor that replaced the snapshot during the pass may have deleted logs after
        # the old snapshot before this pass listed them; when only an empty newest log was
        # left, nothing failed, yet records were missed. Only an unchanged snapshot counts.
        if list_snapshots(path) == before[0]:
            return state
    raise KvjError(f"{path}: the journal kept changing under replay (back-to-back compactions); try again")


#: Fresh passes replay makes when files vanish under it (a concurrent compaction).
COMPACTION_RETRIES = 20


def _replay_once(path: str, at_lsn: Optional[int], strict: bool,
                 on_group: Optional[Callable[[Group], None]]) -> JournalState:
    state = load_latest(path)
    if state is None:
        state = JournalState()
    elif at_lsn is not None and at_lsn < state.snapshot_lsn:
        raise FormatError(f"LSN {at_lsn} precedes the snapshot at LSN {state.snapshot_lsn}: "
                          "history before it was compacted away")
    stream = RecordStream(path, after_lsn=state.snapshot_lsn, strict=strict)
    stream.fold(state, at_lsn, on_group)
    state.tail = stream.tail
    state.warnings += stream.copy_warnings
    return state
