"""KvjConnector against the vLLM release this process imports (0.32 here; 0.33 and 0.34 through
``test_vllm_releases.py``, which runs this file under each): the releases accepted, every hook
against that release's ``KVConnectorBase_V1`` (and a call site in its code), sleep mode refused,
the scheduler side on its own ``Request`` objects (0.34: ``TokenBuffer`` token ids), the model
runner recognised (V1, V2, or named in one warning) and Model Runner V2's seeded sampling of a
resumed request run by Triton's interpreter."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from array import array
from typing import Any, Dict, List

import pytest
import torch

from kvj.errors import KvjError

from support.vllm_config import BLOCK, engine_config, no_step, scheduled, scheduler, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
#: Public methods of KvjConnector that are kvj's own, not vLLM hooks.
KVJ_ONLY = {"learn"}
#: Hooks vLLM added after 0.32: (release, hook).
LATER_HOOKS = {"supports_sleep_mode": (0, 33)}
#: No-op hooks kvj must define (abstract) but whose call sites do not matter to it.
NO_OPS = {"wait_for_layer_load", "save_kv_layer", "wait_for_save"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("model")))


def release() -> tuple:
    from kvj.integrations.vllm.compat import version_tuple

    return version_tuple()


def test_vllm_0_32_to_0_34_are_accepted_and_no_other() -> None:
    from kvj.integrations.vllm.compat import check_version

    for ok in ("0.32.0+cpu", "0.32.1", "0.33.0", "0.34.0", "0.34.2rc1"):
        check_version(ok)
    for bad in ("0.31.2", "0.35.0", "1.0.0", "dev"):
        with pytest.raises(KvjError, match=f"supports vLLM 0.32 to 0.34, this is vLLM {bad}") as err:
            check_version(bad)
        assert "\n" not in str(err.value)
    check_version()  # the one imported here


def _hooks() -> List[str]:
    from kvj.integrations.vllm import KvjConnector

    return sorted(name for name, value in vars(KvjConnector).items()
                  if not name.startswith("_") and name not in KVJ_ONLY
                  and (inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod))))


def test_every_hook_matches_this_releases_base_class() -> None:
    """Each hook KvjConnector defines is one of this release's ``KVConnectorBase_V1`` (a method vLLM
    does not have is never called), with the same parameters (names, kinds, defaults) and the same
    kind of method; no abstract method is left unimplemented."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorWorkerMetadata

    from kvj.integrations.vllm import KvjConnector, KvjWorkerMetadata

    def shape(cls: type, name: str) -> Any:
        params = inspect.signature(getattr(cls, name)).parameters.values()
        return type(inspect.getattr_static(cls, name)).__name__, [(p.name, p.kind, p.default) for p in params]

    checked = []
    for name in _hooks():
        if release() < LATER_HOOKS.get(name, (0, 0)):
            assert not hasattr(KVConnectorBase_V1, name)
            continue
        assert hasattr(KVConnectorBase_V1, name), f"{name} is not a hook of this vLLM's KVConnectorBase_V1"
        assert shape(KvjConnector, name) == shape(KVConnectorBase_V1, name), name
        checked.append(name)
    assert not inspect.isabstract(KvjConnector), KvjConnector.__abstractmethods__
    assert set(KVConnectorBase_V1.__abstractmethods__) <= set(checked)
    assert not inspect.isabstract(KvjWorkerMetadata)
    assert shape(KvjWorkerMetadata, "aggregate") == shape(KVConnectorWorkerMetadata, "aggregate")
    assert {"register_kv_caches", "handle_preemptions", "build_connector_meta", "on_new_request"} <= set(checked)


def test_each_hook_kvj_relies_on_is_called_by_this_release() -> None:
    """vLLM's own code (outside the base class's definitions) calls every hook kvj does work in."""
    import vllm

    calls = set()
    hooks = [h for h in _hooks() if h not in NO_OPS and release() >= LATER_HOOKS.get(h, (0, 0))]
    for folder, _, files in os.walk(os.path.dirname(vllm.__file__)):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f), encoding="utf-8", errors="replace") as src:
                    text = src.read()
                calls.update(h for h in hooks if f".{h}(" in text)
    assert calls == set(hooks), f"never called by vLLM {vllm.__version__}: {sorted(set(hooks) - calls)}"


def test_sleep_mode_is_refused(model: str, tmp_path: Any) -> None:
    """vLLM 0.33 and later ask the connector; with sleep mode on, vLLM refuses the engine."""
    from kvj.integrations.vllm import KvjConnector

    config = engine_config(model, str(tmp_path / "j"))
    assert KvjConnector.supports_sleep_mode(config.kv_transfer_config) is False
    if release() < (0, 33):
        return
    object.__setattr__(config.model_config, "enable_sleep_mode", True)  # the CPU platform refuses it before
    with pytest.raises(ValueError, match="KvjConnector does not support sleep mode"):
        config._verify_kv_transfer_compat()


def test_the_scheduler_side_journals_this_releases_requests(model: str, tmp_path: Any) -> None:
    """vLLM's own Request (0.34: token ids in a ``TokenBuffer``, an ``array('i')``): START, TOKENS
    and the blocks' token ids go out as lists of ints (JSON), chain keys match, a finish reports."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from kvj.integrations.vllm import KvjWorkerMetadata
    from kvj.segments.kvblock import chain_keys

    conn = scheduler(model, str(tmp_path / "j"))
    prompt = list(range(3 * BLOCK + 5))
    r = Request("r1", prompt, SamplingParams(max_tokens=8, seed=3), None)
    if release() >= (0, 34):
        assert isinstance(r.prompt_token_ids, array) and type(r.prompt_token_ids).__name__ == "TokenBuffer"
    conn.on_new_request(r)
    plan = conn.build_connector_meta(no_step())
    (start,) = plan.starts
    assert type(start.tokens) is list and start.tokens == prompt and json.loads(json.dumps(start.tokens)) == prompt
    json.dumps(start.meta)
    ids = {"r1": [4, 9, 2, 7, 5]}
    conn.build_connector_meta(scheduled(ids, {"r1": 2 * BLOCK}))
    r.num_computed_tokens = 2 * BLOCK
    plan = conn.build_connector_meta(scheduled(ids, {"r1": BLOCK + 5}))
    assert [(s.block, s.block_id) for s in plan.saves] == [(0, 4), (1, 9)]
    assert all(type(s.token_ids) is list for s in plan.saves)
    assert plan.saves[1].token_ids == prompt[BLOCK:2 * BLOCK + 1]
    assert [s.chain for s in plan.saves] == chain_keys(conn.layout.seed(), prompt, BLOCK)[:2]
    r.num_computed_tokens = 3 * BLOCK + 5
    r.append_output_token_ids([200, 201])
    plan = conn.build_connector_meta(scheduled(ids, {"r1": 1}))
    assert plan.tokens == [(start.jid, len(prompt), [200, 201])] and type(plan.tokens[0][2][0]) is int
    assert [(s.block, s.token_ids[-1]) for s in plan.saves] == [(2, prompt[3 * BLOCK])]
    durable = chain_keys(conn.layout.seed(), prompt, BLOCK)[:2]
    conn.update_connector_output(_output(KvjWorkerMetadata(durable={c: [0] for c in durable})))
    again = Request("r2", prompt + [200], SamplingParams(max_tokens=4), None)
    conn.on_new_request(again)
    assert conn.get_num_new_matched_tokens(again, 0) == (2 * BLOCK, True)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = conn.request_finished(r, ids["r1"])
    assert hold and params is not None
    plan = conn.build_connector_meta(no_step())
    assert [f.vllm_id for f in plan.finishes] == ["r1"] and [s.vllm_id for s in plan.starts] == ["r2"]


def test_token_ids_in_a_plain_array_are_journaled_as_lists(model: str, tmp_path: Any) -> None:
    """A plain ``array('i')`` (its slices are arrays, ``array + list`` raises): START, TOKENS and the
    blocks' token ids are lists of ints all the same."""
    import types

    from kvj.integrations.vllm.compat import token_ids

    assert token_ids(None) == [] and token_ids(array("i", [1, 2])) == [1, 2]
    conn = scheduler(model, str(tmp_path / "j"))
    tokens = array("i", range(2 * BLOCK + 3))
    r = types.SimpleNamespace(request_id="a", all_token_ids=tokens, prompt_token_ids=array("i", tokens),
                              num_tokens=len(tokens), num_computed_tokens=0, sampling_params=None)
    conn.on_new_request(r)
    (start,) = conn.build_connector_meta(no_step()).starts
    assert type(start.tokens) is list and start.tokens == list(range(2 * BLOCK + 3))
    r.num_computed_tokens = 2 * BLOCK + 3
    tokens.append(250)
    plan = conn.build_connector_meta(scheduled({"a": [6, 1, 8]}, {"a": 1}))
    assert plan.tokens == [(start.jid, 2 * BLOCK + 3, [250])]
    assert [s.token_ids for s in plan.saves] == [list(range(BLOCK + 1)), list(range(BLOCK, 2 * BLOCK + 1))]
    assert all(type(t) is int for s in plan.saves for t in s.token_ids)


def _output(news: Any) -> Any:
    import types

    return types.SimpleNamespace(kv_connector_worker_meta=news, invalid_block_ids=set())


# ---------------------------------------------------------------------------- model runners


class _Logged:
    """Stands in for the connector's logger: records what it is asked to log."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self._once: set = set()

    def warning_once(self, msg: str, *args: Any) -> None:
        if msg not in self._once:
            self._once.add(msg)
            self.lines.append(msg % args if args else msg)

    def __getattr__(self, level: str) -> Any:
        return lambda msg, *args, **kw: self.lines.append(msg % args if args else msg)


def _runner_class(module: str, name: str = "GPUModelRunner") -> type:
    """A subclass of vLLM's real runner class that registers the connector's caches as the runner does."""
    base = getattr(importlib.import_module(module), name)

    def __init__(self: Any) -> None:  # no device: only the class is vLLM's
        pass

    def initialize_kv_cache(self: Any, connector: Any, caches: Dict[str, torch.Tensor]) -> None:
        connector.register_kv_caches(caches)

    return type("TestModelRunner", (base,), {"__init__": __init__, "initialize_kv_cache": initialize_kv_cache})


def _register_from(runner: Any, model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvj.integrations.vllm import KvjConnector
    from kvj.integrations.vllm import connector as module

    logged = _Logged()
    monkeypatch.setattr(module, "logger", logged)
    conn = KvjConnector(engine_config(model, str(tmp_path / "j")), KVConnectorRole.WORKER, None)
    caches = {f"l{i}": torch.zeros(4, 2, BLOCK, 32) for i in range(2)}
    try:
        runner.initialize_kv_cache(conn, caches) if runner is not None else conn.register_kv_caches(caches)
    finally:
        conn.shutdown()
    return conn, logged.lines


def test_model_runner_v2_is_recognised_and_nothing_is_replayed(model: str, tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Model Runner V2 (vLLM's CUDA default) no warning that seeded requests diverge, and a
    resumed seeded request's sampler is left as it is (V2 keys its noise on the absolute position)."""
    from kvj.integrations.vllm.compat import V2

    runner = _runner_class("vllm.v1.worker.gpu.model_runner")()
    conn, lines = _register_from(runner, model, tmp_path, monkeypatch)
    assert conn._runner.kind == V2 and "TestModelRunner" in conn._runner.name
    assert lines == []
    conn._runner.advance({"r1": 5})  # nothing to do, nothing touched


def test_model_runner_v1_is_recognised_and_replays_its_samplers_draws(model: str, tmp_path: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Model Runner V1 (0.32, 0.33) a resumed request's generator is advanced as far as
    vLLM's own V1 sampler (here in its CPU form with fp64 noise, which needs no compiled op) takes
    it for the same number of tokens."""
    if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None:
        pytest.skip(f"vLLM {'.'.join(map(str, release()))} has no Model Runner V1")  # 0.34 removed it
    import types

    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from kvj.integrations.vllm.compat import V1

    sampler = TopKTopPSampler(use_fp64_gumbel=True)
    runner = _runner_class("vllm.v1.worker.gpu_model_runner")()
    runner.sampler = types.SimpleNamespace(topk_topp_sampler=sampler)
    runner.model_config = types.SimpleNamespace(get_vocab_size=lambda: 256)
    generator = torch.Generator().manual_seed(3)
    runner.requests = {"r1": types.SimpleNamespace(generator=generator)}
    conn, lines = _register_from(runner, model, tmp_path, monkeypatch)
    assert conn._runner.kind == V1 and lines == []
    conn._runner.advance({"r1": 2, "gone": 1})
    uninterrupted = torch.Generator().manual_seed(3)
    for _ in range(2):
        sampler(torch.randn(1, 256), {0: uninterrupted}, None, None)
    assert torch.equal(generator.get_state(), uninterrupted.get_state())


def test_an_unrecognised_model_runner_is_named_once(model: str, tmp_path: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    class MysteryModelRunner:
        def initialize_kv_cache(self, connector: Any, caches: Dict[str, torch.Tensor]) -> None:
            connector.register_kv_caches(caches)

    _, lines = _register_from(MysteryModelRunner(), model, tmp_path, monkeypatch)
    (line,) = lines
    assert "MysteryModelRunner" in line and "not recognised" in line and "\n" not in line


def test_model_runner_v2_continues_a_resumed_seeded_request() -> None:
    """V2's own kernels (positions, input ids and logits indices, Gumbel sampling), run by Triton's
    interpreter on the CPU: a seeded request resumed as ``resume`` resumes it (prompt + the tokens
    it had, its first block loaded, another batch slot, nothing done to its sampler) draws the
    tokens of the uninterrupted run; another seed and greedy decoding draw others."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (vLLM's CPU build brings it, through xgrammar)")
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed {seed}")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "vllm_v2_sampling.py"), str(seed)],
                          env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["sampler_pos"] == "pos = input_batch.positions[input_batch.logits_indices]"
    assert got["resumed"] == got["whole"], seed
    assert got["whole"] != got["greedy"] and got["whole"] != got["reseeded"], seed
