"""``/dev/shm`` left behind by a killed server: recorded in a ledger, removed by the next start.

vLLM's engine processes share memory through files in ``/dev/shm`` (``psm_*`` ring buffers,
``sem.mp-*`` semaphores) that a graceful exit removes and ``kill -9`` leaves: they leak tmpfs
until a small ``/dev/shm`` refuses the next engine. Once the engine is up, ``record`` writes the
names this server's processes map into ``JOURNAL/replies/shm.json`` with the boot id and the
server's pid and start time. At the next start ``cleanup`` removes those names, and only those,
when that server is gone (another boot, or its pid no longer that process) and no live
process maps or holds them. Names kvj did not record are never touched.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List, Optional, Set

from kvj.errors import FormatError, KvjError
from kvj.fileio import atomic_write, makedirs_durable
from kvj.serve.paths import SHM_LEDGER, replies_dir
from kvj.untrusted import read_json

SHM = "/dev/shm"
#: What a name in the ledger may look like: a plain file name (never a path).
NAME = re.compile(r"[A-Za-z0-9_.:+=-]{1,200}")


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _stat(pid: int, field: int) -> Optional[int]:
    """Field ``field`` (counted from the state, after the command's closing parenthesis) of a
    process's ``/proc/PID/stat``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[field])
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> Optional[int]:
    """A process's start time in clock ticks since boot (field 22 of its stat); None if it is gone."""
    return _stat(pid, 19)


def _pids() -> List[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _parent(pid: int) -> Optional[int]:
    return _stat(pid, 1)


def descendants(pid: int) -> Set[int]:
    """``pid`` and every process below it."""
    children: Dict[int, List[int]] = {}
    for p in _pids():
        parent = _parent(p)
        if parent is not None:
            children.setdefault(parent, []).append(p)
    found, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def mapped(pids: Iterable[int]) -> Set[str]:
    """Names in ``/dev/shm`` that these processes map or hold open."""
    names: Set[str] = set()
    prefix = SHM + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        names.add(line[at + len(prefix):].strip().removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix):].removesuffix(" (deleted)"))
    return {n for n in names if NAME.fullmatch(n)}


def ledger_path(journal: str) -> str:
    """``JOURNAL/replies/shm.json``."""
    return os.path.join(replies_dir(journal), SHM_LEDGER)


def _read(path: str) -> Optional[Dict]:
    """The ledger, or None when there is none or kvj cannot read it (it names nothing then)."""
    if not os.path.exists(path):
        return None
    try:
        doc = read_json(path, max_bytes=1 << 20)
        return {"names": [str(n) for n in doc["names"]], "pid": int(doc["pid"]), "start_time": doc.get("start_time"),
                "boot_id": str(doc["boot_id"])}
    except (KvjError, FormatError, KeyError, TypeError, ValueError):
        return None


def record(journal: str) -> List[str]:
    """Write the ledger: the names this server and its engine processes map now, with those it
    recorded before (engine processes make some only once they serve)."""
    me = os.getpid()
    doc = {"boot_id": boot_id(), "pid": me, "start_time": start_time(me), "names": []}
    before = _read(ledger_path(journal))
    known = set(before["names"]) if before is not None and all(before[k] == doc[k] for k in
                                                                ("boot_id", "pid", "start_time")) else set()
    names = sorted(known | mapped(descendants(me)))
    if before is not None and names == sorted(known):
        return names
    doc["names"] = names
    makedirs_durable(replies_dir(journal))
    atomic_write(ledger_path(journal), json.dumps(doc).encode())
    return names


def cleanup(journal: str) -> List[str]:
    """Remove what a killed server's ledger names and nothing alive uses; the names removed."""
    doc = _read(ledger_path(journal))
    if doc is None:
        return []
    names, owner, started, boot = doc["names"], doc["pid"], doc["start_time"], doc["boot_id"]
    if boot == boot_id() and start_time(owner) == started and started is not None:
        return []  # that server still runs
    candidates = [n for n in names if NAME.fullmatch(n) and os.path.lexists(os.path.join(SHM, n))]
    if not candidates:
        return []
    in_use = mapped(_pids())
    removed = []
    for name in candidates:
        if name in in_use:
            continue
        try:
            os.unlink(os.path.join(SHM, name))
            removed.append(name)
        except OSError:
            pass
    return removed
