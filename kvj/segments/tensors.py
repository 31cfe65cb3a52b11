"""Tensors and segment bytes: dtypes by header name, a tensor's bytes, copies, decoding into a tensor.

All of the segment format that needs torch: ``segfile`` imports none, so header-only commands start without it.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch

from kvj.errors import FormatError, InvalidArgument
from kvj.fileio import Buffer
from kvj.segments import segfile
from kvj.segments.source import Source, as_source

#: Every dtype with a fixed byte layout this torch has, by the name the header stores.
DTYPES: Dict[str, torch.dtype] = {name: getattr(torch, name) for name in segfile.ELEMENTS if hasattr(torch, name)}
DTYPE_NAMES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The header name of ``dtype``; FormatError for dtypes without a fixed byte layout."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} has no fixed byte layout kvj can store") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a header dtype name; FormatError when this torch lacks it."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r}") from None


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(tensor: torch.Tensor) -> Optional[np.ndarray]:
    """A CPU tensor as a numpy array of integers of its element size (same strides, no copy);
    None for 16-byte elements, which have no such integer."""
    words = _WORDS.get(tensor.element_size())
    return None if words is None else tensor.detach().view(words).numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for CPU tensors of one shape and dtype, by numpy as integers of the element
    size in this thread (torch copies strided bfloat16 element by element, and wakes threads)."""
    d, s = _words(dst), _words(src)
    if d is None or s is None:
        dst.copy_(src.detach())
    else:
        np.copyto(d, s)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order (copies only when it is not contiguous)."""
    dtype_name(tensor.dtype)
    if tensor.numel() == 0:
        return memoryview(b"")
    if tensor.is_contiguous():
        flat = tensor.detach().reshape(-1)
    else:
        flat = torch.empty(tensor.shape, dtype=tensor.dtype)
        copy_into(flat, tensor)
    return memoryview(flat.reshape(-1).view(torch.uint8).numpy()).cast("B")


def decode_into(data: Union[Buffer, Source], out: Optional[torch.Tensor] = None, *,
                name: str = "<segment>", pool: Optional[Executor] = None,
                max_raw: int = segfile.MAX_RAW_SIZE,
                header: Optional[segfile.Header] = None) -> Tuple[segfile.Header, torch.Tensor]:
    """Decode a whole segment file (``segfile.decode_into``: every CRC and the digest checked); its
    header and CPU tensor, a view of ``out`` when given (a contiguous uint8 CPU tensor of at least
    ``raw_size`` bytes, e.g. pinned staging). More than ``max_raw`` bytes are refused before any
    allocation; ``header`` is the segment's ``read_header`` when parsed already.
    """
    source = as_source(data, name)
    if header is None:
        header = segfile.read_header(source)
    dtype = torch_dtype(header.dtype)
    segfile.check_raw_limit(header, source.name, max_raw)
    if out is None:
        try:
            out = torch.from_numpy(np.empty(header.raw_size, np.uint8))  # numpy asks for huge pages
        except MemoryError:
            raise FormatError(f"{source.name} declares {header.raw_size} raw bytes: cannot allocate them") from None
    elif out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() \
            or out.numel() < header.raw_size:
        raise InvalidArgument("out must be a contiguous CPU uint8 tensor of at least raw_size bytes")
    out = out[:header.raw_size]
    raw = memoryview(out.numpy()).cast("B") if header.raw_size else memoryview(bytearray())
    segfile.decode_into(source, raw, pool=pool, header=header)
    if header.raw_size == 0:
        return header, torch.empty(header.shape, dtype=dtype)
    return header, out.view(dtype).reshape(header.shape)
