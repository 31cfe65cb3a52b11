"""The model server of the incident walkthrough (tests/cli/test_incident_walkthrough.py), as a
process that journals like one and is SIGKILLed.

``python incident_server.py JOURNAL`` serves requests until killed: each starts, flushes two
KV blocks (a pure function of request and block, so a resumed server can check them) and
every other one ends; after each request it syncs and prints ``durable <lsn> <request>``.
Small log files (16 KiB) so that the journal has sealed logs to damage.

``python incident_server.py JOURNAL --manifest PATH`` is the restart after recovery: it loads
every segment the manifest plans, verified, checks each against the block it should be,
prints ``resumed <requests> <segments> <bad>``, ends the resumed requests, prints
``durable <lsn>`` and keeps serving (idle) until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvj.journal.config import CommitPolicy, default_store_path
from kvj.journal.journal import Journal
from kvj.segments.load import load
from kvj.segments.store import SegmentStore

TOKENS = 16


def block(request: int, index: int) -> torch.Tensor:
    """KV block ``index`` of request ``request``: [2, 16 tokens, 4 heads, 16 dims], bf16."""
    g = torch.Generator().manual_seed(request * 1000 + index)
    return torch.randn(2, TOKENS, 4, 16, generator=g).to(torch.bfloat16)


def serve(path: str) -> None:
    with Journal.open(path, policy=CommitPolicy(file_size_limit=16 << 10)) as j:
        for r in range(1 << 30):
            rid = f"req-{r}"
            j.start(rid, prompt_hash=f"p{r}", tokens=list(range(TOKENS * 2)))
            for b in range(2):
                j.flush(rid, b, block(r, b), token_range=(b * TOKENS, (b + 1) * TOKENS), layout={"model": "demo"})
            if r % 2:
                j.end(rid)
            print(f"durable {j.sync()} {rid}", flush=True)


def resume(path: str, manifest_path: str) -> None:
    with open(manifest_path) as f:
        manifest = json.load(f)
    segments = bad = 0
    with SegmentStore(default_store_path(path)) as store:
        for entry in manifest["requests"]:
            r = int(entry["id"].split("-")[1])
            for seg in entry["segments"]:
                segments += 1
                bad += not torch.equal(load(store, seg["key"], "cpu"), block(r, seg["seg"]))
    print(f"resumed {len(manifest['requests'])} {segments} {bad}", flush=True)
    with Journal.open(path) as j:
        for entry in manifest["requests"]:
            j.end(entry["id"])
        print(f"durable {j.sync()}", flush=True)
        while True:  # serving (idle) until killed
            time.sleep(1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--manifest":
        resume(os.path.abspath(sys.argv[1]), sys.argv[3])
    else:
        serve(os.path.abspath(sys.argv[1]))
