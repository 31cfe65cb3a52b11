"""What kvj serve needs of the connector (scheduler-side plans, no engine): a request journals its
reply key; an abort of a kvj serve request is "cancelled" with kvj's cancel marker and otherwise
*parked* (no END: the next kvj serve continues it); an abort of any other request is "aborted".
The worker journals no END for a parked request."""

from __future__ import annotations

import os
import types
from typing import Any

import pytest
import torch

import kvj
from kvj.serve.engine import mark_cancel
from kvj.serve.paths import cancel_marker
from support.vllm_config import tiny_model

BLOCK = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("model")))


def scheduler(model: str, journal: str) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvj.integrations.vllm import KvjConnector

    transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"journal": journal})
    config = EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=512, enforce_eager=True,
                        block_size=BLOCK, kv_transfer_config=transfer).create_engine_config()
    return KvjConnector(config, KVConnectorRole.SCHEDULER, None)


def request(rid: str, client: Any, status: str = "FINISHED_ABORTED") -> Any:
    from vllm import SamplingParams

    extra = {"kvj_client": client} if client else None
    return types.SimpleNamespace(request_id=rid, all_token_ids=[1, 2, 3], prompt_token_ids=[1, 2, 3], num_tokens=3,
                                 num_computed_tokens=0, sampling_params=SamplingParams(max_tokens=8, extra_args=extra),
                                 status=types.SimpleNamespace(name=status))


def finishes(conn: Any, *requests: Any) -> dict:
    from vllm.v1.core.sched.output import SchedulerOutput

    for r in requests:
        conn.request_finished(r, [])
    return {f.vllm_id: f.status for f in conn.build_connector_meta(SchedulerOutput.make_empty()).finishes}


def test_a_served_request_journals_its_reply_key_and_an_abort_is_parked_or_cancelled(model, tmp_path):
    journal = str(tmp_path / "j")
    conn = scheduler(model, journal)
    served, cancelled, plain, done = (request("v1", "chatcmpl-a"), request("v2", "chatcmpl-b"), request("v3", None),
                                      request("v4", "chatcmpl-c", "FINISHED_LENGTH_CAPPED"))
    for r in (served, cancelled, plain, done):
        conn.on_new_request(r)
    from vllm.v1.core.sched.output import SchedulerOutput

    starts = {s.vllm_id: s.meta for s in conn.build_connector_meta(SchedulerOutput.make_empty()).starts}
    assert starts["v1"]["client"] == "chatcmpl-a" and "client" not in starts["v3"]
    mark_cancel(journal, "chatcmpl-b")
    assert finishes(conn, served, cancelled, plain, done) == {"v1": "parked", "v2": "cancelled", "v3": "aborted",
                                                              "v4": "length_capped"}
    assert not os.path.exists(cancel_marker(journal, "chatcmpl-b"))  # used up: the connector removed it


def test_the_worker_journals_no_end_for_a_parked_request(tmp_path):
    from kvj.integrations.vllm.plan import Finish, Start, StepPlan
    from kvj.integrations.vllm.worker import WorkerJournal
    from kvj.segments.kvblock import LHNC, KVBlockLayout

    path = str(tmp_path / "j")
    worker = WorkerJournal(path, KVBlockLayout("tiny@x", "float32", 2, 2, 8, 4, LHNC), threads=1)
    worker.register([torch.zeros(8, 2, 4, 16) for _ in range(2)])
    meta = {"format": "kvj-vllm-request/1", "prompt_len": 3, "client": "chatcmpl-a"}
    worker.step(StepPlan(starts=[Start("v1", "r1", [1, 2, 3], meta), Start("v2", "r2", [1, 2, 3], meta)],
                         tokens=[("r1", 3, [4, 5])],
                         finishes=[Finish("v1", "r1", "parked", ["r0"]), Finish("v2", "r2", "cancelled", [])]))
    worker.drain()
    worker.close()
    state = kvj.replay(path)
    assert not state.requests["r1"].ended and state.requests["r1"].output == [4, 5]  # in flight: resumed later
    assert state.requests["r2"].status == "cancelled" and "r0" not in state.requests  # nothing else journaled
