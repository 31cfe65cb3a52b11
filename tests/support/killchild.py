"""The writer process that ``test_kill.py`` and ``test_concurrency.py`` SIGKILL under load.

Run as ``python tests/killchild.py JOURNAL ACKS RUN SEED [--threads N] [--flush]``. It
opens the journal, writes ``ready <next LSN>`` to the side channel ``ACKS`` (a plain
O_APPEND file: a process kill loses nothing already written to it), then appends until
killed:

* ``N`` appender threads append ALLOC records whose content is a pure function of
  (run, thread, sequence number), so the parent can check every replayed record without
  having seen it appended, and can see holes (a missing sequence number);
* a syncer thread calls ``sync()`` in a loop and writes ``A <lsn>`` after each return;
* appenders sometimes use ``durable=True`` and write ``A <lsn>`` when it returns;
* with ``--flush``, a flusher thread starts requests and flushes KV segments whose
  tensors are a pure function of (run, request, segment), writing ``S <lsn>`` once the
  flush future and a following ``sync()`` returned; it ends every other request, whose
  blocks the next request flushes again (dedup hits on unreferenced segments).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from typing import Any, Dict, Tuple

from kvj import Journal, RecordType
from kvj.journal.config import CommitPolicy

ALLOC_DEVICE = "r{run}t{tid}"


def alloc_payload(run: int, tid: int, seq: int) -> Dict[str, Any]:
    """The ALLOC record appender ``tid`` of run ``run`` writes as its ``seq``-th record."""
    rng = random.Random(f"{run}:{tid}:{seq}")
    return {"device": ALLOC_DEVICE.format(run=run, tid=tid), "addr": seq, "size": rng.randrange(1 << 30),
            "tag": "t" * (rng.randrange(3000) if rng.random() < 0.05 else rng.randrange(30))}


def parse_device(device: str) -> Tuple[int, int]:
    """(run, thread) from an ALLOC record's device name."""
    run, tid = device[1:].split("t")
    return int(run), int(tid)


def flush_tensor(run: int, req: int, seg: int):  # -> torch.Tensor
    """The KV block flushed as segment ``seg`` of request ``req`` in run ``run``: requests 2k
    and 2k+1 flush the same blocks, so the second's are dedup hits on the first's, which has
    ended (what a compaction at grace 0 may be collecting at that very moment)."""
    import torch
    req -= req % 2
    g = torch.Generator().manual_seed(run * 1_000_003 + req * 1009 + seg)
    shape = (2, 16, 2, 8)
    if (req + seg) % 3 == 0:
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    if (req + seg) % 3 == 1:
        return torch.randint(-100, 100, shape, generator=g, dtype=torch.int16)
    # rows that repeat (shared prefixes) compress, so codecs other than raw are exercised
    base = torch.randn((1, 16, 2, 8), generator=g)
    return base.repeat(2, 1, 1, 1)


def request_id(run: int, req: int) -> str:
    return f"r{run}-q{req}"


class Side:
    """The side channel: whole lines appended with one write each."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.lock = threading.Lock()

    def say(self, line: str) -> None:
        with self.lock:
            os.write(self.fd, (line + "\n").encode())


def main(argv: list) -> None:
    journal, acks, run, seed = argv[0], argv[1], int(argv[2]), int(argv[3])
    threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 2
    flush = "--flush" in argv
    side = Side(acks)
    if flush:
        import torch  # noqa: F401  (imported before 'ready', so kills land in flushes, not in the import)
    policy = CommitPolicy(max_delay=0.002, max_records=64, file_size_limit=32 << 10)
    j = Journal.open(journal, policy=policy)
    side.say(f"ready {j.writer.last_lsn + 1}")

    def appender(tid: int) -> None:
        rng = random.Random(f"{seed}:{run}:{tid}")
        seq = 0
        while True:
            if seq % 8 == 7:
                time.sleep(0.001)  # a steady load, not a flood: bounded journals over hundreds of kills
            durable = rng.random() < 0.02
            lsn = j.writer.append(RecordType.ALLOC, alloc_payload(run, tid, seq), durable)
            if durable:
                side.say(f"A {lsn}")
            seq += 1

    def syncer() -> None:
        while True:
            side.say(f"A {j.sync()}")

    def flusher() -> None:
        req = 0
        while True:
            rid = request_id(run, req)
            j.start(rid, prompt_hash=f"{run}:{req}", tokens=[run, req])
            for s in range(3):
                fut = j.flush(rid, s, flush_tensor(run, req, s), token_range=(16 * s, 16 * s + 16),
                              layout={"model": "kill-test", "block": 16})
                fut.result()
            side.say(f"S {j.sync()}")
            if req % 2 == 0:
                j.end(rid)  # its blocks are unreferenced now; the next request flushes the same ones
            req += 1

    workers = [threading.Thread(target=appender, args=(t,), daemon=True) for t in range(threads)]
    workers.append(threading.Thread(target=syncer, daemon=True))
    if flush:
        workers.append(threading.Thread(target=flusher, daemon=True))
    for w in workers:
        w.start()
    for w in workers:
        w.join()


if __name__ == "__main__":
    main(sys.argv[1:])
