"""Salvage: recover a journal damaged in the middle of its log, or at its end where the bytes
cannot be a torn write (a damaged tail), as of the last record before the damage, in the
spirit of ``pg_resetwal``: explicitly, loudly, and saying what is lost. This is recovery
mode point-in-time (``kvj recover --recovery-mode point-in-time``).

Replay refuses damage anywhere but the tail, because records after it cannot be trusted
to follow from what came before. ``find_damage`` walks the whole log past the damage (the
one walker, with a reporter that notes each damage and goes on) and folds two states: what
precedes the first damage (what salvage keeps) and every intact record (what the journal
held as far as can be read). The difference says exactly which LSNs, requests, tokens and
training steps are lost, beside the bytes of the damaged groups themselves, whose content
is unknown. ``set_aside`` then moves the damage and everything after it into ``torn/``
(the rest of the damaged file, cut as a torn tail is; every later log file whole), so that
the journal ends cleanly at the last record kept and the next record continues from it.
Nothing is deleted.

The report (``kvj.ops.salvage_report``) is kept in ``SALVAGE.json`` until the recovery-epoch
record carrying it is durable, so that an interrupted salvage is still reported.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from kvj.errors import CorruptionError
from kvj.fileio import FS, REAL_FS, list_dir, makedirs_durable, rename_durable
from kvj.journal.framing import FORMAT_VERSION, GROUP_HEADERS, RECORD_HEADER_SIZE
from kvj.journal.mirror import mirror_of
from kvj.journal.reader import (CORRUPTION, COVERED_GAP, LSN_ORDER, TORN, Damage, Record, Scan, TornTail, decode,
                                read_header)
from kvj.journal.recovery import TORN_DIR, keep_torn_bytes, truncate_log
from kvj.journal.snapshot import load_latest
from kvj.journal.state import JournalState
from kvj.ops.salvage_report import Salvage, save_pending, union


def _copy(state: JournalState) -> JournalState:
    copy = JournalState.from_dict(state.to_dict())
    copy.snapshot_lsn = state.snapshot_lsn
    return copy


def find_damage(path: str) -> Optional[Salvage]:
    """Walk the log past any damage; None when there is none but a torn tail (recovery's own
    business), else what salvaging it would keep and lose.

    Records are kept a whole commit group at a time, so the journal is cut at a group's
    start, never inside one.
    """
    base = load_latest(path) or JournalState()
    damages: List[Damage] = []
    kept, full = _copy(base), _copy(base)
    pending: List[Record] = []  # the current group's records, kept once the group is known whole

    def keep_pending() -> None:
        if not damages:
            for rec in pending:
                kept.apply(rec.rtype, rec.payload, rec.lsn)
        pending.clear()

    def note(damage: Damage) -> None:
        if damage.kind in (TORN, COVERED_GAP):
            return
        keep_pending()  # the group before the damage ended whole
        if damage.kind == LSN_ORDER:  # reported at its first record: cut at the group's header
            damage = Damage(damage.kind, damage.path, (damage.offset or 0) - _group_header_size(damage.path),
                            damage.reason)
        damages.append(damage)

    lost_to: Optional[int] = None
    group_end: Optional[Tuple[str, int]] = None
    group_start = 0
    for raw in Scan(path, after_lsn=base.snapshot_lsn, reporter=note):
        if (raw.path, raw.offset) != group_end:  # the first record of a new group
            keep_pending()
            group_start = raw.offset - _group_header_size(raw.path)
        group_end = (raw.path, raw.offset + RECORD_HEADER_SIZE + len(raw.payload))
        try:
            rec = decode(raw)
        except CorruptionError as exc:  # framed well, but its payload is no record: the group goes
            if not damages:
                pending.clear()
                damages.append(Damage(CORRUPTION, raw.path, group_start, exc.reason))
            continue
        if damages:
            lost_to = rec.lsn
        else:
            pending.append(rec)
        full.apply(rec.rtype, rec.payload, rec.lsn)
    keep_pending()
    if not damages:
        return None
    first = damages[0]
    logs = [os.path.basename(p) for p in Scan(path, reporter=lambda _d: None).logs]  # a mirror's too
    name = os.path.basename(first.path)
    later = [os.path.join(path, n) for n in logs[logs.index(name) + 1:]] if name in logs else []
    requests, tokens = _lost_requests(kept, full)
    return Salvage(damage=[{"kind": d.kind, "path": d.path, "offset": d.offset, "reason": d.reason,
                            "records": d.records} for d in damages],
                   kept_lsn=kept.last_lsn, lost_to=lost_to, cut_file=first.path, cut_offset=first.offset or 0,
                   later_files=later, requests=requests, training=_lost_training(kept, full), tokens_lost=tokens,
                   kept_state=kept)


def _group_header_size(path: str) -> int:
    header = read_header(path)
    return GROUP_HEADERS[header.version].size if header is not None else GROUP_HEADERS[FORMAT_VERSION].size


def _lost_requests(kept: JournalState, full: JournalState) -> Tuple[List[Dict[str, Any]], int]:
    """Each request whose state the records after the damage would have changed."""
    out: List[Dict[str, Any]] = []
    total = 0
    for rid in sorted(set(kept.requests) | set(full.requests)):
        before, after = kept.requests.get(rid), full.requests.get(rid)
        if after is None:  # pragma: no cover - full folds every record kept folds
            continue
        resume_after = 0 if after.ended else after.resume_position
        if before is None:
            what = ("started and ended after the damage: nothing to resume" if after.ended else
                    f"started after the damage: not recovered ({resume_after} tokens lost)")
            lost = resume_after
        elif before.start_lsn != after.start_lsn:
            what, lost = "started again after the damage: its later incarnation is not recovered", resume_after
        elif before.ended == after.ended and before.resume_position == after.resume_position:
            continue
        elif not before.ended and after.ended:
            what, lost = "ended after the damage: recovery resumes it", 0
        else:
            lost = max(0, resume_after - before.resume_position)
            what = (f"resumes at token {before.resume_position} instead of {resume_after}" if lost
                    else "records after the damage changed it")
        total += lost
        out.append({"id": rid, "kept_tokens": 0 if before is None or before.ended else before.resume_position,
                    "tokens_after_damage": resume_after, "tokens_lost": lost, "what": what})
    return out, total


def _lost_training(kept: JournalState, full: JournalState) -> Optional[Dict[str, Any]]:
    if kept.training_step() == full.training_step():
        return None
    return {"kept_step": kept.training_step(), "step_after_damage": full.training_step()}


def set_aside(journal: str, salvage: Salvage, fs: FS = REAL_FS, report: Optional[Salvage] = None) -> None:
    """Move the damage ``salvage`` found and everything after it into ``torn/``, durably, in
    the journal and in its mirror (the same names and offsets: the damage is in both, or a
    reader would have taken the other copy's groups).

    The steps that need free space, the copies of the damaged file's rest and the pending
    ``report`` (default: ``salvage``; it gains where every file goes), come first, so that
    on a full disk the journal is left as it was; then the later files move newest first
    and the damaged file is cut last: a crash midway leaves a journal that still ends in
    damage (salvage again) or ends cleanly, and the pending report either way."""
    report = salvage if report is None else report
    mirror = mirror_of(journal)
    copies = [journal] + ([mirror] if mirror else [])
    names = [os.path.basename(p) for p in reversed(salvage.later_files)]
    if salvage.cut_offset == 0:
        names.append(os.path.basename(salvage.cut_file))
    tails: List[Tuple[TornTail, str]] = []
    before = {os.path.join(copy, TORN_DIR): set(list_dir(os.path.join(copy, TORN_DIR))) for copy in copies}
    try:
        for copy in copies:
            makedirs_durable(os.path.join(copy, TORN_DIR), fs)
            cut = os.path.join(copy, os.path.basename(salvage.cut_file))
            size = os.path.getsize(cut) if os.path.lexists(cut) else 0
            if 0 < salvage.cut_offset < size:
                tail = TornTail(cut, salvage.cut_offset, size - salvage.cut_offset)
                tails.append((tail, keep_torn_bytes(tail, fs)))
        moves = [m for copy in copies
                 for m in _targets(copy, [os.path.join(copy, n) for n in names if os.path.lexists(os.path.join(copy, n))])]
        planned = [kept for _tail, kept in tails] + [target for _path, target in reversed(moves)]
        report.set_aside_to = union(report.set_aside_to, planned)
        save_pending(journal, report, fs)
    except BaseException:
        for tail, kept in tails:  # nothing moved or cut yet: leave the journal as it was
            if os.path.basename(kept) not in before[os.path.dirname(kept)]:  # made by this attempt
                try:
                    fs.unlink(kept)
                except OSError:
                    pass
        raise
    for path, target in moves:
        rename_durable(path, target, fs)
    for tail, _kept in tails:
        truncate_log(tail, fs)


def _targets(journal: str, paths: List[str]) -> List[Tuple[str, str]]:
    """Where each file goes in ``torn/``: its own name, or with ``.N`` added while taken."""
    aside_dir = os.path.join(journal, TORN_DIR)
    taken = set(list_dir(aside_dir))
    out = []
    for path in paths:
        name, n = os.path.basename(path), 1
        while name in taken:
            name, n = f"{os.path.basename(path)}.{n}", n + 1
        taken.add(name)
        out.append((path, os.path.join(aside_dir, name)))
    return out
