"""A journal at a glance, as ``systemctl status`` or ``pg_controldata`` give one: is a writer
alive, where the log ends and how long ago it was written, the write rate over the last
minute, what is in flight, sizes, the last recovery and compaction, and what needs a look.

Read-only: the writer lock is probed through a lock file opened read-only, nothing is cut,
nothing is created. The records of the last minute are read from the newest log files only.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, JournalLocked, KvjError, SegmentMissing
from kvj.fileio import list_dir
from kvj.journal.framing import RECORD_HEADER_SIZE, RawRecord
from kvj.journal.recovery import COMPACT_LOCK, LOCK_NAME, PENDING_NAME, RECOVERY_DIR, TORN_DIR, DirLock
from kvj.journal.config import config_max_store_bytes, config_policy
from kvj.journal.mirror import mirror_of, recorded
from kvj.journal.reader import Group, LogEnd, Scan, TornTail, list_logs, log_end, newest_first
from kvj.journal.records import RecordType
from kvj.journal.replay import check_journal, holds_journal, replay
from kvj.journal.snapshot import list_snapshots
from kvj.ops.armed import read_control
from kvj.untrusted import read_json

#: The window the write rates are measured over.
WINDOW = 60.0
_EPOCH = int(RecordType.EPOCH)


def _holder(directory: str, name: str, what: str) -> Optional[Dict[str, Any]]:
    """The live holder of a lock ({"pid": ...}), or None when nobody holds it."""
    lock = DirLock(directory, name, what)
    try:
        held = lock.acquire_shared()
    except JournalLocked as exc:
        return {"pid": exc.pid}
    if held is not None:
        held.release()
    return None


def _size(paths: List[str]) -> int:
    total = 0
    for path in paths:
        try:
            total += os.stat(path, follow_symlinks=False).st_size
        except OSError:
            pass
    return total


def _files(directory: str) -> List[str]:
    """The entries of one of kvj's own folders (none when it does not exist; a symlink there
    is refused, as every command refuses it)."""
    return [os.path.join(directory, n) for n in sorted(list_dir(directory))]


def _disk(path: str) -> Dict[str, int]:
    """Free and total bytes of the file system holding ``path``: the first thing to know when
    a write fails with "No space left on device"."""
    st = os.statvfs(path)
    return {"free": st.f_bavail * st.f_frsize, "size": st.f_blocks * st.f_frsize, "device": os.stat(path).st_dev}


def _writer_opened(directory: str) -> Optional[float]:
    """When the journal's newest writer took its lock (the lock file's mtime: it writes its pid
    there), or None."""
    try:
        return os.stat(os.path.join(directory, LOCK_NAME), follow_symlinks=False).st_mtime
    except OSError:
        return None


class _Window:
    """The last commit group seen and the records, bytes and commit groups written in the last
    ``WINDOW`` seconds, fed the groups of a walk. Keyed by LSN, so a group seen again (a replay
    pass repeated after a concurrent compaction) is counted once.

    The commit lag is the longest interval between consecutive groups of one writer in the
    window: a record appended right after the first of two waited at most that long to be
    written. An interval across a change of writer is no wait and is left out: the one
    around a recovery's epoch group (a writer of its own, which a dead writer's last group
    precedes and the next writer's first group follows) and the one in which the newest
    writer opened the journal (``opened``, its lock file's mtime)."""

    def __init__(self, now: float, opened: Optional[float]):
        self.since, self.opened = now - WINDOW, opened
        self.last: Optional[RawRecord] = None  #: the last record of the group with the highest LSNs
        self._groups: Dict[int, Tuple[float, int, int, bool]] = {}  # first LSN -> time, records, bytes, epoch

    def __call__(self, group: Group) -> None:
        records = group.records
        last = records[-1]
        if self.last is None or last.lsn > self.last.lsn:
            self.last = last
        when = last.time  # every record of a group carries the group's time
        if when is None or when < self.since:
            return
        self._groups[records[0].lsn] = (when, len(records), sum(RECORD_HEADER_SIZE + len(raw.payload) for raw in records),
                                        any(raw.rtype == _EPOCH for raw in records))

    def end(self, tail: Optional[TornTail], snapshot_lsn: int) -> LogEnd:
        """Where the log ends: the last group seen (the snapshot's LSN when there was none)."""
        if self.last is None:
            return LogEnd(snapshot_lsn, None, None, tail)
        return LogEnd(self.last.lsn, self.last.time, self.last.path, tail)

    def minute(self) -> Dict[str, Any]:
        records = sum(g[1] for g in self._groups.values())
        nbytes = sum(g[2] for g in self._groups.values())
        groups = sorted(self._groups.values())
        gaps = [b[0] - a[0] for a, b in zip(groups, groups[1:])
                if not (a[3] or b[3] or (self.opened is not None and a[0] < self.opened <= b[0]))]
        return {"seconds": WINDOW, "records": records, "bytes": nbytes,
                "records_per_s": records / WINDOW, "bytes_per_s": nbytes / WINDOW,
                "groups": len(groups), "records_per_group": records / len(groups) if groups else None,
                "commit_lag": max(gaps) if gaps else None}


def _newest(directory: str, logs: List[str], now: float, snapshot_lsn: int) -> Tuple[LogEnd, Dict[str, Any]]:
    """Where the log ends and the last minute's writes (``_Window``) from the newest log files
    back, each group read once, past any damage: what status shows of a journal replay refuses."""
    window = _Window(now, _writer_opened(directory))
    tail: Optional[TornTail] = None
    for path, header, newest in newest_first(logs):
        seen_old = False
        scan = Scan(directory, after_lsn=header.base_lsn - 1, logs=[path], reporter=lambda _d: None)
        for group in scan.groups():
            window(group)
            when = group.records[-1].time
            seen_old = seen_old or when is None or when < window.since
        if newest:
            tail = scan.tail
        if seen_old and window.last is not None:  # this file reaches back past the window: older files cannot add to it
            break
    return window.end(tail, snapshot_lsn), window.minute()


def status(journal: str, store_root: Optional[str], now: Optional[float] = None) -> Dict[str, Any]:
    """What ``kvj status`` shows, as plain data."""
    now = time.time() if now is None else now
    journal = os.path.abspath(journal)
    check_journal(journal)  # a seed-era journal: LegacyJournal
    logs = list_logs(journal)
    snaps = list_snapshots(journal)
    snapshot_lsn = snaps[0][0] if snaps else 0
    out: Dict[str, Any] = {
        "journal": journal, "now": now,
        "writer": _holder(journal, LOCK_NAME, "writer"), "compactor": _holder(journal, COMPACT_LOCK, "compactor"),
        "logs": len(logs), "log_bytes": _size(logs), "snapshots": len(snaps), "snapshot_bytes": _size([p for _l, p in snaps]),
        "last_compaction": ({"snapshot_lsn": snaps[0][0], "time": os.stat(snaps[0][1]).st_mtime} if snaps else None),
        "set_aside": {folder: _size(_files(os.path.join(journal, folder))) for folder in (TORN_DIR, RECOVERY_DIR)},
        "disk": _disk(journal),
        "mirror": _mirror(journal, snapshot_lsn),
        "salvage_pending": os.path.lexists(os.path.join(journal, PENDING_NAME)),
        "config_error": _config_error(journal),
        **_handoff(journal),
        **_connector(journal),
    }
    window = _Window(now, _writer_opened(journal))
    try:
        state = replay(journal, on_group=window)  # one walk: the fold, where the log ends, the last minute
    except (CorruptionError, FormatError) as exc:
        end, last_minute = _newest(journal, logs, now, snapshot_lsn)
        out.update(damage=str(exc), in_flight=None, ended=None, warnings=None, last_epoch=None, needed_segments=None)
    else:
        end = window.end(TornTail(**state.tail) if state.tail else None, state.snapshot_lsn)
        last_minute = window.minute()
        out.update(damage=None, tail=state.tail, in_flight=len(state.in_flight()),
                   ended=len(state.ended()) + state.ended_compacted, warnings=len(state.warnings),
                   last_epoch=state.epochs[-1] if state.epochs else None,
                   needed_segments=len(state.referenced_keys()),
                   training_step=state.training_step(), moved=len(state.moved()))
    out.update(last_lsn=end.lsn, last_write=end.time, last_write_age=(now - end.time) if end.time else None,
               incomplete_tail=end.tail.length if end.tail else 0, last_minute=last_minute)
    out["store"] = _store(store_root)
    out["store"]["max_store_bytes"] = _budget(journal)
    out["replies"] = replies_status(journal, now)
    return out


def replies_status(journal: str, now: float) -> Optional[Dict[str, Any]]:
    """kvj serve's reply journal (``JOURNAL/replies/``): its writer, the replies running and held
    (their bytes as the server's budget counts them: 4 a token and the body), the oldest held.
    None where there is no reply journal."""
    from kvj.serve.paths import replies_dir

    path = replies_dir(journal)
    if not os.path.isdir(path) or not holds_journal(path):
        return None
    info: Dict[str, Any] = {"path": path, "writer": _holder(path, LOCK_NAME, "writer"), "damage": None}
    try:
        state = replay(path)
    except (CorruptionError, FormatError) as exc:
        return {**info, "damage": str(exc)}
    held = [r for r in state.in_flight() if r.reply is not None]
    info.update(running=len(state.in_flight()) - len(held), held=len(held),
                held_bytes=sum(4 * len(r.output) + len(str((r.meta or {}).get("body"))) for r in held),
                oldest_held_age=(now - min(r.reply["at"] for r in held)) if held else None,
                ended=len(state.ended()) + state.ended_compacted)
    return info


def _budget(journal: str) -> Optional[int]:
    """The store's byte budget kvj.conf records (None: none, or a kvj.conf that cannot be read,
    which ``config_error`` reports)."""
    try:
        return config_max_store_bytes(journal)
    except FormatError:
        return None


def _handoff(journal: str) -> Dict[str, Any]:
    """The handoff control record, and why it cannot be read (a planted or damaged file)."""
    try:
        return {"handoff": read_control(journal), "handoff_error": None}
    except (OSError, KvjError) as exc:
        return {"handoff": None, "handoff_error": str(exc)}


#: The vLLM connector's counters, written by its worker (kvj.integrations.vllm.worker writes it).
CONNECTOR_STATS = "connector.json"
MAX_CONNECTOR_STATS = 64 << 10


def _connector(journal: str) -> Dict[str, Any]:
    """The counters a vLLM connector's worker last wrote into the journal (every few seconds
    and at close): steps, blocks journaled and not journaled because kvj was behind... None
    when no connector ever wrote there; a file that is not one is reported, not trusted."""
    try:
        doc = read_json(os.path.join(journal, CONNECTOR_STATS), max_bytes=MAX_CONNECTOR_STATS)
    except (FileNotFoundError, NotADirectoryError):
        return {"connector": None, "connector_error": None}
    except (OSError, KvjError) as exc:
        return {"connector": None, "connector_error": str(exc)}
    fields = ("time", "steps", "blocks_saved", "blocks_referenced", "blocks_skipped", "steps_skipping",
              "blocks_loaded", "blocks_failed")
    if not isinstance(doc, dict) or any(not isinstance(doc.get(f), (int, float)) or isinstance(doc.get(f), bool)
                                        for f in fields):
        return {"connector": None, "connector_error": f"{CONNECTOR_STATS} is not a connector's counters"}
    return {"connector": {f: doc[f] for f in fields}, "connector_error": None}


def _config_error(journal: str) -> Optional[str]:
    """Why the journal's kvj.conf cannot be used, or None (none, or a valid one)."""
    try:
        config_policy(journal)
    except FormatError as exc:
        return str(exc)
    return None


def _mirror(journal: str, snapshot_lsn: int) -> Optional[Dict[str, Any]]:
    """The journal's mirror, if it names one: where it is, whether the two name each other,
    and how far each copy's own log reaches (a copy behind the other lacks groups that only
    the other holds: a writer that stopped between the two writes, or ran degraded; the next
    writer to open the journal evens them out)."""
    named = recorded(journal)
    if named is None:
        return None
    linked = mirror_of(journal)
    out: Dict[str, Any] = {"path": linked or named, "linked": linked is not None, "journal_lsn": None,
                           "mirror_lsn": None, "disk": None, "error": None}
    if linked is None:
        return out
    try:  # an unreadable copy is what status must show, not what stops it
        out["journal_lsn"] = log_end(journal, snapshot_lsn, mirror=False).lsn
        out["mirror_lsn"] = log_end(linked, snapshot_lsn, mirror=False).lsn
        out["disk"] = _disk(linked)
    except (OSError, KvjError) as exc:
        out["error"] = str(exc)
    return out


def _store(root: Optional[str]) -> Dict[str, Any]:
    """Segments and bytes in the store, how many are quarantined, and the loads its use log
    counted: ``served`` of ``asked`` (gets and verifies by stores that count loads, a serving
    engine's, since the store was made; ``hit_rate`` their ratio, None before any)."""
    from kvj.segments.check import opened_store

    with opened_store(root, root or "") as store:
        if store is None:
            return {"path": root, "exists": False, "segments": 0, "bytes": 0, "quarantined": 0, "quarantined_bytes": 0,
                    "loads": None}
        sizes = []
        for key in store.keys():
            try:
                sizes.append(store.stat(key).size)
            except SegmentMissing:  # collected while we listed: not counted
                continue
        quarantined = store.quarantined_copies()
        uses = store.backend.uses.read()
        loads = {"served": uses.served, "asked": uses.asked, "hit_rate": uses.hit_rate()}
        return {"path": root, "exists": True, "segments": len(sizes), "bytes": sum(sizes),
                "quarantined": len(quarantined), "quarantined_bytes": _size(quarantined), "disk": _disk(root),
                "loads": loads}


def engine_status(path: str, ranks: List[Tuple[str, Optional[str], Optional[str]]],
                  now: Optional[float] = None) -> Dict[str, Any]:
    """What ``kvj status`` shows of a tensor/pipeline-parallel engine's directory (``kvj.journal.ranks``):
    ``ranks``, each rank's ``status`` (``rank`` names it; ``missing`` when that rank has no journal),
    from (rank name, its journal or None, its store root), and ``totals``, the engine as a whole."""
    now = time.time() if now is None else now
    path = os.path.abspath(path)
    shown: List[Dict[str, Any]] = []
    for name, journal, store_root in ranks:
        if journal is None:
            shown.append({"rank": name, "journal": os.path.join(path, name), "missing": True})
        else:
            shown.append({"rank": name, "missing": False, **status(journal, store_root, now)})
    return {"journal": path, "now": now, "ranks": shown, "totals": _totals(path, shown),
            "replies": replies_status(path, now)}


def _totals(path: str, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """An engine's totals over its ranks' statuses: how many journals and live writers, the newest
    write, the last minute's writes, sizes, and which ranks are damaged or need a look."""
    present = [r for r in ranks if not r["missing"]]
    writes = [r["last_write"] for r in present if r["last_write"] is not None]
    minute = {key: sum(r["last_minute"][key] for r in present) for key in ("records", "bytes")}
    return {
        "ranks": len(ranks), "journals": len(present), "missing": [r["rank"] for r in ranks if r["missing"]],
        "writers": sum(1 for r in present if r["writer"]),
        "last_write": max(writes, default=None),
        "last_minute": {**minute, "records_per_s": minute["records"] / WINDOW, "bytes_per_s": minute["bytes"] / WINDOW},
        "log_bytes": sum(r["log_bytes"] for r in present), "snapshot_bytes": sum(r["snapshot_bytes"] for r in present),
        "segments": sum(r["store"]["segments"] for r in present), "store_bytes": sum(r["store"]["bytes"] for r in present),
        "quarantined": sum(r["store"]["quarantined"] for r in present),
        "recovery_bytes": _size(_files(os.path.join(path, RECOVERY_DIR))),  # the engine's own manifests
        "damaged": [r["rank"] for r in present if r["damage"]],
        "tails": [r["rank"] for r in present if r["incomplete_tail"]],
    }
