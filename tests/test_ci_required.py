"""The ``ci_required`` marker (``support/ci_skips.py``): under CI=true a skip of a marked test
fails the run; elsewhere it stays a skip. Checked on a small suite run in a child pytest."""

from __future__ import annotations

import os
import subprocess
import sys

SUITE = '''
import pytest

@pytest.mark.ci_required
def test_needs_a_namespace():
    pytest.skip("this machine allows no private mount namespace (unshare -rm)")

@pytest.mark.ci_required
@pytest.mark.skipif(True, reason="this run is not root")
def test_needs_root():
    pass

@pytest.mark.ci_required
def test_runs():
    pass

def test_unmarked_skip():
    pytest.skip("optional")
'''


def run_suite(tmp_path, ci):
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "support.ci_skips", "-p", "no:cacheprovider", "-rfs",
                           "-q", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_a_skip_of_a_ci_required_test_fails(tmp_path):
    proc = run_suite(tmp_path, "true")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # a skip at setup (skipif, a fixture) becomes an error, one in the test a failure: both fail the run
    assert "1 failed, 1 passed, 1 skipped, 1 error" in proc.stdout, proc.stdout
    assert "unshare -rm" in proc.stdout and "this run is not root" in proc.stdout and "CI=true" in proc.stdout


def test_outside_ci_it_stays_a_skip(tmp_path):
    for ci in (None, "false", ""):
        proc = run_suite(tmp_path, ci)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "1 passed, 3 skipped" in proc.stdout, proc.stdout
