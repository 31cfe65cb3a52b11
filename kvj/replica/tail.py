"""What is new in the journal being replicated: its log files' whole commit groups, read by
the journal's own walker (every CRC checked) and fsynced before anything of them is shipped."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Dict, List, Set

from kvj.errors import CorruptionError, FormatError
from kvj.fileio import fsync_path, open_read
from kvj.journal.framing import FILE_HEADER_SIZE
from kvj.journal.journal import segment_keys
from kvj.journal.reader import TORN, Damage, Scan, list_logs, log_seq, raise_on_damage, read_header
from kvj.journal.records import RecordType, decode_payload

#: The records that name segments.
_KEYED = (RecordType.SEGMENT, RecordType.CHECKPOINT, RecordType.DELTA)


@dataclass
class LocalLog:
    """One local log file: its header, how far it was read, the segment keys it names."""

    seq: int
    base_lsn: int
    salt: int
    valid_end: int
    last_lsn: int
    keys: Set[str] = field(default_factory=set)
    checked: bool = False  # its shipped prefix was compared with the replica's


class JournalTail:
    """The log files of the journal at ``journal``, as far as they were read."""

    def __init__(self, journal: str):
        self.journal = journal
        self.logs: Dict[int, LocalLog] = {}

    def scan(self) -> List[LocalLog]:
        """Read what is new in each log file and fsync the files read (what is shipped must be
        durable here too); a vanished file is ``FileNotFoundError``."""
        paths = list_logs(self.journal)
        found: List[LocalLog] = []
        for index, path in enumerate(paths):
            sealed = index < len(paths) - 1
            seq = log_seq(path)
            info = self.logs.get(seq)
            if info is None:
                header = read_header(path)
                if header is None:
                    if not sealed and os.path.getsize(path) <= FILE_HEADER_SIZE:
                        break  # the writer is creating it: nothing in it was acknowledged
                    raise CorruptionError(path, 0, "bad log file header")
                info = self.logs[seq] = LocalLog(seq, header.base_lsn, header.salt, FILE_HEADER_SIZE,
                                                 header.base_lsn - 1)
            if self._walk(path, info, sealed):
                fsync_path(path)
            found.append(info)
        live = {i.seq for i in found}
        for seq in [s for s in self.logs if s not in live]:
            del self.logs[seq]
        return found

    def _walk(self, path: str, info: LocalLog, sealed: bool) -> int:
        """Read the whole groups after ``info.valid_end``, noting their segment keys; returns the
        bytes consumed. Damage is ``CorruptionError``; an incomplete group at the end of the
        newest file is still being written (or a tail the writer will cut): the next round's."""
        def report(damage: Damage) -> None:
            if damage.kind == TORN and sealed:
                raise CorruptionError(path, damage.offset, "damaged commit group in a sealed log file")
            raise_on_damage(damage)

        scan = Scan(self.journal, logs=[path], after_lsn=info.last_lsn, start=(path, info.valid_end),
                    reporter=report, mirror=False)
        for rec in scan:
            if rec.rtype in _KEYED:
                try:
                    info.keys.update(segment_keys(rec.rtype, decode_payload(rec.rtype, rec.payload)))
                except FormatError as exc:
                    raise CorruptionError(path, rec.offset, f"LSN {rec.lsn}: {exc}") from None
            info.last_lsn = rec.lsn
        if scan.end_offset < info.valid_end:  # the walk found no file: a compaction removed it
            raise FileNotFoundError(errno.ENOENT, "log file vanished during the round", path)
        consumed = scan.end_offset - info.valid_end
        info.valid_end = scan.end_offset
        return consumed

    def read(self, seq: int, start: int, end: int) -> bytes:
        """Bytes ``start``..``end`` of log file ``seq``."""
        with open_read(os.path.join(self.journal, f"{seq:016d}.log")) as f:
            f.seek(start)
            data = f.read(end - start)
        if len(data) != end - start:
            raise CorruptionError(f.name, start, "log file shrank while it was being replicated")
        return data
