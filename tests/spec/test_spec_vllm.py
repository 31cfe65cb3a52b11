"""The independent reader on the vLLM connector's block segments (kvj-segment(5), VLLM BLOCKS).

The worker-side ``KvjConnector`` runs for real, without an engine: built from a stand-in
``VllmConfig`` (the fields ``kv_identity`` reads) and driven through the connector API vLLM
calls (``register_kv_caches``, ``bind_connector_metadata``, ``wait_for_save``,
``get_finished``), it journals blocks of real paged caches; the reader then checks their
layout, fingerprint, chained keys and bytes.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import kvj
from spec import reader
from support.wait import wait_for

pytest.importorskip("vllm")

LAYERS, HEADS, BLOCK, HEAD = 2, 2, 4, 8


def connector(journal: str):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvj.integrations.vllm import KvjConnector

    transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"journal": journal})
    model = SimpleNamespace(dtype=torch.bfloat16, model="tiny-llama", revision=None, get_head_size=lambda: HEAD,
                            get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS)
    config = SimpleNamespace(kv_transfer_config=transfer, model_config=model,
                             cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                             data_parallel_size=1))
    return KvjConnector(config, KVConnectorRole.WORKER, None)


def test_vllm_blocks_carry_their_identity_chain_and_bytes(tmp_path):
    from kvj.integrations.vllm import KvjConnectorMetadata, _Finish, _Save, _Start, chain_keys

    path = str(tmp_path / "j")
    worker = connector(path)  # the worker creates the journal
    gen = torch.Generator().manual_seed(11)
    caches = {f"layer.{i}": torch.randn(8, HEADS, BLOCK, 2 * HEAD, generator=gen).to(torch.bfloat16)
              for i in range(LAYERS)}
    worker.register_kv_caches(caches)
    tokens = list(range(300, 311))  # a 7-token prompt and 4 generated: two whole blocks and their next token
    chains = chain_keys(worker._fp, tokens, BLOCK)
    where = {0: 5, 1: 2}  # block index -> block id in the paged cache
    saves = [_Save("r1", b, where[b], chains[b], tokens[b * BLOCK:(b + 1) * BLOCK + 1]) for b in (0, 1)]
    meta = {"format": "kvj-vllm-request/1", "prompt_len": 7}
    worker.bind_connector_metadata(KvjConnectorMetadata(starts=[_Start("r1", tokens[:7], meta)], saves=saves,
                                                        finishes=[_Finish("v1", "r1", "stopped", None)]))
    worker.wait_for_save()
    wait_for(lambda: worker.get_finished({"v1"})[0] == {"v1"}, what="the first request's END")
    # A second request with the same first block: journaled by reference, no second copy.
    worker.bind_connector_metadata(KvjConnectorMetadata(starts=[_Start("r2", tokens[:5], meta)],
                                                        saves=[_Save("r2", 0, 7, chains[0], tokens[:5])]))
    worker.wait_for_save()
    worker.shutdown()

    journal = reader.read_journal(path)
    store = reader.read_store(os.path.join(path, "segments"))
    reader.check_segment_records(journal, store)
    records = [r.payload for r in journal.records if r.rtype == 2]
    assert [(r["id"], r["seg"]) for r in records] == [("r1", 0), ("r1", 1), ("r2", 0)]
    assert records[2]["key"] == records[0]["key"] and len(store) == 2
    for rec in records[:2]:
        seg = store[rec["key"]]
        assert reader.check_layout(seg) == "kvj-vllm-block/1"
        assert seg.layout["model"] == "tiny-llama@default" and seg.layout["kv_dtype"] == "bfloat16"
        block_id = where[rec["seg"]]
        assert seg.raw == b"".join(c[block_id].contiguous().view(torch.uint8).numpy().tobytes()
                                   for c in caches.values())
    ends = [r.payload for r in journal.records if r.rtype == 3]
    assert ends == [{"id": "r1", "status": "stopped"}]
    assert kvj.replay(path).requests["r2"].resume_position == BLOCK
