"""KvjConnector with tensor and pipeline parallelism, against vLLM's real configuration objects, no
engine: a block (a START, a load) counts only once every rank has reported it, across steps;
a block lost on any rank is dropped for all; the start-up durable set is the intersection over
the ranks' journals; a shard of another rank or parallel size never loads; a journal of another
parallel layout is refused in one line. PP=2 layouts (the stages' layers) too."""

from __future__ import annotations

import os
import types
from typing import Any, List

import pytest
import torch

from kvj.errors import KvjError, LayoutMismatch
from support.vllm_config import tiny_model

BLOCK = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("model")))


def config(model: str, journal: str, tp: int = 2, pp: int = 1) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(kv_connector="KvjConnector", kv_connector_module_path="kvj.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"journal": journal})
    return EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=512, enforce_eager=True,
                      block_size=BLOCK, kv_transfer_config=transfer, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp, distributed_executor_backend="mp").create_engine_config()


def scheduler(model: str, journal: str, tp: int = 2, pp: int = 1) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvj.integrations.vllm import KvjConnector

    return KvjConnector(config(model, journal, tp, pp), KVConnectorRole.SCHEDULER, None)


def request(rid: str, tokens: List[int]) -> Any:
    return types.SimpleNamespace(request_id=rid, all_token_ids=list(tokens), prompt_token_ids=list(tokens),
                                 num_tokens=len(tokens), num_computed_tokens=0, sampling_params=None,
                                 status=types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))


def news(**kw: Any) -> Any:
    from kvj.integrations.vllm import KvjWorkerMetadata

    return KvjWorkerMetadata(**kw)


def test_aggregate_is_the_union_of_the_ranks_reports() -> None:
    one = news(durable={"a": [0], "b": [0]}, lost=["x"], started={"r": [0]}, loaded={"r": {0: 64}})
    two = news(durable={"a": [1]}, lost=["x", "y"], started={"r": [1]}, loaded={"r": {1: 32}})
    both = one.aggregate(two)
    assert both.durable == {"a": [0, 1], "b": [0]} and both.lost == ["x", "y"]
    assert both.started == {"r": [0, 1]} and both.loaded == {"r": {0: 64, 1: 32}}
    assert one.durable == {"a": [0], "b": [0]}  # the inputs are left as they were


def test_a_block_is_durable_only_once_every_rank_reported_it_across_steps(model: str, tmp_path: Any) -> None:
    sched = scheduler(model, str(tmp_path / "j"))
    assert sched.scheduler._ranks == {0, 1}
    tokens = list(range(3 * BLOCK + 1))
    r = request("r", tokens)
    sched.on_new_request(r)
    chains = sched.scheduler._chains(sched.scheduler._requests["r"])

    def matched() -> int:
        return sched.get_num_new_matched_tokens(r, 0)[0]

    def step(n: Any) -> None:
        sched.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=n, invalid_block_ids=set()))

    step(news(durable={chains[0]: [0], chains[1]: [0]}))
    assert matched() == 0, "rank 0 alone made the blocks durable: rank 1's shards may be lost"
    step(news(durable={chains[0]: [1]}))  # a later step
    assert matched() == BLOCK
    step(news(durable={chains[1]: [1], chains[2]: [0, 1]}))
    assert matched() == 3 * BLOCK
    step(news(lost=[chains[1]]))  # its shard failed to load on one rank: dropped for all
    assert matched() == BLOCK
    step(news(durable={chains[1]: [0]}))
    assert matched() == BLOCK

    # A START counts once every rank's is durable; a load by what every rank loaded.
    step(news(started={"r": [1]}, loaded={"r": {0: 64}}))
    assert not sched.scheduler._requests["r"].start_durable
    step(news(started={"r": [0]}, loaded={"r": {1: 32}}))
    assert sched.scheduler._requests["r"].start_durable
    assert sched.request_finished(r, [0, 1, 2, 3])[1]["kvj_restored_tokens"] == 32


def write_rank(model: str, journal: str, tp_rank: int, chains: List[str], tokens: List[int]) -> None:
    """Rank ``tp_rank``'s worker side journals the blocks of ``chains`` (its shard layout)."""
    from kvj.integrations.vllm.config import KvjConfig
    from kvj.integrations.vllm.layout import block_layout, model_identity
    from kvj.integrations.vllm.plan import Save, Start, StepPlan
    from kvj.integrations.vllm.worker import WorkerJournal
    from kvj.journal import ranks

    cfg = config(model, journal)
    layout = block_layout(cfg, model_identity(cfg, KvjConfig(journal)), tp_rank)
    worker = WorkerJournal(ranks.rank_journal(journal, tp_rank, 0, 2, 1), layout, threads=1)
    worker.register([torch.zeros(8, 1, BLOCK, 32) for _ in range(2)])
    worker.step(StepPlan(starts=[Start("v", "e-v", tokens, {})],
                         saves=[Save("e-v", b, b, c, tokens[b * BLOCK:(b + 1) * BLOCK + 1]) for b, c in enumerate(chains)]))
    worker.close()


def test_at_start_up_only_blocks_durable_in_every_rank_journal_count(model: str, tmp_path: Any) -> None:
    journal = str(tmp_path / "j")
    tokens = list(range(3 * BLOCK + 1))
    first = scheduler(model, journal)
    first.on_new_request(request("r", tokens))
    chains = first.scheduler._chains(first.scheduler._requests["r"])
    write_rank(model, journal, 0, chains, tokens)  # rank 0 made three blocks durable
    write_rank(model, journal, 1, chains[:2], tokens)  # rank 1 two
    again = scheduler(model, journal)
    r = request("r2", tokens)
    again.on_new_request(r)
    assert again.get_num_new_matched_tokens(r, 0)[0] == 2 * BLOCK


def test_a_journal_of_another_parallel_layout_is_refused_in_one_line(model: str, tmp_path: Any) -> None:
    tp2 = str(tmp_path / "tp2")
    scheduler(model, tp2)
    for tp, pp in ((1, 1), (4, 1), (2, 2)):
        with pytest.raises(KvjError) as refused:
            scheduler(model, tp2, tp, pp)
        assert "parallel size 2/1" in str(refused.value) and f"{tp}/{pp}" in str(refused.value)
        assert "\n" not in str(refused.value)
    tp1 = str(tmp_path / "tp1")
    write_tp1 = scheduler(model, tp1, 1)
    from kvj.integrations.vllm.worker import WorkerJournal

    WorkerJournal(tp1, write_tp1.layout, threads=1).close()  # a TP=1 journal, with its log
    with pytest.raises(KvjError, match="without tensor/pipeline parallelism"):
        scheduler(model, tp1, 2)
    assert not os.path.exists(os.path.join(tp1, "ranks.json"))


def test_a_shard_of_another_rank_or_parallel_size_never_loads(model: str, tmp_path: Any) -> None:
    from kvj.integrations.vllm.layout import block_layout

    cfg = config(model, str(tmp_path / "j"))
    rank0, rank1 = block_layout(cfg, "m", 0), block_layout(cfg, "m", 1)
    assert rank0.seed() == rank1.seed() and rank0.shape == (2, 1, BLOCK, 32)  # one of two KV heads
    with pytest.raises(LayoutMismatch, match="tp_rank=0 \\(expected 1\\)"):
        rank1.check(rank0.segment_layout(list(range(BLOCK + 1)), "ab" * 32), "segment s")
    tp1 = block_layout(config(model, str(tmp_path / "k"), 1), "m")
    assert tp1.seed() != rank0.seed()
    with pytest.raises(LayoutMismatch, match="tp_size=2 \\(expected 1\\)"):
        tp1.check(rank0.segment_layout(), "segment s")


def test_pipeline_parallel_ranks_hold_their_stage_s_layers(model: str, tmp_path: Any) -> None:
    """PP=2 x TP=2 without an engine (vLLM 0.32's CPU backend fails PP=2 in its second stage's
    worker, connector or not): four ranks, each stage one of the two layers, one seed."""
    from kvj.integrations.vllm.layout import block_layout

    cfg = config(model, str(tmp_path / "j"), 2, 2)
    layouts = {(t, p): block_layout(cfg, "m", t, p) for t in range(2) for p in range(2)}
    assert {lay.rank for lay in layouts.values()} == {0, 1, 2, 3} and layouts[(1, 1)].rank == 3
    assert {lay.seed() for lay in layouts.values()} == {layouts[(0, 0)].seed()}
    assert layouts[(0, 0)].stage == (0, 1) and layouts[(0, 1)].stage == (1, 2)
    assert layouts[(1, 1)].shape == (1, 1, BLOCK, 32)
    with pytest.raises(LayoutMismatch, match="pp_rank"):
        layouts[(0, 1)].check(layouts[(0, 0)].segment_layout(), "segment s")
    layouts[(0, 1)].check_caches([torch.zeros(4, 1, BLOCK, 32)])
    with pytest.raises(LayoutMismatch):
        layouts[(0, 1)].check_caches([torch.zeros(4, 1, BLOCK, 32)] * 2)
    assert scheduler(model, str(tmp_path / "pp"), 2, 2).scheduler._ranks == {0, 1, 2, 3}
