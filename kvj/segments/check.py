"""What is wrong, if anything, with the segments records name: the one check recover, fsck,
handoff and the CLI share (present, intact, of the digest the record claims).

The store (and through it torch) is imported only when a segment is looked at, so journal-only
commands stay fast.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from kvj.errors import CorruptionError, FormatError, SegmentMissing
from kvj.fileio import FS, REAL_FS

#: (kind, reason) of a segment that cannot be used; kind is "segment-missing" or "segment-damaged".
Problem = Tuple[str, str]


@contextmanager
def opened_store(store: Any, default_root: str, fs: FS = REAL_FS) -> Iterator[Optional[Any]]:
    """A ``SegmentStore`` for ``store`` (a store, a root path, or None for ``default_root``).

    None when the directory does not exist (a journal that never stored a segment has none).
    A store opened here is closed on exit; one passed in is left open.
    """
    if store is not None and not isinstance(store, (str, os.PathLike)):
        yield store  # a SegmentStore
        return
    root = os.fspath(store) if store is not None else default_root
    if not os.path.isdir(root):
        yield None
        return
    from kvj.segments.store import SegmentStore

    opened = SegmentStore(root, fs=fs)
    try:
        yield opened
    finally:
        opened.close()


def segment_problem(store: Optional[Any], key: str, digest: Optional[str] = None,
                    full: bool = True) -> Optional[Problem]:
    """None when segment ``key`` is present, intact and (if given) has ``digest``; else why not.

    ``full`` verifies its data (``SegmentStore.verify``); without it only its header is read.
    """
    if store is None:
        return "segment-missing", "no segment store"
    try:
        info = store.verify(key) if full else store.info(key)
    except SegmentMissing as exc:
        return "segment-missing", str(exc)
    except (CorruptionError, FormatError, OSError) as exc:
        return "segment-damaged", str(exc)
    if digest is not None and info.digest != digest:
        return "segment-damaged", f"digest {info.digest} differs from the {digest} its record claims"
    return None


def segment_problems(store: Optional[Any], wanted: Iterable[Tuple[str, Optional[str]]],
                     progress: Optional[Callable[[str, int, int], None]] = None) -> Dict[str, Optional[Problem]]:
    """:func:`segment_problem` of each distinct key once, in parallel (hashing releases the GIL)."""
    unique: Dict[str, Optional[str]] = {}
    for key, digest in wanted:
        if key not in unique or unique[key] is None:
            unique[key] = digest
    results: Dict[str, Optional[Problem]] = {}
    total = len(unique)
    if not total:
        return results
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = {key: pool.submit(segment_problem, store, key, digest) for key, digest in unique.items()}
        for done, (key, future) in enumerate(futures.items(), 1):
            results[key] = future.result()
            if progress:
                progress("verifying segments", done, total)
    return results


def require_segments(root: str, keys: List[Tuple[str, Optional[str]]]) -> None:
    """Raise ``SegmentMissing`` or ``CorruptionError`` unless every key is in the store, intact
    (a record never points at a segment that is not durable)."""
    with opened_store(root, root) as store:
        for key, digest in keys:
            problem = segment_problem(store, key, digest)
            if problem is None:
                continue
            kind, reason = problem
            if kind == "segment-missing":
                raise SegmentMissing(f"segment {key} is not in the store {root}: store it first (kvj flush)")
            raise CorruptionError(root, None, f"segment {key}: {reason}")
