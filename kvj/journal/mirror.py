"""A journal's synchronous mirror: a second copy of its log files and snapshots in another
directory, byte for byte the same, ideally on another device (spec: man/kvj-journal.5, MIRROR).

A journal and its mirror name each other in a ``MIRROR`` file; a pointer the other side does not
return is ignored, so a planted ``MIRROR`` file cannot send kvj to write into another directory.
"""

from __future__ import annotations

import logging
import os
import re
from typing import List, Optional

from kvj.errors import InvalidArgument
from kvj.fileio import FS, REAL_FS, atomic_write, makedirs_durable, open_read

MIRROR_NAME = "MIRROR"
#: What the writer does when the mirror fails: fail (the default: the writer enters its failed
#: state) or degrade (log a warning, write the primary copy alone until the next open).
FAIL, DEGRADE = "fail", "degrade"
POLICIES = (FAIL, DEGRADE)

log = logging.getLogger("kvj")

_JOURNAL_FILE = re.compile(r"^(\d{16}\.log|snapshot-\d{16}\.snap)$")


def recorded(directory: str) -> Optional[str]:
    """The path this directory's ``MIRROR`` file names, if it has one."""
    try:
        with open_read(os.path.join(directory, MIRROR_NAME)) as f:
            text = f.read(4097).decode("utf-8", "replace").strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return text or None


def mirror_of(directory: str) -> Optional[str]:
    """The other copy of the journal at ``directory``, if both name each other."""
    directory = os.path.abspath(directory)
    other = recorded(directory)
    if other is None or not os.path.isabs(other) or os.path.abspath(other) == directory:
        return None
    back = recorded(other)
    return other if back is not None and os.path.abspath(back) == directory else None


def copies(path: str, mirror: Optional[str]) -> List[str]:
    """The copies of the journal's file ``path``: itself, and the mirror's file of the same name."""
    return [path] + ([os.path.join(mirror, os.path.basename(path))] if mirror else [])


def check_policy(policy: str) -> str:
    """``policy`` if it is a mirror policy, else ``InvalidArgument``."""
    if policy not in POLICIES:
        raise InvalidArgument(f"mirror policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    return policy


def link(primary: str, mirror: str, fs: FS = REAL_FS) -> None:
    """Make ``mirror`` (created if needed) and ``primary`` name each other, durably: the mirror's
    pointer first, so readers see no mirror until both exist. A directory holding journal files,
    or naming another journal, is refused: its files are not copies of this journal's."""
    if os.path.isdir(mirror) and recorded(mirror) != primary:
        if recorded(mirror) is not None:
            raise InvalidArgument(f"{mirror} is the mirror of {recorded(mirror)}, not of {primary}")
        if any(_JOURNAL_FILE.match(n) for n in os.listdir(mirror)):
            raise InvalidArgument(f"{mirror} holds journal files of its own: a mirror starts empty")
    makedirs_durable(mirror, fs)
    if recorded(mirror) != primary:
        atomic_write(os.path.join(mirror, MIRROR_NAME), f"{primary}\n".encode(), fs)
    if recorded(primary) != mirror:
        atomic_write(os.path.join(primary, MIRROR_NAME), f"{mirror}\n".encode(), fs)


def resolve(primary: str, mirror: Optional[str], policy: str, fs: FS = REAL_FS) -> Optional[str]:
    """The mirror a writer opening ``primary`` uses: ``mirror`` if given (linking it), else the
    one the journal records. A recorded mirror that is gone or does not name this journal back
    is ``InvalidArgument`` under policy fail, a logged warning (no mirror) under degrade."""
    check_policy(policy)
    current = mirror_of(primary)
    if mirror is not None:
        mirror = os.path.abspath(os.fspath(mirror))
        if mirror == primary:
            raise InvalidArgument(f"the mirror of {primary} cannot be the journal itself")
        if current is not None and current != mirror:
            raise InvalidArgument(f"journal {primary} is mirrored to {current}, not {mirror}: pass that mirror, "
                                  f"or remove {os.path.join(primary, MIRROR_NAME)} to mirror it elsewhere")
        link(primary, mirror, fs)
        return mirror
    if current is not None:
        return current
    named = recorded(primary)
    if named is None:
        return None
    message = (f"journal {primary} names {named} as its mirror, which is missing or does not name it back; "
               f"pass mirror={named} to rebuild it, or remove {os.path.join(primary, MIRROR_NAME)}")
    if policy == FAIL:
        raise InvalidArgument(message)
    log.warning("%s; writing the primary copy only (mirror policy degrade)", message)
    return None
