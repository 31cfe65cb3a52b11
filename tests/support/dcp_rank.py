"""One rank of the two-rank DCP test: ``python -m support.dcp_rank JOURNAL STEP``.

Rank and world come from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as
torchrun sets them. The rank saves the state of STEP (a function of the step: a sharded
float32 weight, a sharded bfloat16 moment, a replicated step tensor) through JournalWriter,
then loads the newest committed checkpoint through JournalReader into zeros, sharded the same
way, and prints its step and the SHA-256 of the full tensors. With KVJ_DCP_DIE_AFTER=n set,
the rank SIGKILLs itself after storing n shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Dict

import torch


def full_state(step: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(64, 48, generator=gen), "m": torch.randn(96, 8, generator=gen).to(torch.bfloat16),
            "step": torch.tensor(step)}


def digest(full: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(full):
        h.update(name.encode() + full[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from kvj.integrations.dcp import JournalReader, JournalWriter
    from kvj.segments.store import SegmentStore

    journal, step = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(full: Dict[str, torch.Tensor]) -> Dict[str, object]:
        return {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)])},
                "optim": {"m": distribute_tensor(full["m"], mesh, [Shard(0)])}, "step": full["step"]}

    die_after = int(os.environ.get("KVJ_DCP_DIE_AFTER", "0"))
    if die_after:
        put, count = SegmentStore.put_bytes, [0]

        def put_then_die(self, *args, **kwargs):
            info = put(self, *args, **kwargs)
            count[0] += 1
            if count[0] >= die_after:
                print(json.dumps({"event": "dying", "rank": dist.get_rank()}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return info

        SegmentStore.put_bytes = put_then_die
    dcp.save(sharded(full_state(step)), storage_writer=JournalWriter(journal, step=step))
    zeros = sharded({"w": torch.zeros(64, 48), "m": torch.zeros(96, 8, dtype=torch.bfloat16),
                     "step": torch.tensor(-1)})
    reader = JournalReader(journal)
    dcp.load(zeros, storage_reader=reader)
    loaded = {"w": zeros["model"]["w"].full_tensor(), "m": zeros["optim"]["m"].full_tensor(), "step": zeros["step"]}
    print(json.dumps({"event": "loaded", "rank": dist.get_rank(), "step": reader.step,
                      "tensor_step": int(loaded["step"]), "digest": digest(loaded)}), flush=True)
    # Both ranks are done with their collectives before either tears gloo down: a rank that
    # left first once made the other's gloo thread abort at exit ("terminate called without an
    # active exception", SIGABRT).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
