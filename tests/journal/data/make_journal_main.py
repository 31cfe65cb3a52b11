"""Writes journal-main/ and its expected replay with kvj as main was before the 0.2.0 redesign
(how the fixture was made): every record type, a snapshot, loose and packed segments.

    git archive 3349bac kvj | tar -x -C /tmp/kvjmain
    python make_journal_main.py /tmp/kvjmain journal-main && rm journal-main/LOCK journal-main/COMPACT
"""
import hashlib, json, os, shutil, sys
sys.path.insert(0, sys.argv[1])
import kvj
assert kvj.__file__.startswith(sys.argv[1]), kvj.__file__
import torch
from kvj.journal.journal import Journal
from kvj.journal.config import CommitPolicy
from kvj.ops.compact import compact
from kvj.journal.replay import replay

out = sys.argv[2]
shutil.rmtree(out, ignore_errors=True)


def block(n):
    return torch.arange(n * 1000, n * 1000 + 512, dtype=torch.float32).reshape(2, 16, 16).to(torch.bfloat16)


with Journal.open(out, policy=CommitPolicy(file_size_limit=400)) as j:
    j.start("chat-1", prompt_hash="h1", tokens=[1, 2, 3], meta={"user": "a", "nested": {"x": [1, 2.5, None]}})
    j.flush("chat-1", 0, block(1), token_range=(0, 16), layout={"model": "m", "block": 16}).result()
    j.tokens("chat-1", 3, [4, 5, 6])
    j.alloc("cuda:0", 0x1000, 4096, "kv:chat-1")
    j.start("chat-2", tokens=[9])
    j.end("chat-2", status="cancelled")
    j.free("cuda:0", 0x1000)
    j.sync()
    infos = j.store.put_many([(block(n).view(torch.uint8).numpy().tobytes(), torch.bfloat16, (2, 16, 16),
                               {"model": "m", "block": 16, "n": n}) for n in (2, 3)])
    j.checkpoint(10, {"w": infos[0].key}, meta={"lr": 0.001})
    j.delta(11, 10, {"m": infos[1].key})
    j.sync()
compact(out, collect=False)
with Journal.open(out) as j:
    j.flush("chat-1", 1, block(4), token_range=(16, 32), layout={"model": "m", "block": 16}).result()
    j.start("moved", tokens=[7, 8])
    j.handoff("moved", "engine-b")
    j.epoch(1, 9, manifest="recovery/m.json")
    j.start("chat-3", prompt_hash=None, tokens=[7], meta={})
    j.sync()
state = replay(out)
d = state.to_dict()
for e in d["epochs"]:
    e["time"] = "T"
segments = {}
for root, _dirs, names in os.walk(os.path.join(out, "segments")):
    for name in names:
        if name.endswith((".kvjseg", ".kvjpack")):
            with open(os.path.join(root, name), "rb") as f:
                segments[os.path.relpath(os.path.join(root, name), out)] = hashlib.sha256(f.read()).hexdigest()
from kvj.segments.store import SegmentStore
with SegmentStore(os.path.join(out, "segments")) as store:
    tensors = {key: hashlib.sha256(store.get(key).view(torch.uint8).numpy().tobytes()).hexdigest()
               for key in sorted(store.keys())}
json.dump({"state": d, "files": segments, "tensors": tensors},
          open(os.path.join(out, "..", "journal-main.expected.json"), "w"), indent=1, sort_keys=True)
print(sorted(os.listdir(out)))
