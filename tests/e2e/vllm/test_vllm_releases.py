"""The connector against each vLLM release it supports besides the installed one (0.33, 0.34):
the scheduler-side tests and the hook checks run with that release's own Python imported
(``support/vllm_releases.py``: its wheel's ``vllm/**.py``, fetched once with ``pip download
--no-deps``). The installed 0.32 runs the same files directly, and its real-engine tests."""

from __future__ import annotations

import re

import pytest

from support import vllm_releases

FILES = ["tests/e2e/vllm/test_vllm_compat.py", "tests/e2e/vllm/test_vllm_config.py",
         "tests/e2e/vllm/test_vllm_keys_and_plans.py"]


@pytest.mark.ci_required
@pytest.mark.parametrize("version", vllm_releases.RELEASES)
def test_the_connector_against_vllm_release(version: str) -> None:
    try:
        vllm_releases.fetch(version)
    except vllm_releases.Unavailable as exc:
        pytest.skip(str(exc))
    proc = vllm_releases.pytest_under(version, ["-p", "no:cacheprovider", "-q", "-rs", *FILES])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-12000:]
    skipped = re.findall(r"SKIPPED \[\d+\] \S+: (.*)", out)
    expected = ["vLLM 0.34 has no Model Runner V1"] if version >= "0.34" else []
    assert skipped == expected, out[-4000:]
    print(out.strip().splitlines()[-1])
