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
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.journal.legacy import SEED_SUFFIXES, is_seed, refused
from kvj.journal.mirror import mirror_of
from kvj.journal.pinned import DIRECT, Files, Pinned
from kvj.journal.reader import LOG_RE, Group, Record, Scan, fields_of
from kvj.journal.snapshot import SNAP_RE, list_snapshots, load_latest, snapshot_name
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

    def __init__(self, path: str, *, after_lsn: int = 0, strict: bool = False, files: Files = DIRECT):
        if not os.path.exists(path):
            raise FormatError(f"no journal at {path}")
        check_journal(path)
        self._scan = Scan(path, after_lsn=after_lsn, strict=strict, files=files)
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
    the same walk); a pass repeated after a concurrent compaction shows its groups again.

    The pass reads the files it held open first (``hold``), so a compaction running meanwhile
    does not disturb it; only a compaction that writes its snapshot while they are being
    held (milliseconds), or deletes a log file beyond those held, makes a fresh pass."""
    if not os.path.exists(path):
        raise FormatError(f"no journal at {path}")
    check_journal(path)
    for _ in range(COMPACTION_RETRIES + 1):
        pinned, newest = hold(path)
        with pinned:
            try:
                return _replay_once(path, at_lsn, strict, on_group, pinned)
            except (CorruptionError, FileNotFoundError):
                # A log file not held may have been folded into a newer snapshot and deleted
                # before the pass read it: then the journal is fine and a fresh pass sees it.
                if newest_snapshot_lsn(path) == newest:
                    raise
    raise _kept_changing(path)


#: Fresh passes replay makes when a compaction changes the journal under it.
COMPACTION_RETRIES = 20
#: Log files a pass holds open (one descriptor per copy); it opens any after them by path.
MAX_PINNED_LOGS = 64


def _dirs(path: str) -> List[str]:
    mirror = mirror_of(path)
    return [path] + ([mirror] if mirror else [])


def newest_snapshot_lsn(path: str, files: Files = DIRECT) -> Optional[int]:
    """The LSN of the newest snapshot in the journal or its mirror (None: there is none)."""
    found = []
    for d in _dirs(path):
        try:
            found += [lsn for lsn, _ in list_snapshots(d, files)]
        except FileNotFoundError:
            continue
    return max(found, default=None)


def pin(path: str) -> Optional[Tuple[Pinned, Optional[int]]]:
    """Hold the journal's listings, its newest snapshot and its log files (both copies) open,
    with that snapshot's LSN; None when a newer snapshot appeared meanwhile. Else every file
    the listings name and the pass cannot open was deleted by a compaction whose snapshot
    the held one covers: unlinks follow their snapshot (``kvj.ops.compact``)."""
    pinned = Pinned()
    try:
        dirs = _dirs(path)
        listings = [pinned.hold_listing(d) for d in dirs]
        newest = newest_snapshot_lsn(path, pinned)
        if newest is not None:
            for d in dirs:
                pinned.hold(os.path.join(d, snapshot_name(newest)))
        logs = sorted({n for names in listings for n in names or () if LOG_RE.match(n)})
        for name in logs[:MAX_PINNED_LOGS]:
            for d in dirs:
                pinned.hold(os.path.join(d, name))
        changed = newest_snapshot_lsn(path) != newest
    except BaseException:
        pinned.close()  # no descriptor outlives a pin that failed
        raise
    if changed:
        pinned.close()
        return None
    return pinned, newest


def hold(path: str) -> Tuple[Pinned, Optional[int]]:
    """``pin``, again while compactions land during it: the files of one pass of ``path`` and
    the held snapshot's LSN (``kvj inspect`` walks them as replay does)."""
    for _ in range(COMPACTION_RETRIES + 1):
        held = pin(path)
        if held is not None:
            return held
    raise _kept_changing(path)


def _kept_changing(path: str) -> KvjError:
    return KvjError(f"{path}: the journal kept changing under replay (back-to-back compactions); try again")


def _replay_once(path: str, at_lsn: Optional[int], strict: bool,
                 on_group: Optional[Callable[[Group], None]], files: Files) -> JournalState:
    state = load_latest(path, files)
    if state is None:
        state = JournalState()
    elif at_lsn is not None and at_lsn < state.snapshot_lsn:
        raise FormatError(f"LSN {at_lsn} precedes the snapshot at LSN {state.snapshot_lsn}: "
                          "history before it was compacted away")
    stream = RecordStream(path, after_lsn=state.snapshot_lsn, strict=strict, files=files)
    stream.fold(state, at_lsn, on_group)
    state.tail = stream.tail
    state.warnings += stream.copy_warnings
    return state
