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

From the moment it sets anything aside until the recovery-epoch record that carries it is
durable, the salvage's report is kept in the journal's ``SALVAGE.json``: a recovery
interrupted in between (a crash, a full disk while writing the manifest) would otherwise
leave a journal that ends cleanly and a retry that says nothing was lost. The next recovery
reports the pending salvage, in point-in-time mode or not, and removes the file once
its own epoch record is durable.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Dict, List, Optional, Set, Tuple

from kvj.errors import CorruptionError, FormatError
from kvj.fileio import FS, REAL_FS, atomic_write, list_dir, makedirs_durable, rename_durable
from kvj.journal.recovery import MAX_MANIFEST_BYTES, PENDING_NAME, TORN_DIR, keep_torn_bytes, truncate_log
from kvj.journal.framing import FORMAT_VERSION, GROUP_HEADERS, RECORD_HEADER_SIZE
from kvj.journal.mirror import mirror_of
from kvj.journal.reader import (
    COPY,
    CORRUPTION,
    COVERED_GAP,
    DAMAGED_TAIL,
    FORMAT,
    LOG_RE,
    LSN_GAP,
    LSN_ORDER,
    TORN,
    Damage,
    Record,
    Scan,
    TornTail,
    decode,
    list_logs,
    log_end,
    log_seq,
    read_header,
)
from kvj.journal.snapshot import list_snapshots, load_latest
from kvj.journal.state import JournalState
from kvj.untrusted import MAX_INT, printable, read_json


@dataclass
class Salvage:
    """What salvaging a damaged journal keeps, loses and sets aside."""

    #: every damage found: kind, path, offset, reason, records (what a damaged tail's group declares)
    damage: List[Dict[str, Any]]
    kept_lsn: int  #: the last LSN kept (recovery is as of it)
    lost_to: Optional[int]  #: the last LSN read after the damage (None: nothing intact after it)
    cut_file: str  #: the log file the journal is cut in
    cut_offset: int  #: where (0: the whole file goes)
    later_files: List[str]  #: log files after it, set aside whole
    requests: List[Dict[str, Any]]  #: per request the damage changed: what is lost
    training: Optional[Dict[str, Any]]  #: the training step kept and the one lost, if they differ
    tokens_lost: int = 0  #: tokens of intact records after the damage that recovery loses
    set_aside_to: List[str] = field(default_factory=list)  #: where the bytes go in torn/, chosen before any move
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  #: names this salvage in its epoch record
    resumed: bool = False  #: an interrupted salvage's report, completed by a later recovery
    kept_state: Optional[JournalState] = None  #: the state as of ``kept_lsn``

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("kept_state")
        return d

    def epoch_record(self) -> Dict[str, Any]:
        """The decision, small enough for the recovery-epoch record (the manifest has it all)."""
        return {"id": self.id, "kept_lsn": self.kept_lsn, "lost_from": self.kept_lsn + 1, "lost_to": self.lost_to,
                "damage": self.damage[:8], "set_aside": self.set_aside_to[:64],
                "requests_affected": len(self.requests), "tokens_lost": self.tokens_lost}

    def merged(self, later: "Salvage") -> "Salvage":
        """This pending report completed by ``later``, a retry's own walk.

        A retry that cuts where this salvage cut continues it: this report, made before
        anything moved, already says everything that is lost and where each file goes.
        Otherwise the retry found another damage before this one's cut: recovery is as of
        the retry's cut, and each request loses what this report saw it reach (it read the
        log before anything moved) down to where the retry keeps it.
        """
        if (later.cut_file, later.cut_offset) == (self.cut_file, self.cut_offset):
            return replace(self, resumed=True, kept_state=later.kept_state,
                           set_aside_to=_union(self.set_aside_to, later.set_aside_to))
        requests = _combined_requests(self.requests, later)
        seen = {(d["path"], d["offset"]) for d in later.damage}
        lost_to = max((x for x in (self.lost_to, later.lost_to) if x is not None), default=None)
        return replace(later, damage=later.damage + [d for d in self.damage if (d["path"], d["offset"]) not in seen],
                       lost_to=lost_to, requests=requests, training=_combined_training(self.training, later),
                       tokens_lost=sum(r["tokens_lost"] for r in requests),
                       set_aside_to=_union(self.set_aside_to, later.set_aside_to), id=self.id, resumed=True)


def _combined_requests(first: List[Dict[str, Any]], later: Salvage) -> List[Dict[str, Any]]:
    """Per request, the loss of two damages: from the position ``first`` saw it reach to the
    one ``later`` keeps."""
    assert later.kept_state is not None
    reached = {r["id"]: r for r in first}
    out: List[Dict[str, Any]] = []
    for r in later.requests + [r for r in first if r["id"] not in {x["id"] for x in later.requests}]:
        earlier = reached.get(r["id"])
        if earlier is None:
            out.append(r)
            continue
        req = later.kept_state.requests.get(r["id"])
        kept = 0 if req is None or req.ended else req.resume_position
        after = earlier["tokens_after_damage"]
        lost = max(0, after - kept)
        what = (f"resumes at token {kept} instead of {after}" if req is not None and not req.ended and lost
                else r["what"] if r is not earlier else earlier["what"])
        out.append({**r, "kept_tokens": kept, "tokens_after_damage": after, "tokens_lost": lost, "what": what})
    return out


def _combined_training(first: Optional[Dict[str, Any]], later: Salvage) -> Optional[Dict[str, Any]]:
    """The training step ``first`` saw the log reach, and the one ``later`` keeps."""
    if first is None:
        return later.training
    assert later.kept_state is not None
    kept = later.kept_state.training_step()
    return None if kept == first["step_after_damage"] else {"kept_step": kept, "step_after_damage": first["step_after_damage"]}


def _union(first: List[str], second: List[str]) -> List[str]:
    return first + [p for p in second if p not in first]


def pending_path(journal: str) -> str:
    return os.path.join(journal, PENDING_NAME)


def load_pending(journal: str) -> Optional[Salvage]:
    """The report of a salvage that set files aside but whose epoch record was never written.

    It is read by ``read_json`` (a symlink, FIFO or device is ``UnsafePath``; its size is
    bounded before reading) and checked whole before anything it says is used: its fields and
    numbers as ``find_damage`` and ``set_aside`` make them, every log file it names in this
    journal (or its mirror), every file it set aside in their ``torn/``, its LSNs within what
    the journal holds. Anything else is ``CorruptionError``: the file is written atomically,
    so it was damaged or put there, and nothing in it is trusted, reported or recorded."""
    path = pending_path(journal)
    try:
        d = read_json(path, max_bytes=MAX_MANIFEST_BYTES)
        _check_report(d)
        _check_against(journal, d)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except FormatError as exc:  # written atomically: anything else is damage, not a torn write
        raise CorruptionError(path, None, f"not a pending salvage report ({exc}); it says what an interrupted "
                                          "kvj recover --recovery-mode point-in-time set aside and lost: keep it for the record, "
                                          "then move it away to recover") from None
    return Salvage(**{**d, "resumed": True})


#: The keys of each entry of a report's lists (and of its training map), as ``find_damage`` makes them.
_ENTRY_KEYS = {"damage": {"kind", "path", "offset", "reason"},
               "requests": {"id", "kept_tokens", "tokens_after_damage", "tokens_lost", "what"}}
#: The damage a salvage cuts at (a torn tail and a gap a snapshot covers are none).
_DAMAGE_KINDS = {CORRUPTION, LSN_GAP, LSN_ORDER, FORMAT, COPY, DAMAGED_TAIL}
#: What ``set_aside`` names a file in ``torn/``: a log file moved whole, or a cut's bytes
#: (``keep_torn_bytes``), with ``.N`` added while the name is taken.
_ASIDE_RE = re.compile(r"^\d{16}\.log(\.\d+\.torn)?(\.\d+)?$")
_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def _count(value: Any) -> bool:
    """Whether ``value`` is an integer kvj writes as an LSN, offset or count (not a bool)."""
    return type(value) is int and 0 <= value <= MAX_INT


def _check_report(d: Any) -> None:
    """Raise FormatError unless ``d`` has the fields, types and numbers ``find_damage`` gives a report."""
    names = {f.name for f in fields(Salvage)} - {"kept_state"}
    if not isinstance(d, dict) or set(d) != names:
        raise FormatError(f"fields {sorted(d) if isinstance(d, dict) else type(d).__name__}")
    for name, keys in _ENTRY_KEYS.items():
        if not isinstance(d[name], list) or not all(isinstance(e, dict) and keys <= set(e) for e in d[name]):
            raise FormatError(f"{name} entries lack {sorted(keys)}")
    if d["training"] is not None and not (isinstance(d["training"], dict)
                                          and {"kept_step", "step_after_damage"} <= set(d["training"])):
        raise FormatError("training lacks kept_step, step_after_damage")
    if not all(isinstance(d[k], list) and all(isinstance(p, str) for p in d[k]) for k in ("later_files", "set_aside_to")):
        raise FormatError("later_files and set_aside_to must be lists of paths")
    if not (isinstance(d["id"], str) and _ID_RE.match(d["id"]) and isinstance(d["resumed"], bool)
            and isinstance(d["cut_file"], str)):
        raise FormatError("id, resumed or cut_file is not what a salvage writes")
    if not (_count(d["kept_lsn"]) and _count(d["cut_offset"]) and _count(d["tokens_lost"])
            and (d["lost_to"] is None or _count(d["lost_to"]) and d["lost_to"] > d["kept_lsn"])):
        raise FormatError("kept_lsn, lost_to, cut_offset and tokens_lost must be counts, lost_to after kept_lsn")
    if not all(isinstance(e["kind"], str) and e["kind"] in _DAMAGE_KINDS and isinstance(e["path"], str)
               and isinstance(e["reason"], str) and (e["offset"] is None or _count(e["offset"])) for e in d["damage"]):
        raise FormatError("a damage entry is not one a log walk reports")
    if not d["damage"] or (d["damage"][0]["path"], d["damage"][0]["offset"] or 0) != (d["cut_file"], d["cut_offset"]):
        raise FormatError("the journal is not cut where its first damage is")
    if not all(isinstance(r["id"], str) and isinstance(r["what"], str)
               and all(_count(r[k]) for k in ("kept_tokens", "tokens_after_damage", "tokens_lost"))
               for r in d["requests"]) or sum(r["tokens_lost"] for r in d["requests"]) != d["tokens_lost"]:
        raise FormatError("requests' tokens are not counts that add up to tokens_lost")
    if d["training"] is not None and not all(v is None or _count(v) for v in (d["training"]["kept_step"],
                                                                             d["training"]["step_after_damage"])):
        raise FormatError("training steps must be counts")


def _check_against(journal: str, d: Dict[str, Any]) -> None:
    """Raise FormatError unless the report is this journal's: the log files it names are in the
    journal (or its mirror), what it set aside is in their own ``torn/`` (no other directory, no
    ``..``, no symlink), and its LSNs are within the log as it is."""
    copies = [journal] + [m for m in [mirror_of(journal)] if m]
    homes = {os.path.realpath(c) for c in copies}
    asides = {os.path.join(h, TORN_DIR) for h in homes}
    for c in copies:
        if os.path.islink(os.path.join(c, TORN_DIR)):
            raise FormatError(f"{os.path.join(c, TORN_DIR)} is a symbolic link")
    logs = [d["cut_file"], *d["later_files"], *(e["path"] for e in d["damage"])]
    for p in logs:
        _check_path(p, homes, LOG_RE, "a log file of this journal")
    for p in d["set_aside_to"]:
        _check_path(p, asides, _ASIDE_RE, "a file set aside in this journal's torn/")
    cut_seq, kept = log_seq(d["cut_file"]), d["kept_lsn"]
    if any(log_seq(p) <= cut_seq for p in d["later_files"]):
        raise FormatError("a later file is not after the file the journal is cut in")
    if os.path.lexists(d["cut_file"]) and os.lstat(d["cut_file"]).st_size < d["cut_offset"]:
        raise FormatError(f"{d['cut_file']} is shorter than the offset the journal is cut at")
    for p in list_logs(journal):
        header = read_header(p) if log_seq(p) < cut_seq else None
        if header is not None and header.base_lsn > kept + 1:
            raise FormatError(f"{p}, before the cut, begins at LSN {header.base_lsn}, after LSN {kept} kept")
    snaps = list_snapshots(journal)
    end = log_end(journal, snaps[0][0] if snaps else 0).lsn
    if kept > end:
        raise FormatError(f"LSN {kept} kept is past the end of the log (LSN {end})")


def _check_path(path: str, directories: Set[str], name: "re.Pattern[str]", what: str) -> None:
    """Raise FormatError unless ``path`` is absolute, plain (no ``..``), directly in one of
    ``directories`` (resolved: a symlinked directory leads elsewhere), named as ``name`` says,
    and no symlink itself."""
    if not (os.path.isabs(path) and "\0" not in path and os.path.normpath(path) == path
            and name.match(os.path.basename(path)) and os.path.realpath(os.path.dirname(path)) in directories
            and not os.path.islink(path)):
        raise FormatError(f"{printable(path)} is not {what}")


def save_pending(journal: str, salvage: Salvage, fs: FS = REAL_FS) -> None:
    atomic_write(pending_path(journal), (json.dumps(salvage.to_dict(), indent=1, sort_keys=True) + "\n").encode(), fs)


def clear_pending(journal: str, fs: FS = REAL_FS) -> None:
    """Remove the pending report, durably, once an epoch record carrying it is durable."""
    try:
        fs.unlink(pending_path(journal))
    except FileNotFoundError:
        return
    fs.fsync_dir(journal)


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
        report.set_aside_to = _union(report.set_aside_to, planned)
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
