"""Rank journals: one kvj journal per rank of a tensor/pipeline-parallel engine, under one directory.

Rank (t, p) journals its shard of every block in ``JOURNAL/rank-t-p/``, a complete journal with
its own segment store (the ranks' shards never share bytes, so a shared store would save
nothing). ``JOURNAL/ranks.json`` says which layout the directory serves, so an engine of another
layout is refused before it writes or loads anything. An engine without parallelism journals in
``JOURNAL`` itself.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

from kvj.errors import FormatError
from kvj.fileio import atomic_write, makedirs_durable
from kvj.journal.reader import list_logs
from kvj.journal.snapshot import list_snapshots
from kvj.untrusted import read_json

#: The file that says which parallel layout a directory of rank journals serves.
RANKS_FILE = "ranks.json"
#: A layout is two small numbers; anything far larger is not one.
MAX_RANKS_BYTES = 4096
#: More ranks than any engine has: a layout beyond it is not one (its journals would be listed one by one).
MAX_RANKS = 1 << 16


def rank_name(tp_rank: int, pp_rank: int) -> str:
    """The directory name of rank (``tp_rank``, ``pp_rank``)'s journal."""
    return f"rank-{tp_rank}-{pp_rank}"


def rank_journal(path: str, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int) -> str:
    """Where rank (``tp_rank``, ``pp_rank``) journals: ``path`` itself without parallelism."""
    return path if tp_size * pp_size == 1 else os.path.join(path, rank_name(tp_rank, pp_rank))


def read_sizes(path: str) -> Optional[Tuple[int, int]]:
    """(tp_size, pp_size) that ``path``'s ``ranks.json`` names, or None; a file that is not one is
    ``FormatError`` (``UnsafePath`` for a symlink, FIFO or device)."""
    where = os.path.join(path, RANKS_FILE)
    try:
        sizes = read_json(where, max_bytes=MAX_RANKS_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except FormatError as exc:
        raise FormatError(f"not a rank layout: {exc}") from None
    tp, pp = (sizes.get(k) if isinstance(sizes, dict) else None for k in ("tp_size", "pp_size"))
    if not (type(tp) is int and type(pp) is int and tp >= 1 and pp >= 1 and tp * pp <= MAX_RANKS):
        raise FormatError(f"{where} is not a rank layout: tp_size and pp_size must be positive integers, "
                          f"at most {MAX_RANKS} ranks in all")
    return tp, pp


def holds_ranks(path: str) -> bool:
    """Whether ``path`` is a directory of rank journals (it has a ``ranks.json``)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, RANKS_FILE))


def rank_journals(path: str) -> Dict[Tuple[int, int], str]:
    """(tp rank, pp rank) -> journal of every rank ``path``'s layout has, whether it exists yet or not."""
    sizes = read_sizes(path)
    if sizes is None:
        return {}
    tp, pp = sizes
    return {(t, p): rank_journal(path, t, p, tp, pp) for p in range(pp) for t in range(tp)}


def refusal(path: str, tp_size: int, pp_size: int) -> Optional[str]:
    """Why an engine of ``tp_size`` x ``pp_size`` ranks must not journal in ``path``; None when it may."""
    if not os.path.isdir(path):
        return None
    sizes = read_sizes(path)
    if sizes is not None and sizes != (tp_size, pp_size):
        return (f"{path} holds the rank journals of an engine with tensor/pipeline parallel size {sizes[0]}/{sizes[1]}; "
                f"this engine's is {tp_size}/{pp_size}: none of their blocks would load into it (each shard is "
                "another rank's); give it a journal of its own")
    if sizes is None and tp_size * pp_size > 1 and (list_logs(path) or list_snapshots(path)):
        return (f"{path} is the journal of an engine without tensor/pipeline parallelism; this engine's parallel "
                f"size is {tp_size}/{pp_size}: none of its blocks would load into it; give it a journal of its own")
    return None


def claim(path: str, tp_size: int, pp_size: int) -> None:
    """Record the layout ``path`` serves (before any rank journal exists); any rank may call it."""
    if tp_size * pp_size > 1 and read_sizes(path) is None:
        makedirs_durable(path)
        atomic_write(os.path.join(path, RANKS_FILE),
                     json.dumps({"tp_size": tp_size, "pp_size": pp_size}, sort_keys=True).encode())
