"""Writes journal-0.1.0/ and its expected replay with kvj 0.1.0 (how the fixture was made).

    git archive ee86512 kvj | tar -x -C /tmp/kvj010
    python make_journal_0_1_0.py /tmp/kvj010 journal-0.1.0 && rm journal-0.1.0/LOCK journal-0.1.0/COMPACT
"""
import json, os, sys, shutil
sys.path.insert(0, sys.argv[1])
import kvj
assert kvj.__file__.startswith(sys.argv[1]), kvj.__file__
from kvj.journal.journal import Journal
from kvj.journal.config import CommitPolicy
from kvj.journal.records import RecordType
from kvj.ops.compact import compact
from kvj.journal.replay import replay
out = sys.argv[2]
shutil.rmtree(out, ignore_errors=True)
key = lambda i: f"{i:064x}"
with Journal.open(out, policy=CommitPolicy(file_size_limit=200)) as j:
    j.start("chat-1", prompt_hash="h1", tokens=[1, 2, 3], meta={"user": "a", "n": 1, "nested": {"x": [1, 2.5, None]}})
    j.sync()
    j.append(RecordType.SEGMENT, {"id": "chat-1", "seg": 0, "key": key(1), "tokens": [0, 16], "layout": {"model": "m", "block": 16},
             "raw_size": 4096, "stored_size": 1000, "digest": key(11), "codec": "zstd"})
    j.alloc("cuda:0", 0x1000, 4096, "kv:chat-1")
    j.sync()
compact(out, collect=False)
with Journal.open(out, policy=CommitPolicy(file_size_limit=200)) as j:
    j.start("chat-2", tokens=None)
    j.end("chat-2", status="cancelled")
    j.free("cuda:0", 0x1000)
    j.sync()
    j.checkpoint(10, {"w": key(2)}, meta={"lr": 0.001})
    j.delta(11, 10, {"m": key(3)})
    j.sync()
with Journal.open(out) as j:
    j.append(RecordType.SEGMENT, {"id": "chat-1", "seg": 1, "key": key(4), "tokens": [16, 32], "layout": {"model": "m", "block": 16},
             "raw_size": 4096, "stored_size": 900, "digest": key(12), "codec": "raw"})
    j.epoch(1, 9, manifest="recovery/m.json")
    j.start("chat-3", prompt_hash=None, tokens=[7], meta={})
state = replay(out)
d = state.to_dict()
for e in d["epochs"]: e["time"] = "T"
json.dump(d, open(os.path.join(out, "..", "journal-0.1.0.expected.json"), "w"), indent=1, sort_keys=True)
print(sorted(os.listdir(out)))
