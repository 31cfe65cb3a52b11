"""``python tests/support/fakecuda_run.py MODULE ARGS...``: run MODULE as ``__main__`` with the
strict CUDA stand-in installed, so a workload process of the GPU end-to-end test runs its
``--device cuda:0`` paths on a machine without a GPU."""

from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for support

import pytest  # noqa: E402

from support.fakecuda import FakeCuda  # noqa: E402


def main() -> None:
    FakeCuda(devices=1).install(pytest.MonkeyPatch())  # for the whole process: never undone
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
