"""Replay: fold a journal (its newest snapshot, then the log after it) into a ``JournalState``. A
torn tail ends the log (``state.tail``); damage elsewhere is always an error, never skipped; what
one copy of a mirrored journal lacks is read from the other (``state.warnings``).
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.journal.legacy import SEED_SUFFIXES, is_seed, refused
from kvj.journal.mirror import mirror_of
from kvj.journal.reader import LOG_RE, Group, Record, Scan, fields_of
from kvj.journal.snapshot import SNAP_RE, all_snapshots, load_latest, snapshot_name
from kvj.journal.source import DIRECT, Pinned
from kvj.journal.state import JournalState

#: Fresh passes replay makes when a compaction changes the journal under it.
COMPACTION_RETRIES = 20
#: Log files a pass holds open (one descriptor per copy); it opens any after them by path.
MAX_PINNED_LOGS = 64


def holds_journal(directory: str, names: Optional[List[str]] = None) -> bool:
    """Whether ``directory`` (listing ``names``) holds a kvj journal: log files or a snapshot,
    or a mirror that names it back (which holds them while its own copies are lost)."""
    names = os.listdir(directory) if names is None else names
    return any(LOG_RE.match(n) or SNAP_RE.match(n) for n in names) or mirror_of(directory) is not None


def check_journal(path: str) -> None:
    """Refuse, before anything reads or writes it, a seed-era journal at ``path`` (the file, or a
    directory holding one and no kvj journal: ``LegacyJournal``) or another file (``FormatError``)."""
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

    def __init__(self, path: str, *, after_lsn: int = 0, strict: bool = False, files: Pinned = DIRECT):
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
        """Apply the records (up to ``at_lsn``) to ``state``, group by group, each payload decoded
        once and with the cycle collector paused; ``on_group`` sees each group first."""
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
    """Pause Python's cycle collector for a fold: its passes over the growing state took ~40% of
    replay's time, and a fold builds no cycle. What it kept then moves to the oldest generation
    without a pass (``gc.freeze``, unless the process froze objects of its own)."""
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
    """Fold the kvj journal directory at ``path`` into a ``JournalState``, up to ``at_lsn`` if given;
    ``on_group`` sees each commit group folded. The pass reads the files it held open first
    (``pin``), so a compaction meanwhile does not disturb it, unless it deletes one beyond them."""
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


def _dirs(path: str) -> List[str]:
    mirror = mirror_of(path)
    return [path] + ([mirror] if mirror else [])


def newest_snapshot_lsn(path: str, files: Pinned = DIRECT) -> Optional[int]:
    """The LSN of the newest snapshot in the journal or its mirror (None: there is none)."""
    return max(all_snapshots(path, files), default=None)


def pin(path: str) -> Optional[Tuple[Pinned, Optional[int]]]:
    """Hold the journal's listings, newest snapshot and log files (both copies) open, with that
    snapshot's LSN; None when a newer snapshot appeared meanwhile (else a file held as missing
    was deleted by a compaction the held snapshot covers)."""
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
                 on_group: Optional[Callable[[Group], None]], files: Pinned) -> JournalState:
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
