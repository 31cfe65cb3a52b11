"""The byte layer imports no torch: ``kvj status``, ``kvj inspect --stats`` and ``kvj fsck -n``
(reading every segment in full, the row-dedup filter and byte planes among them) run, each in a
fresh interpreter, without torch ever being imported."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kvj.journal.journal import Journal
from kvj.segments import segfile
from kvj.segments.store import SegmentStore

#: Runs ``kvj ARGS``, then prints the torch modules the process loaded as the last stderr line.
_CHILD = ("import sys\n"
          "from kvj.cli.main import app, run\n"
          "try:\n"
          "    status = run(app, sys.argv[1:], 'kvj')\n"
          "finally:\n"
          "    loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
          "    sys.stderr.write('\\nmodules ' + ' '.join(loaded) + '\\n')\n"
          "sys.exit(status)\n")


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("torchfree") / "j")
    g = torch.Generator().manual_seed(23)
    block = torch.randn(2, 2, 16, 2, 64, generator=g).to(torch.bfloat16)
    prefix = torch.randint(-2, 2, (1, 2048, 64), generator=g).float().to(torch.bfloat16)
    shared = prefix.repeat(8, 1, 1)  # 2 MiB of repeated rows: the dedup filter
    with SegmentStore(os.path.join(path, "segments")) as store:
        infos = [store.put(t, layout={"m": i}, codec=codec)
                 for i, (t, codec) in enumerate([(block, "auto"), (shared, "auto"), (torch.arange(10), "raw")])]
        assert segfile.read_header(store.read_stored(infos[1].key)).filter == "dedup"
    assert [i.codec for i in infos] == ["byteplane", "byteplane", "raw"]
    with Journal.open(path) as j:
        j.start("r1", tokens=[1, 2, 3])
        for i, info in enumerate(infos):
            j.flush("r1", i, token_range=(16 * i, 16 * i + 16), info=info).result()
        j.sync()
    return path


def _kvj(*args):
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("modules"), proc.stderr
    return proc.returncode, proc.stdout, lines[-1].split()[1:]


def test_status_imports_no_torch(journal):
    status, out, torch_modules = _kvj("status", "-j", journal, "--json")
    assert status == 0 and json.loads(out)["store"]["segments"] == 3
    assert torch_modules == []


def test_inspect_stats_imports_no_torch(journal):
    status, out, torch_modules = _kvj("inspect", "--stats", "-j", journal, "--json")
    assert status == 0 and json.loads(out)["by_type"]["segment"]["count"] == 3
    assert torch_modules == []


def test_fsck_reading_every_segment_imports_no_torch(journal):
    status, out, torch_modules = _kvj("fsck", "-n", "-j", journal, "--json")
    result = json.loads(out)
    assert status == 0 and result["data_verified"] == 3 and result["exit_code"] == 0
    assert torch_modules == []
