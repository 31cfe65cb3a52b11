"""fsck: check a journal and its segment store end to end, and optionally repair (kvj-fsck(1)).

Every log file's header, framing, CRCs and LSN order, every snapshot (and its agreement with
the log it came from while that log exists), then the store (``kvj.ops.fsck_segments``).
``repair`` cuts a torn tail, sets a bad snapshot aside when the log can replace it and
quarantines damaged segments, keeping every byte it removes; ``preen`` (e2fsck's -p) repairs
only what recovery would do by itself. The end of the log is judged by the recovery ``mode``
as recovery in that mode would. Without either nothing is written (locks held shared through
read-only lock files, writes refused by ``READ_ONLY_FS``), so fsck works on a read-only mount.
``exit_code`` follows e2fsck: 0 clean, 1 corrected, 4 left uncorrected, 8 operational (raised),
plus 64 for damage in the store's use log. What recovery handles by itself is a warning, so
``kvj fsck && kvj recover`` recovers after a crash.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, InvalidArgument, JournalLocked, NotFound
from kvj.fileio import FS, READ_ONLY_FS, REAL_FS, makedirs_durable, open_read, rename_durable
from kvj.journal.config import config_policy
from kvj.journal.recovery import LOCK_NAME, TORN_DIR, DirLock, cut_torn_tail
from kvj.journal.reader import (
    ABSOLUTE_CONSISTENCY,
    COPY,
    COVERED_GAP,
    DAMAGED_TAIL,
    POINT_IN_TIME,
    TOLERATE_TORN_TAIL,
    TORN,
    Damage,
    Scan,
    TornTail,
    check_mode,
    list_logs,
    payload_of,
    read_header,
)
from kvj.journal.replay import check_journal, collector_paused
from kvj.journal.snapshot import decode_snapshot, list_snapshots
from kvj.journal.state import JournalState
from kvj.ops.fsck_segments import USE_LOG_KIND, check_segments

CLEAN, CORRECTED, UNCORRECTED = 0, 1, 4
#: Added to the status when the store's use log holds damaged records (a warning: e2fsck leaves 64 unused).
USE_LOG_DAMAGED = 64
#: Replay warnings begin with the LSN of the record they are about.
_WARNING_LSN = re.compile(r"^LSN (\d+):")

Progress = Callable[[str, int, int], None]


@dataclass
class Finding:
    """One thing fsck found. Errors count toward the exit code; warnings and notes do not."""

    severity: str  # "error", "warning" or "note"
    kind: str
    message: str
    path: Optional[str] = None
    offset: Optional[int] = None
    fixed: bool = False
    action: Optional[str] = None  # what --repair did about it

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class FsckResult:
    path: str
    repair: bool
    preen: bool = False
    mode: str = TOLERATE_TORN_TAIL  # the recovery mode the end of the log is judged by
    findings: List[Finding] = field(default_factory=list)
    logs: int = 0
    records: int = 0
    snapshots: int = 0
    first_lsn: Optional[int] = None
    last_lsn: int = 0
    segments_checked: int = 0
    orphans: List[str] = field(default_factory=list)
    cached: int = 0  # segments held as the prefix cache (KV blocks of ended requests: JournalState.cache)
    writer_live: bool = False
    data_verified: int = 0  # segments read in full (every chunk CRC and the digest)
    headers_checked: int = 0  # segments outside a --read-data-subset sample: header only
    sample_seed: Optional[int] = None  # how the sample was drawn, to draw it again

    @property
    def errors(self) -> List[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def exit_code(self) -> int:
        code = CLEAN
        if any(f.fixed for f in self.findings):
            code |= CORRECTED
        if any(not f.fixed for f in self.errors):
            code |= UNCORRECTED
        if any(f.kind == USE_LOG_KIND for f in self.findings):
            code |= USE_LOG_DAMAGED
        return code

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "repair": self.repair, "preen": self.preen, "mode": self.mode,
                "exit_code": self.exit_code,
                "logs": self.logs, "records": self.records, "snapshots": self.snapshots,
                "first_lsn": self.first_lsn, "last_lsn": self.last_lsn,
                "segments_checked": self.segments_checked, "data_verified": self.data_verified,
                "headers_checked": self.headers_checked, "sample_seed": self.sample_seed, "orphans": self.orphans,
                "cached": self.cached, "writer_live": self.writer_live, "findings": [f.to_dict() for f in self.findings]}


def _canonical(state: JournalState) -> str:
    """The part of a state a snapshot must reproduce, in a comparable form."""
    d = state.to_dict(include_ended=False)
    for volatile in ("warnings", "tail", "snapshot_lsn"):
        d.pop(volatile, None)
    return json.dumps(d, sort_keys=True, default=str)


def set_aside(path: str, fs: FS = REAL_FS) -> str:
    """Move ``path`` into the journal's ``torn/`` folder (durably); returns the new path."""
    journal = os.path.dirname(path)
    aside_dir = os.path.join(journal, TORN_DIR)
    makedirs_durable(aside_dir, fs)
    target = os.path.join(aside_dir, os.path.basename(path))
    n = 1
    while os.path.exists(target):
        target = os.path.join(aside_dir, f"{os.path.basename(path)}.{n}")
        n += 1
    rename_durable(path, target, fs)
    return target


class _Checker:
    def __init__(self, path: str, store: Any, repair: bool, preen: bool, sample: Optional[float], fs: FS,
                 progress: Optional[Progress], mode: str = TOLERATE_TORN_TAIL):
        self.path, self.store_arg, self.fs, self.progress = path, store, fs, progress
        self.repair, self.preen, self.sample, self.mode = repair, preen, sample, mode
        self.result = FsckResult(path, repair, preen, mode)

    def add(self, severity: str, kind: str, message: str, path: Optional[str] = None,
            offset: Optional[int] = None) -> Finding:
        finding = Finding(severity, kind, message, path, offset)
        self.result.findings.append(finding)
        return finding

    def fix(self, finding: Finding, action: Callable[[], str], preen: bool = False) -> None:
        """Under --repair, or under --preen for a fix that needs no decision (``preen``), run
        ``action`` (which returns what it did): the finding is corrected."""
        if self.repair or (self.preen and preen):
            finding.action = action()
            finding.fixed = True
        elif self.preen:
            finding.action = "left for kvj fsck --repair: it needs a person's decision"

    def snapshots(self) -> List[Tuple[int, str, JournalState]]:
        """Decode every snapshot; returns the valid ones, newest first."""
        valid: List[Tuple[int, str, JournalState]] = []
        damaged: List[Tuple[int, str, Exception]] = []
        snaps = list_snapshots(self.path)
        self.result.snapshots = len(snaps)
        for lsn, spath in snaps:
            try:
                with open_read(spath) as f:
                    valid.append((lsn, spath, decode_snapshot(f.read(), spath)))
            except (CorruptionError, FormatError) as exc:
                damaged.append((lsn, spath, exc))
        for lsn, spath, exc in damaged:
            newest = lsn == snaps[0][0]
            finding = self.add("error", "snapshot", str(exc) + (" (replay uses the newest snapshot)" if newest else ""),
                               spath, getattr(exc, "offset", None))
            older = max((v_lsn for v_lsn, _p, _s in valid if v_lsn < lsn), default=0)
            if not newest or self._first_base() <= older + 1:
                self.fix(finding, lambda p=spath: f"set aside as {set_aside(p, self.fs)}")
        return valid

    def _first_base(self) -> int:
        """Base LSN of the oldest log file (a huge number when there is none)."""
        logs = list_logs(self.path)
        header = read_header(logs[0]) if logs else None
        return header.base_lsn if header is not None else 1 << 62

    def logs(self, valid: List[Tuple[int, str, JournalState]]) -> JournalState:
        """Walk every log file, fold the live state, and check the newest snapshot against its log."""
        r = self.result
        snap = valid[0][2] if valid else None
        snap_canon = _canonical(snap) if snap is not None else ""
        snap_lsn = snap.snapshot_lsn if snap is not None else 0
        state = snap if snap is not None else JournalState()
        # A second fold from the next older snapshot (or from nothing) re-derives the newest
        # snapshot while the log it was compacted from still exists, without a gap.
        older = next(((lsn, s) for lsn, _p, s in valid if snap is not None and lsn < snap_lsn), (0, None))
        check: Optional[JournalState] = older[1] if older[1] is not None else JournalState()
        check_next = older[0] + 1
        scan = Scan(self.path, covered_lsn=snap_lsn, reporter=self._report, verify_copies=True)
        r.logs = len(scan.logs)
        total = sum(_size(log) for log in scan.logs)
        with collector_paused():
            for raw in scan:
                r.records += 1
                if self.progress and r.records % 4096 == 0:
                    self.progress("reading the log", scan.bytes_read, total)
                try:
                    payload = payload_of(raw)
                except CorruptionError as exc:
                    self.add("error", "corruption", exc.reason, exc.path, exc.offset)
                    continue
                lsn = raw.lsn
                if r.first_lsn is None:
                    r.first_lsn = lsn
                r.last_lsn = lsn
                if lsn > snap_lsn:
                    state.apply(raw.rtype, payload, lsn)
                elif check is not None and lsn >= check_next:
                    if lsn != check_next:
                        check = None  # the log the newest snapshot came from is gone (compacted): nothing to compare
                        continue
                    check.apply(raw.rtype, payload, lsn)
                    check_next += 1
        if snap is not None:
            self._check_snapshot(snap.snapshot_lsn, snap_canon, check, scan.next_lsn, valid)
        return state

    def _report(self, damage: Damage) -> None:
        """The scan's reporter: each damage becomes a finding (and a repair), and the walk goes on."""
        if damage.kind == COVERED_GAP:
            # compaction deletes covered files and a crash may keep its unlinks in any order
            self.add("note", "covered-gap", f"{damage.reason}: compacted into the snapshot", damage.path, 0)
        elif damage.kind == COPY:  # one copy of a mirrored journal is bad; the other was read
            self.add("warning", "mirror-copy", damage.reason, damage.path, damage.offset)
        elif damage.kind == DAMAGED_TAIL:
            self._damaged_tail(damage)
        elif damage.kind != TORN:
            self.add("error", damage.kind, damage.reason, damage.path, damage.offset)
        elif damage.offset == 0 and self.result.writer_live:
            self.add("note", "file-in-progress", "the live writer is creating this log file", damage.path, 0)
        elif damage.offset == 0 and damage.length == 0:
            self.add("note", "empty-log", "the newest log file is empty (a crash while starting it): harmless, "
                     "the next writer replaces it", damage.path, 0)
        elif damage.offset == 0:
            finding = self.add(self._torn_severity(), "torn-header", f"the newest log file has an incomplete header "
                               f"({damage.length} bytes: a crash while creating it, or damage); no record is in it. "
                               f"{self._cut_by()} moves its bytes to {TORN_DIR}/", damage.path, 0)
            self.fix(finding, lambda: self._drop_file(damage.path, damage.length),
                     preen=self.mode != ABSOLUTE_CONSISTENCY)
        elif self.result.writer_live:
            self.add("note", "tail-in-progress", f"{damage.length} bytes after the last complete group: "
                     "the live writer may be writing them", damage.path, damage.offset)
        else:
            tail = TornTail(damage.path, damage.offset or 0, damage.length)
            finding = self.add(self._torn_severity(), "torn-tail", f"{damage.reason}. The end of the log: its "
                               f"bytes are what a crash while writing it leaves. {self._cut_by()} cuts it and keeps "
                               f"the bytes in {TORN_DIR}/", damage.path, damage.offset)
            self.fix(finding, lambda: f"cut; bytes kept in {cut_torn_tail(tail, self.fs)}",
                     preen=self.mode != ABSOLUTE_CONSISTENCY)

    def _torn_severity(self) -> str:
        """A torn tail is what recovery cuts by itself, except under absolute-consistency."""
        return "error" if self.mode == ABSOLUTE_CONSISTENCY else "warning"

    def _cut_by(self) -> str:
        if self.mode == ABSOLUTE_CONSISTENCY:
            return "Recovery in this mode refuses it; kvj fsck --repair"
        return "Recovery (or fsck --repair)"

    def _damaged_tail(self, damage: Damage) -> None:
        """A last group that cannot be a torn write: an error that no repair touches (its
        records may have been acknowledged), unless point-in-time recovery is what is asked
        for, which sets it aside and records the loss."""
        held = f"{damage.records} records" if damage.records is not None else "records"
        if self.mode == POINT_IN_TIME:
            self.add("warning", "damaged-tail", f"{damage.reason}. Recovery in point-in-time mode ends the log "
                     f"before it, sets it aside in {TORN_DIR}/ and records the loss of its {held}",
                     damage.path, damage.offset)
            return
        finding = self.add("error", "damaged-tail", f"{damage.reason}. Its {held} may have been acknowledged as "
                           "durable: kvj recover refuses the journal; kvj recover --recovery-mode point-in-time ends "
                           f"the log before it, sets it aside in {TORN_DIR}/ and records the loss", damage.path,
                           damage.offset)
        if self.repair or self.preen:
            finding.action = "left: cutting it loses records that may have been acknowledged (see above)"

    def _drop_file(self, path: str, size: int) -> str:
        aside = cut_torn_tail(TornTail(path, 0, size), self.fs) if size else None
        self.fs.unlink(path)
        self.fs.fsync_dir(self.path)
        return f"removed; bytes kept in {aside}" if aside else "removed (it was empty)"

    def _check_snapshot(self, lsn: int, canon: str, check: Optional[JournalState], expected: Optional[int],
                        valid: List[Tuple[int, str, JournalState]]) -> None:
        spath = next(p for s_lsn, p, _s in valid if s_lsn == lsn)
        if expected is not None and lsn > expected - 1:
            # a crash kept some of compaction's unlinks: the snapshot holds what the files held
            self.add("note", "covered-gap", f"the log ends at LSN {expected - 1}, before the snapshot at LSN {lsn}: "
                     "the files after it were compacted into the snapshot", spath)
            return
        if check is None or check.last_lsn < lsn:
            return
        if _canonical(check) != canon:
            finding = self.add("error", "snapshot", f"snapshot at LSN {lsn} disagrees with the log it was "
                               "compacted from", spath)
            self.fix(finding, lambda: f"set aside as {set_aside(spath, self.fs)}; the log replaces it")

    def replay_warnings(self, state: JournalState) -> None:
        """Replay's warnings about records after the last recovery; older ones were there when
        that recovery ran, so they are counted, not repeated on every run."""
        since = state.epochs[-1]["lsn"] if state.epochs else 0
        old = 0
        for warning in state.warnings:
            m = _WARNING_LSN.match(warning)
            if m and int(m.group(1)) <= since:
                old += 1
            else:
                self.add("warning", "replay", warning)
        if old:
            self.add("note", "old-warnings", f"{old} replay warnings about records before the last recovery (LSN "
                     f"{since}) are not repeated (kvj replay --json lists them)")


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _writer_live(path: str) -> bool:
    """Whether a live process holds the writer lock (probed read-only, without keeping it)."""
    try:
        lock = DirLock(path, LOCK_NAME, "writer").acquire_shared()
    except JournalLocked:
        return True
    if lock is not None:
        lock.release()
    return False


def fsck(path: str, store: Any = None, *, repair: bool = False, preen: bool = False,
         sample: Optional[float] = None, fs: FS = REAL_FS, progress: Optional[Progress] = None,
         mode: str = TOLERATE_TORN_TAIL) -> FsckResult:
    """Check (with ``repair`` or ``preen``, repair) the journal at ``path``; ``sample`` in (0, 1]
    reads only that fraction of the segments in full. ``JournalLocked`` when repairing while a
    writer runs, or while a compactor runs; ``NotFound`` without a journal; ``FormatError`` for
    a kvj.conf no writer would use."""
    from kvj.journal.recovery import COMPACT_LOCK

    check_mode(mode)
    if repair and preen:
        raise InvalidArgument("repair and preen exclude each other")
    if sample is not None and not 0 < sample <= 1:
        raise InvalidArgument(f"the sample {sample} is not a fraction in (0, 1]")
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise NotFound(f"no journal at {path}")
    writes = repair or preen
    checker = _Checker(path, store, repair, preen, sample, fs if writes else READ_ONLY_FS, progress, mode)
    check_journal(path)  # a seed-era journal: LegacyJournal, nothing read or written
    if not os.path.isdir(path):
        raise NotFound(f"no journal at {path}")
    config_policy(path)  # a kvj.conf no writer would use: FormatError, as every reader refuses it
    compactor = DirLock(path, COMPACT_LOCK, "compactor")
    locks = [compactor.acquire()] if writes else [lock for lock in [compactor.acquire_shared()] if lock]
    try:
        if writes:
            locks.append(DirLock(path, LOCK_NAME, "writer").acquire())
        else:
            checker.result.writer_live = _writer_live(path)
        state = checker.logs(checker.snapshots())
        checker.replay_warnings(state)
        check_segments(checker, state)
    finally:
        for lock in reversed(locks):
            lock.release()
    _replies(checker.result, dict(repair=repair, preen=preen, sample=sample, fs=fs, progress=progress, mode=mode))
    return checker.result


def _replies(result: FsckResult, options: Dict[str, Any]) -> None:
    """kvj serve's reply journal (``JOURNAL/replies/``), checked as any journal is, into ``result``."""
    from kvj.journal.replay import holds_journal
    from kvj.serve.paths import REPLIES_DIR

    path = os.path.join(result.path, REPLIES_DIR)
    if os.path.basename(result.path) == REPLIES_DIR or not os.path.isdir(path) or not holds_journal(path):
        return
    sub = fsck(path, None, **options)
    for finding in sub.findings:
        finding.message = f"replies/ (kvj serve's reply journal): {finding.message}"
        result.findings.append(finding)
    result.logs += sub.logs
    result.records += sub.records
    result.snapshots += sub.snapshots

