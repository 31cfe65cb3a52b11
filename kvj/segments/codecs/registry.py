"""The codec and filter registries: names, in one place, and the classes behind them (zarr-v3 style).

A segment header records a codec's ``name`` and ``params``; :func:`get_codec` rebuilds the
exact codec from them. A filter stored in a segment has a header field of its own name;
:func:`filter_class` finds the class that reads it. kvj's own codecs and filters are listed
in ``BUILTIN`` and ``FILTERS`` by name and imported on first use, so listing the names (the
CLI's ``--codec`` choices) or reading a header without a filter costs no numpy or zstd
import; :func:`register` and :func:`register_filter` add others.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Mapping, Optional, Tuple, Type

from kvj.errors import FormatError
from kvj.segments.codecs.base import Codec, Filter

#: kvj's codecs: name -> the module that defines (and registers) it.
BUILTIN: Dict[str, str] = {
    "raw": "kvj.segments.codecs.raw",
    "zstd": "kvj.segments.codecs.zstd",
    "byteplane": "kvj.segments.codecs.byteplane",
}
#: Not a codec: resolves to one of the others per segment (``kvj.segments.codecs.auto``).
AUTO = "auto"

#: kvj's filters stored in segment headers: name (its header field) -> the module that defines it.
FILTERS: Dict[str, str] = {
    "dedup": "kvj.segments.codecs.rowdedup",
}

_REGISTRY: Dict[str, Type[Codec]] = {}
_FILTERS: Dict[str, Type[Filter]] = {}


def register(cls: Type[Codec]) -> Type[Codec]:
    """Add a codec class to the registry under its ``name`` (a class decorator)."""
    _REGISTRY[cls.name] = cls
    return cls


def codec_class(name: Any) -> Type[Codec]:
    """The class registered as ``name``; FormatError for unknown names."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None and isinstance(name, str) and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
        cls = _REGISTRY.get(name)
    if cls is None:
        raise FormatError(f"unknown codec {name!r}")
    return cls


def get_codec(name: Any, params: Optional[Mapping[str, Any]] = None) -> Codec:
    """Build the codec ``name`` with ``params``; FormatError for unknown names or bad params."""
    cls = codec_class(name)
    if params is not None and not isinstance(params, (dict, Mapping)):  # dict first: typing's check is slow
        raise FormatError("codec params must be a map")
    try:
        return cls(**dict(params or {}))
    except TypeError as exc:
        raise FormatError(f"bad params for codec {name}: {exc}") from None


def codec_names() -> Tuple[str, ...]:
    """Every name a caller may ask for: ``auto`` first, then each codec."""
    return (AUTO,) + tuple(dict.fromkeys([*BUILTIN, *_REGISTRY]))


def register_filter(cls: Type[Filter]) -> Type[Filter]:
    """Add a filter class stored in segment headers under its ``name`` (a class decorator)."""
    _FILTERS[cls.name] = cls
    return cls


def filter_class(name: str) -> Type[Filter]:
    """The filter class whose header field is ``name``; FormatError for unknown names."""
    cls = _FILTERS.get(name)
    if cls is None and name in FILTERS:
        importlib.import_module(FILTERS[name])
        cls = _FILTERS.get(name)
    if cls is None:
        raise FormatError(f"unknown filter {name!r}")
    return cls


def filter_names() -> Tuple[str, ...]:
    """The header fields that name a filter: kvj's own first (in ``FILTERS`` order), then others."""
    return tuple(dict.fromkeys([*FILTERS, *_FILTERS]))
