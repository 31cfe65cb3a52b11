"""The kvj process's end (``kvj.cli.launch``): a command that imported Triton (kvj demo and kvj
bench training do, through transformers' Trainer and torch's compiler) ends without ~30 lines
of "nanobind: leaked ..." on stderr (issue 41 item 12). The launcher froze the cycle collector
as the process ended, so Triton's objects, held in cycles, outlived the interpreter, and
Triton's bindings reported each as leaked after the command's last word."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.cli_helpers import env


def test_a_command_that_imported_triton_ends_quietly() -> None:
    pytest.importorskip("triton")
    code = "import sys, triton; from kvj.cli.launch import kvj; sys.argv = ['kvj', '--version']; kvj()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("kvj "), proc.stdout + proc.stderr
    assert proc.stderr == ""
