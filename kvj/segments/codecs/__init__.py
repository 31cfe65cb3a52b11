"""Chunk codecs for segment payloads, one small module per codec behind one interface.

A codec (``base.Codec``) turns one chunk of raw tensor bytes into stored bytes and back. Its
``name`` and ``params`` go into the segment header, and ``registry.get_codec`` rebuilds the
exact codec from them (zarr-v3 style). Codecs are stateless and thread-safe: chunks of one
segment are encoded and decoded in parallel threads (zstandard and numpy release the GIL).

* ``raw``       (``raw.py``)       the bytes as they are;
* ``zstd``      (``zstd.py``)      zstandard at ``level``; ``long`` turns on long-distance matching;
* ``byteplane`` (``byteplane.py``) byte planes of floating-point elements, each coded on its own.

``rowdedup.py`` is a segment-level filter, not a chunk codec: it stores each distinct row of a
tensor once. ``auto.py`` picks a codec per segment from a cheap sample and steps down to
faster choices under backpressure. Codec names live in one place, ``registry.BUILTIN``.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvj.segments.codecs.base import Codec
from kvj.segments.codecs.registry import codec_names, get_codec, register

__all__ = ["Codec", "codec_names", "get_codec", "register", "Backpressure", "auto_codec", "RawCodec",
           "ZstdCodec", "BytePlaneCodec", "RowDedup", "ScatterPlan", "split_planes", "merge_planes",
           "zstd_decompress"]

#: Names served from their modules on first use (so ``codec_names`` imports no numpy).
_LAZY = {"Backpressure": "auto", "auto_codec": "auto", "RawCodec": "raw", "ZstdCodec": "zstd",
         "zstd_decompress": "zstd", "BytePlaneCodec": "byteplane", "split_planes": "byteplane",
         "merge_planes": "byteplane", "RowDedup": "rowdedup", "ScatterPlan": "rowdedup"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
