"""A mirrored journal's log file as one destination for the writer: every file created, and
every commit group written and fdatasynced, in both copies before the call returns, so each
copy alone holds every acknowledged record (spec: man/kvj-journal.5, MIRROR).

A group's two copies are written and synced at once, the mirror's on a thread of its own, so a
mirror on another device costs little latency. A failure of the mirror's copy is the writer's
failure under policy ``fail``; under ``degrade`` it is logged as a warning and the journal's
copy is written alone from then on (``mirror_error`` says why) until the journal is opened
again. Which directories pair up is ``mirror``'s; how a reader picks between the copies is
``source``'s.
"""

from __future__ import annotations

import errno
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, List, Optional

from kvj.fileio import Buffer, DurabilityError
from kvj.journal.logfile import FileDestination
from kvj.journal.mirror import DEGRADE, log


class MirroredDestination:
    """The journal's copy (``primary``) and its mirror's, written as one."""

    def __init__(self, primary: FileDestination, mirror: FileDestination, policy: str):
        self.primary = primary
        self.policy = policy
        self._mirror: Optional[FileDestination] = mirror
        #: why the mirror was dropped (policy degrade); None while it is written
        self.mirror_error: Optional[OSError] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvj-mirror")

    @property
    def mirror(self) -> Optional[str]:
        """The mirror's directory while it is written; None once dropped."""
        return self._mirror.directory if self._mirror is not None else None

    def create(self, name: str, header: bytes) -> None:
        self.primary.create(name, header)
        self._on_mirror(lambda m: m.create(name, header))

    def resume(self, name: str) -> int:
        size = self.primary.resume(name)
        self._on_mirror(lambda m: m.resume(name))
        return size

    def write_synced(self, parts: List[Buffer]) -> None:
        mirror = self._mirror
        if mirror is None:
            self.primary.write_synced(parts)
            return
        mirrored = self._pool.submit(mirror.write_synced, parts)
        try:
            self.primary.write_synced(parts)
        finally:
            wait([mirrored])  # never leave the mirror's copy in flight
        self._on_mirror(lambda _m: mirrored.result())

    def close(self) -> None:
        self.primary.close()
        self._on_mirror(lambda m: m.close())

    def shutdown(self) -> None:
        self._pool.shutdown()
        self.close()

    def _on_mirror(self, op: Callable[[FileDestination], Any]) -> None:
        """Run ``op`` on the mirror's copy, unless it was dropped. A failure is the writer's
        under policy fail; under degrade it is logged, and the mirror is not written again (its
        copy now lacks what follows; readers take that from the journal's copy)."""
        mirror = self._mirror
        if mirror is None:
            return
        try:
            op(mirror)
        except OSError as exc:
            if self.policy != DEGRADE:
                raise DurabilityError(exc.errno or errno.EIO, f"mirror {mirror.directory}: {exc}") from exc
            log.warning("journal mirror %s failed (%s): writing the primary copy %s only until the journal is "
                        "opened again (mirror policy degrade)", mirror.directory, exc, self.primary.directory)
            try:
                mirror.close()
            except OSError:
                pass
            self.mirror_error, self._mirror = exc, None
