"""Which journal and store directories kvj run as root may work on (as git's ``safe.directory``).

Whoever can write a directory could plant links there to turn a privileged kvj against its
machine, so root refuses one another user owns or a non-root group or everyone may write,
unless ``KVJ_TRUST_OWNER=1``.
"""

from __future__ import annotations

import os
import stat

from kvj.errors import UnsafePath

TRUST_ENV = "KVJ_TRUST_OWNER"


def trusted() -> bool:
    """Whether the user said to trust directories whatever their owner (``KVJ_TRUST_OWNER=1``)."""
    return os.environ.get(TRUST_ENV) == "1"


def check_owner(path: "str | os.PathLike[str]") -> None:
    """As root, ``UnsafePath`` for directory ``path`` when another user owns it or a group other
    than root's or everyone may write it. A path that does not exist yet passes (root makes it)."""
    if os.geteuid() != 0 or trusted():
        return
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != 0):
        who = "everyone" if st.st_mode & stat.S_IWOTH else f"group gid {st.st_gid}"
        raise UnsafePath(f"{path} is writable by {who} and kvj runs as root: refused (chmod go-w {path}, run kvj "
                         f"as the user who writes it, or set {TRUST_ENV}=1 to trust it)")
    if st.st_uid != 0:
        try:
            import pwd

            who = f"uid {st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
        except KeyError:
            who = f"uid {st.st_uid}"
        raise UnsafePath(f"{path} belongs to {who} and kvj runs as root: refused (run kvj as that user, e.g. "
                         f"User= in the unit, or set {TRUST_ENV}=1 to trust it)")
