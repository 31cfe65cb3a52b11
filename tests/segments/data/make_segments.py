"""Writes segments-0.2/ (segment files as kvj wrote them before the byte layer and the codec
pipeline were split out) and segments-0.2.json (what each holds).

    python tests/segments/data/make_segments.py tests/segments/data

``TENSORS`` is also what ``tests/segments/test_stored_segments.py`` rebuilds to check that
today's code decodes those files to the same bytes and writes them again byte for byte.
"""

import hashlib
import json
import os
import shutil
import sys

import numpy as np
import torch


def _rng(seed):
    return np.random.default_rng(seed)


def small_floats():
    return torch.from_numpy(_rng(1).standard_normal((4, 16, 8)).astype(np.float32)).to(torch.float16)


def ints():
    return torch.from_numpy((np.arange(3000) % 97).astype(np.int32)).reshape(30, 100)


def kv_block():
    """A bfloat16 KV block of a small model: [layers, 2, block, heads, head_dim], 16 KiB."""
    x = _rng(2).standard_normal((2, 2, 16, 2, 64)).astype(np.float32)
    return torch.from_numpy(x).to(torch.bfloat16)


def multi_chunk():
    """float32 of few distinct values, 1.5 MiB: two chunks, compressible."""
    return torch.from_numpy(((np.arange(3 << 17) * 7) % 251).astype(np.float32) / 8)


def shared_prefix():
    """Eight requests' KV with the same 2,048 rows (a shared prefix), the last with some rows
    repeated from elsewhere and some new: 2 MiB raw, row dedup stores about an eighth."""
    rng = _rng(3)
    base = rng.integers(-2, 2, (2048, 64)).astype(np.float32)
    x = np.tile(base, (8, 1, 1))
    x[7, rng.choice(2048, 100, replace=False)] = base[rng.choice(2048, 100)]
    x[7, rng.choice(2048, 50, replace=False)] = rng.integers(-2, 2, (50, 64))
    return torch.from_numpy(x).to(torch.bfloat16)


def complex_values():
    return torch.from_numpy((_rng(4).standard_normal(64) + 1j * _rng(5).standard_normal(64)).astype(np.complex64))


def flags():
    return torch.from_numpy(_rng(6).integers(0, 2, 333).astype(bool))


def empty():
    return torch.zeros((0, 3), dtype=torch.float32)


#: name -> (tensor maker, codec, layout)
TENSORS = {
    "small-raw": (small_floats, "raw", {"model": "m", "n": 1}),
    "ints-zstd": (ints, "zstd", None),
    "kv-byteplane": (kv_block, "byteplane", {"kind": "paged_kv_block", "model": "m", "block_size": 16}),
    "kv-auto": (kv_block, "auto", {"kind": "paged_kv_block", "model": "m", "block_size": 16, "i": 2}),
    "multi-chunk-auto": (multi_chunk, "auto", None),
    "shared-prefix-dedup": (shared_prefix, "auto", {"model": "m", "rows": "shared"}),
    "complex-zstd": (complex_values, "zstd", None),
    "bool-auto": (flags, "auto", None),
    "empty-raw": (empty, "raw", {}),
}


def raw_sha256(tensor):
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return hashlib.sha256(data).hexdigest()


def main(out_dir):
    from kvj.segments.store import SegmentStore

    files = os.path.join(out_dir, "segments-0.2")
    shutil.rmtree(files, ignore_errors=True)
    os.makedirs(files)
    tmp = os.path.join(out_dir, "store.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    expected = {}
    with SegmentStore(tmp, threads=2) as store:
        for name, (make, codec, layout) in TENSORS.items():
            t = make()
            info = store.put(t, layout=layout, codec=codec)
            shutil.copyfile(store.backend.path(info.key), os.path.join(files, info.key + ".kvjseg"))
            expected[name] = {**info.to_dict(), "raw_sha256": raw_sha256(t)}
    shutil.rmtree(tmp)
    with open(os.path.join(out_dir, "segments-0.2.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
