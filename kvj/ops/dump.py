"""Dumping one segment to ``.npy``, ``.safetensors`` or ``.pt`` (as ``restic dump``): verified by
the store first, written durably, read back to check it holds exactly the segment's bytes.
Also here: finding a segment by a key prefix, and who in the journal refers to a segment.
"""

from __future__ import annotations

import io
import os
from typing import Any, Dict, List

from kvj.errors import FormatError, InvalidArgument, NotFound
from kvj.fileio import atomic_write
from kvj.journal.state import JournalState

FORMATS = (".npy", ".safetensors", ".pt")
#: A key prefix this short still names a segment among millions (16^8 = 4 billion).
MIN_PREFIX = 8


def resolve_key(store: Any, text: str) -> str:
    """The store's key that ``text`` is (or begins, at least ``MIN_PREFIX`` hex digits)."""
    text = text.strip().lower()
    if len(text) == 64:
        if not store.exists(text):
            raise NotFound(f"no segment {text} in the store {store.backend.root}")
        return text
    if len(text) < MIN_PREFIX or any(c not in "0123456789abcdef" for c in text):
        raise InvalidArgument(f"{text!r} is not a segment key or a prefix of at least {MIN_PREFIX} hex digits")
    found = [key for key in store.keys() if key.startswith(text)]
    if not found:
        raise NotFound(f"no segment key begins with {text} in the store {store.backend.root}")
    if len(found) > 1:
        raise InvalidArgument(f"{text} is the prefix of {len(found)} segment keys: give more digits")
    return found[0]


def segment_users(state: JournalState, key: str) -> List[Dict[str, Any]]:
    """Every live record that points at ``key``: request segments (with their token range)
    and training tensors."""
    users: List[Dict[str, Any]] = []
    for req in sorted(state.requests.values(), key=lambda r: r.start_lsn):
        for seg, ref in sorted(req.segments.items()):
            if ref.key == key:
                users.append({"request": req.id, "segment": seg, "tokens": list(ref.tokens) if ref.tokens else None,
                              "lsn": ref.lsn, "ended": req.ended})
    for entry in ([state.checkpoint] if state.checkpoint else []) + state.deltas:
        for name, k in entry["keys"].items():
            if k == key:
                users.append({"training_step": entry["step"], "tensor": name, "lsn": entry["lsn"]})
    return users


def _encode(tensor: Any, fmt: str, name: str) -> bytes:
    if fmt == ".pt":
        import torch

        buf = io.BytesIO()
        torch.save(tensor, buf)  # loads with torch.load(weights_only=True): a tensor, no code
        return buf.getvalue()
    if fmt == ".safetensors":
        try:
            from safetensors.torch import save
        except ImportError:
            raise InvalidArgument("writing .safetensors needs the safetensors package (pip install safetensors); "
                                  ".pt and .npy need nothing more") from None
        return save({name: tensor})
    import numpy

    try:
        array = tensor.numpy()
    except TypeError:
        raise InvalidArgument(f"numpy has no {str(tensor.dtype).replace('torch.', '')} type: dump to .safetensors "
                              "or .pt instead") from None
    buf = io.BytesIO()
    numpy.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _read_back(path: str, fmt: str, name: str) -> Any:
    import torch

    if fmt == ".pt":
        return torch.load(path, map_location="cpu", weights_only=True)
    if fmt == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path, device="cpu")[name]
    import numpy

    return torch.from_numpy(numpy.load(path, allow_pickle=False))


def _same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality (NaN payloads and signed zeros included)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    flat_a, flat_b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(flat_a, flat_b)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def dump_segment(store: Any, key: str, path: str, name: str = "tensor") -> Dict[str, Any]:
    """Write segment ``key`` (read and verified by ``store``) to ``path``; the suffix picks the
    format. Returns what was written; ``FormatError`` if the file does not read back equal."""
    fmt = os.path.splitext(path)[1].lower()
    if fmt not in FORMATS:
        raise InvalidArgument(f"{path}: write .npy, .safetensors or .pt")
    # Checked first in a chunk's memory (header against key, chunk CRCs, digest), so a small
    # file whose header declares gigabytes (a zstd bomb) is refused before they are allocated.
    store.verify(key)
    tensor = store.get(key)
    data = _encode(tensor, fmt, name)
    atomic_write(path, data, mode=0o644)
    if not _same(_read_back(path, fmt, name), tensor):
        raise FormatError(f"{path} does not read back as segment {key}")
    return {"key": key, "path": os.path.abspath(path), "format": fmt[1:], "name": name,
            "dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape),
            "raw_size": tensor.numel() * tensor.element_size(), "bytes": len(data), "verified": True}
