"""The XOR delta of a training stream against its base (kvj-segment(5) XOR DELTA): raw bits
XORed by the codecs' ``XorDelta`` filter, held as the integer type of the element's size."""

from __future__ import annotations

import torch

from kvj.errors import FormatError
from kvj.segments.codecs.xordelta import XorDelta
from kvj.segments.tensors import tensor_bytes

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def xorable(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements have an integer type to XOR as (16-byte ones, complex128, do not)."""
    return t.element_size() in _INT_OF_SIZE


def _xored(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a``'s bytes XOR ``b``'s, in a new tensor of ``dtype`` and ``a``'s shape."""
    if not a.numel():  # no bytes to view as ``dtype``
        return torch.empty(a.shape, dtype=dtype)
    return torch.from_numpy(XorDelta(tensor_bytes(b)).apply(tensor_bytes(a))).view(dtype).view(a.shape)


def xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise XOR of two same-shaped CPU tensors' raw bits, as an integer tensor."""
    if a.shape != b.shape or a.dtype != b.dtype or not xorable(a):
        raise FormatError(f"XOR of {tuple(a.shape)} {a.dtype} with {tuple(b.shape)} {b.dtype}")
    return _xored(a, b, _INT_OF_SIZE[a.element_size()])


def unxor(base: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Undo ``xor``: the tensor whose bits XORed with ``base``'s give ``bits``."""
    if not xorable(base) or bits.dtype != _INT_OF_SIZE[base.element_size()] or bits.shape != base.shape:
        raise FormatError(f"delta of {tuple(bits.shape)} {bits.dtype} does not fit {tuple(base.shape)} {base.dtype}")
    return _xored(bits, base, base.dtype)
