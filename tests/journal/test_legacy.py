"""The seed-era JSON-lines format: ``LegacyScan``, the reader only ``kvj migrate`` uses, and
the refusal everywhere else (replay and ``Journal.open``: ``LegacyJournal``, issue 23 item 5)."""

import json
import os

import pytest

import kvj
from kvj.errors import CorruptionError
from kvj.journal.journal import Journal
from kvj.journal.legacy import LegacyScan
from kvj.journal.records import RecordType


class TestLegacyJsonLines:
    """The seed-era format: replay refuses it (only kvj migrate reads it, issue 23 item 5);
    ``LegacyScan``, migrate's reader, reads it."""

    def write(self, path, lines, tail=b""):
        path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines) + tail)

    def test_replay_refuses_it_pointing_at_kvj_migrate(self, tmp_path):
        f = tmp_path / "kv.jsonl"
        self.write(f, [{"op": "start", "id": "a", "prompt_hash": "h1"}, {"op": "end", "id": "a"}])
        for path in (f, tmp_path):  # the file, or a directory holding it and no kvj journal
            with pytest.raises(kvj.LegacyJournal, match=f"{f} is a seed-era JSON-lines journal.*kvj migrate {f}"):
                kvj.replay(str(path))
        with pytest.raises(kvj.LegacyJournal):
            Journal.open(tmp_path)
        assert os.listdir(tmp_path) == ["kv.jsonl"]
        with Journal.open(tmp_path / "j") as j:  # a kvj journal beside a seed-era file is no seed-era journal
            j.start("b")
        os.rename(f, tmp_path / "j" / "kv.jsonl")
        assert kvj.replay(str(tmp_path / "j")).requests["b"]

    def test_imports_start_flush_end(self, tmp_path):
        f = tmp_path / "kv.jsonl"
        self.write(f, [{"op": "start", "id": "a", "prompt_hash": "h1"},
                       {"op": "seg_flush", "id": "a", "seg": 0, "ptr": 0, "size": 4096},
                       {"op": "end", "id": "a"}])
        assert [(lsn, rtype) for lsn, rtype, _p in LegacyScan(str(f))] == [
            (1, RecordType.START), (2, RecordType.SEGMENT), (3, RecordType.END)]
        assert [p.get("ptr") for _l, _t, p in LegacyScan(str(f))] == [None, 0, None]

    def test_torn_last_line_ends_the_log(self, tmp_path):
        f = tmp_path / "kv.jsonl"
        self.write(f, [{"op": "start", "id": "a", "prompt_hash": "h"}], tail=b'{"op": "seg_fl')
        scan = LegacyScan(str(f))
        assert len(list(scan)) == 1 and scan.tail.length == len(b'{"op": "seg_fl')

    def test_bad_line_in_the_middle_is_corruption(self, tmp_path):
        f = tmp_path / "kv.jsonl"
        f.write_bytes(b'{"op": "start", "id": "a"}\nnot json\n{"op": "end", "id": "a"}\n')
        with pytest.raises(CorruptionError, match="line 2"):
            list(LegacyScan(str(f)))

    def test_traversal_in_ids_is_refused(self, tmp_path):
        f = tmp_path / "kv.jsonl"
        self.write(f, [{"op": "start", "id": "../../etc/passwd"}, {"op": "end", "id": "x"}])
        with pytest.raises(CorruptionError, match="invalid request id"):
            list(LegacyScan(str(f)))
