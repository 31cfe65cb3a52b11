#!/usr/bin/env python3
"""kvj's GPU check: one prepared command that runs kvj's CUDA paths on a GPU and says PASS or FAIL
(what it checks and how to run it: scripts/gpu/__init__.py; ``--help``)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (HERE, os.path.dirname(HERE)):  # the checks (scripts/gpu/), and kvj from this checkout
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpu.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
