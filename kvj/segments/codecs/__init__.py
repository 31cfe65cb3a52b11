"""How segment bytes are encoded: filters, then a chunk codec, behind one interface each.

A chunk codec (``base.Codec``) turns one chunk of raw tensor bytes into stored bytes and back.
A filter (``base.Filter``) transforms a segment's whole raw bytes before they are chunked
(zarr v3's filters are codecs too). Their names and parameters go into the segment header,
and ``registry`` rebuilds the exact codec and filter from them. Codecs are stateless and
thread-safe: chunks of one segment are encoded and decoded in parallel threads (zstandard and
numpy release the GIL).

* ``raw``       (``raw.py``)       the bytes as they are;
* ``zstd``      (``zstd.py``)      zstandard at ``level``; ``long`` turns on long-distance matching;
* ``byteplane`` (``byteplane.py``) byte planes of floating-point elements, each coded on its own;
* filter ``dedup`` (``rowdedup.py``) stores each distinct row of a tensor once;
* filter ``xor``   (``xordelta.py``) XOR against a base of the same size (its caller keeps the base).

``auto.choose`` picks a segment's pipeline (``base.Pipeline``): the filter from a cheap sample,
the codec by name or (``auto``) from a sample, stepping down to faster choices under
backpressure. Names live in one place, ``registry.BUILTIN`` and ``registry.FILTERS``.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvj.segments.codecs.base import Backpressure, Codec, Element, Filter, Pipeline
from kvj.segments.codecs.registry import codec_names, filter_class, get_codec, register, register_filter

__all__ = ["Backpressure", "Codec", "Element", "Filter", "Pipeline", "codec_names", "filter_class", "get_codec",
           "register", "register_filter", "choose", "auto_codec", "RawCodec", "ZstdCodec", "BytePlaneCodec",
           "RowDedup", "RowDedupFilter", "ScatterPlan", "XorDelta", "split_planes", "merge_planes",
           "zstd_decompress"]

#: Names served from their modules on first use (so ``codec_names`` imports no numpy).
_LAZY = {"choose": "auto", "auto_codec": "auto", "RawCodec": "raw", "ZstdCodec": "zstd",
         "zstd_decompress": "zstd", "BytePlaneCodec": "byteplane", "split_planes": "byteplane",
         "merge_planes": "byteplane", "RowDedup": "rowdedup", "RowDedupFilter": "rowdedup",
         "ScatterPlan": "rowdedup", "XorDelta": "xordelta"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
