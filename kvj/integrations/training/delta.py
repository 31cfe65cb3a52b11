"""The XOR delta of a training stream against its base (``kvj-train-xor/1``, kvj-segment(5)
XOR DELTA): the raw bits of both XORed, held as the integer type of the element's size."""

from __future__ import annotations

import torch

from kvj.errors import FormatError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def xorable(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements have an integer type to XOR as (16-byte ones, complex128, do not)."""
    return t.element_size() in _INT_OF_SIZE


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as a same-sized integer tensor (a view, no copy)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise XOR of two same-shaped tensors' raw bits, as an integer tensor."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise FormatError(f"XOR of {tuple(a.shape)} {a.dtype} with {tuple(b.shape)} {b.dtype}")
    return torch.bitwise_xor(_bits(a), _bits(b))


def unxor(base: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Undo ``xor``: the tensor whose bits XORed with ``base``'s give ``bits``."""
    if bits.dtype != _INT_OF_SIZE[base.element_size()] or bits.shape != base.shape:
        raise FormatError(f"delta of {tuple(bits.shape)} {bits.dtype} does not fit {tuple(base.shape)} {base.dtype}")
    return torch.bitwise_xor(_bits(base), bits).view(base.dtype)
