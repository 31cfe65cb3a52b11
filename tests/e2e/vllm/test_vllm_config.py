"""KvjConnector's start-up and scheduler side against vLLM's real configuration objects, no engine:
what it refuses (one line), fp8 KV caches, the weights' digest kept beside the journal, a hub
id's revision, START on arrival, the durable-admission mode, the restored tokens it reports."""

from __future__ import annotations

import os
import types
from typing import Any, List

import pytest
import torch

from kvj.errors import KvjError

from support.vllm_config import BLOCK, engine_config, no_step, scheduled, scheduler, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("model")))


def request(rid: str, tokens: List[int]) -> Any:
    return types.SimpleNamespace(request_id=rid, all_token_ids=list(tokens), prompt_token_ids=list(tokens),
                                 num_tokens=len(tokens), num_computed_tokens=0, sampling_params=None,
                                 status=types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))


def test_refused_features_get_one_line_naming_them(model: str, tmp_path: Any) -> None:
    from kvj.integrations.vllm.config import refusal

    config = engine_config(model, str(tmp_path / "j"))
    assert refusal(config, None) is None
    groups = types.SimpleNamespace(kv_cache_groups=[object(), object()])
    odd = types.SimpleNamespace(
        model_config=types.SimpleNamespace(use_mla=True, dtype=torch.bfloat16),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2),
        cache_config=types.SimpleNamespace(cache_dtype="int8_per_token_head"),
        speculative_config=object())
    line = refusal(odd, groups)
    assert line is not None and "\n" not in line
    assert "tensor" not in line and "pipeline" not in line  # journaled per rank
    for what in ("data parallel size 2", "2 KV cache groups (hybrid attention)", "MLA",
                 "speculative decoding", "'int8_per_token_head'"):
        assert what in line, (what, line)
    fp8 = types.SimpleNamespace(**{**vars(odd), "cache_config": types.SimpleNamespace(cache_dtype="fp8_e5m2"),
                                   "speculative_config": None,
                                   "model_config": types.SimpleNamespace(use_mla=False, dtype=torch.bfloat16),
                                   "parallel_config": config.parallel_config})
    assert refusal(fp8, None) is None


def test_an_fp8_kv_cache_is_journaled_as_its_bytes(model: str, tmp_path: Any) -> None:
    """vLLM keeps an fp8 KV cache as uint8; its blocks are those bytes, their meaning named in the
    layout (``quant``), so an fp8_e4m3 block never loads into an fp8_e5m2 or bf16 cache."""
    from kvj.integrations.vllm.layout import block_layout

    config = engine_config(model, str(tmp_path / "j"))
    plain = block_layout(config, "m")
    config.cache_config.cache_dtype = "fp8_e4m3"
    e4m3 = block_layout(config, "m")
    config.cache_config.cache_dtype = "fp8_e5m2"
    e5m2 = block_layout(config, "m")
    assert (plain.dtype, plain.quant) == ("float32", "") and (e4m3.dtype, e4m3.quant) == ("uint8", "fp8_e4m3")
    assert len({plain.seed(), e4m3.seed(), e5m2.seed()}) == 3
    assert e4m3.block_shape == (2, BLOCK, 2 * 16) and e4m3.nbytes == 2 * 2 * BLOCK * 32


def test_weights_are_hashed_once_and_again_only_when_a_file_changes(model: str, tmp_path: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import blake3

    from kvj.integrations.vllm import layout as connector

    journal = str(tmp_path / "j")
    hashed: List[str] = []

    class Counting:
        AUTO = blake3.blake3.AUTO

        def __init__(self, *args: Any, **kwargs: Any):
            self._h = blake3.blake3(*args, **kwargs)

        def update_mmap(self, path: str) -> None:
            hashed.append(os.path.basename(path))
            self._h.update_mmap(path)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._h, name)

    monkeypatch.setattr(connector, "blake3", types.SimpleNamespace(blake3=Counting))
    first = connector.weights_digest(model, journal)
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    assert os.path.exists(os.path.join(journal, connector.DIGESTS))
    assert connector.weights_digest(model, journal) == first and len(hashed) == 2  # from the kept digest
    config = os.path.join(model, "config.json")
    st = os.stat(config)
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert connector.weights_digest(model, journal) == first and len(hashed) == 4  # same bytes, hashed again


def test_a_hub_id_is_named_with_its_resolved_revision(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id is the commit its cached snapshot is of; without one it is refused in one line."""
    import huggingface_hub.constants

    from kvj.integrations.vllm.config import KvjConfig
    from kvj.integrations.vllm.layout import model_identity

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--org--tiny" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    hub = lambda name: types.SimpleNamespace(model_config=types.SimpleNamespace(model=name, revision=None))  # noqa: E731
    assert model_identity(hub("org/tiny"), KvjConfig(journal="j")) == f"hf:org/tiny@{commit}"
    with pytest.raises(KvjError, match="cannot resolve the revision of model 'org/absent'") as err:
        model_identity(hub("org/absent"), KvjConfig(journal="j"))
    assert "\n" not in str(err.value)


def test_start_is_journaled_on_arrival_and_durable_admission_waits_for_it(model: str, tmp_path: Any) -> None:
    from kvj.integrations.vllm import KvjWorkerMetadata

    conn = scheduler(model, str(tmp_path / "j"), admission="durable")
    r = request("r1", list(range(70)))
    conn.on_new_request(r)
    plan = conn.build_connector_meta(no_step())  # not scheduled: START goes out anyway
    assert [s.vllm_id for s in plan.starts] == ["r1"] and plan.starts[0].tokens == list(range(70))
    assert conn.get_num_new_matched_tokens(r, 0) == (None, False)  # not before its START is durable
    conn.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=KvjWorkerMetadata(started={"r1": [0]}),
                                                       invalid_block_ids=set()))
    assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
    assert conn.build_connector_meta(no_step()).starts == []

    arrival = scheduler(model, str(tmp_path / "j2"))
    arrival.on_new_request(request("r2", [1, 2, 3]))
    assert arrival.get_num_new_matched_tokens(request("r2", [1, 2, 3]), 0) == (0, False)


def test_the_tokens_loaded_are_counted_by_the_connector_and_reported_with_the_output(model: str,
                                                                                     tmp_path: Any) -> None:
    """vLLM's num_cached_tokens is fixed at scheduling and counts blocks that failed to load; the
    connector reports what the workers loaded (``kv_transfer_params``, which ``resume`` reads)."""
    from kvj.integrations.vllm import KvjWorkerMetadata
    from kvj.integrations.vllm.resuming import RESTORED, REUSED

    conn = scheduler(model, str(tmp_path / "j"))
    r = request("r1", list(range(100)))
    conn.on_new_request(r)
    conn.update_connector_output(types.SimpleNamespace(
        kv_connector_worker_meta=KvjWorkerMetadata(loaded={"r1": {0: 64}}), invalid_block_ids=set()))
    r.num_computed_tokens = 64
    hold, params = conn.request_finished(r, [7, 8, 9, 10])
    assert hold and params == {RESTORED: 64, REUSED: 0}
    plan = conn.build_connector_meta(no_step())
    assert [f.vllm_id for f in plan.finishes] == ["r1"]
    assert [(s.block, s.block_id) for s in plan.saves] == [(0, 7), (1, 8)]  # its computed blocks, gathered now


def test_unknown_extra_config_keys_are_refused(model: str, tmp_path: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvj.integrations.vllm import KvjConnector

    with pytest.raises(KvjError, match="unknown key 'thread'"):
        KvjConnector(engine_config(model, str(tmp_path / "j"), thread=2), KVConnectorRole.SCHEDULER, None)


def test_a_step_saves_blocks_computed_by_the_previous_one_and_a_preempted_requests_before_reuse(
        model: str, tmp_path: Any) -> None:
    """A step's plan is gathered before its forward, so it names only blocks already computed
    (``num_computed_tokens`` before vLLM adds the step's tokens) whose next token is known; a
    request preempted in this step has its computed blocks saved now, from the block ids it had
    (vLLM freed them: a later kernel of this step may overwrite them)."""
    conn = scheduler(model, str(tmp_path / "j"))
    r = request("r1", list(range(3 * BLOCK + 5)))
    conn.on_new_request(r)
    ids = {"r1": [4, 9, 2, 7]}
    assert conn.build_connector_meta(scheduled(ids, {"r1": 2 * BLOCK})).saves == []  # computed in this step
    r.num_computed_tokens = 2 * BLOCK  # vLLM's _update_after_schedule
    plan = conn.build_connector_meta(scheduled(ids, {"r1": BLOCK}))
    assert [(s.block, s.block_id) for s in plan.saves] == [(0, 4), (1, 9)]
    assert plan.saves[1].token_ids == list(range(BLOCK, 2 * BLOCK + 1))  # its tokens and the next
    r.num_computed_tokens = 0  # preempted in the next schedule: vLLM resets it and frees the blocks
    plan = conn.build_connector_meta(scheduled({}, {}, preempted={"r1"}))
    assert [(s.block, s.block_id) for s in plan.saves] == [(2, 2)]


def test_a_finish_needs_no_wait_for_save(model: str, tmp_path: Any) -> None:
    """Finishes and their last blocks are journaled at the start of the next step
    (``handle_preemptions``, which vLLM calls on every step), so a step on which vLLM skips
    ``wait_for_save`` still ends the request and frees its blocks (defect 6)."""
    import kvj
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvj.integrations.vllm import KvjConnector
    from kvj.integrations.vllm.plan import Finish, Start

    journal = str(tmp_path / "j")
    worker = KvjConnector(engine_config(model, journal), KVConnectorRole.WORKER, None)
    caches = {f"l{i}": torch.zeros(4, 2, BLOCK, 32) for i in range(2)}
    worker.register_kv_caches(caches)
    sched = scheduler(model, str(tmp_path / "other"))
    r = request("v1", list(range(40)))
    sched.on_new_request(r)
    plan = sched.build_connector_meta(no_step())
    plan.starts = [Start("v1", "e-v1", r.prompt_token_ids, {})]
    plan.finishes = [Finish("v1", "e-v1", "length_capped", [])]
    worker.handle_preemptions(plan)  # no wait_for_save
    assert worker.get_finished({"v1"}) == ({"v1"}, None)
    worker.shutdown()
    assert kvj.replay(journal).requests["e-v1"].ended
