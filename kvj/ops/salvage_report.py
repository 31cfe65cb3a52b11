"""The salvage report: what salvaging a damaged journal keeps, loses and sets aside. It is kept
in the journal's ``SALVAGE.json`` from the first file set aside until the recovery-epoch record
that carries it is durable, so that an interrupted salvage is reported by the next recovery;
read back, it is untrusted input, checked whole against the journal before any of it is used."""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Dict, List, Optional, Set

from kvj.errors import CorruptionError, FormatError
from kvj.fileio import FS, REAL_FS, atomic_write
from kvj.journal.mirror import mirror_of
from kvj.journal.reader import (COPY, CORRUPTION, DAMAGED_TAIL, FORMAT, LOG_RE, LSN_GAP, LSN_ORDER, list_logs, log_end,
                                log_seq, read_header)
from kvj.journal.recovery import MAX_MANIFEST_BYTES, PENDING_NAME, TORN_DIR
from kvj.journal.snapshot import list_snapshots
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
                           set_aside_to=union(self.set_aside_to, later.set_aside_to))
        requests = _combined_requests(self.requests, later)
        seen = {(d["path"], d["offset"]) for d in later.damage}
        lost_to = max((x for x in (self.lost_to, later.lost_to) if x is not None), default=None)
        return replace(later, damage=later.damage + [d for d in self.damage if (d["path"], d["offset"]) not in seen],
                       lost_to=lost_to, requests=requests, training=_combined_training(self.training, later),
                       tokens_lost=sum(r["tokens_lost"] for r in requests),
                       set_aside_to=union(self.set_aside_to, later.set_aside_to), id=self.id, resumed=True)


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


def union(first: List[str], second: List[str]) -> List[str]:
    """``first`` and then what ``second`` adds to it, in order."""
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
