"""The codec and filter names, in one place, and the classes behind them (zarr-v3 style).

A header records a codec's ``name`` and ``params`` and a stored filter's field under its name;
these rebuild the exact codec and filter. kvj's own are imported on first use, so listing the
names (the CLI's ``--codec`` choices) or reading a header without a filter imports no numpy.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Mapping, Optional, Tuple, Type, TypeVar

from kvj.errors import FormatError
from kvj.segments.codecs.base import Codec, Filter

#: kvj's codecs: name -> the module that defines (and registers) it.
BUILTIN: Dict[str, str] = {
    "raw": "kvj.segments.codecs.raw",
    "zstd": "kvj.segments.codecs.zstd",
    "byteplane": "kvj.segments.codecs.byteplane",
}
#: Not a codec: resolves to one of the others per segment (``auto``).
AUTO = "auto"
#: kvj's filters stored in headers: name (their header field) -> the module that defines it.
FILTERS: Dict[str, str] = {
    "dedup": "kvj.segments.codecs.rowdedup",
}

_REGISTRY: Dict[str, Type[Codec]] = {}
_FILTERS: Dict[str, Type[Filter]] = {}
T = TypeVar("T")


def _find(table: Dict[str, T], builtin: Dict[str, str], name: Any, what: str) -> T:
    """The class registered as ``name`` in ``table``, importing kvj's own on first use."""
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None and isinstance(name, str) and name in builtin:
        importlib.import_module(builtin[name])
        cls = table.get(name)
    if cls is None:
        raise FormatError(f"unknown {what} {name!r}")
    return cls


def register(cls: Type[Codec]) -> Type[Codec]:
    """Add a codec class under its ``name`` (a class decorator)."""
    _REGISTRY[cls.name] = cls
    return cls


def get_codec(name: Any, params: Optional[Mapping[str, Any]] = None) -> Codec:
    """Build the codec ``name`` with ``params``; FormatError for unknown names or bad params."""
    cls = _find(_REGISTRY, BUILTIN, name, "codec")
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
    return _find(_FILTERS, FILTERS, name, "filter")


def filter_names() -> Tuple[str, ...]:
    """The header fields that name a filter: kvj's own first, then others."""
    return tuple(dict.fromkeys([*FILTERS, *_FILTERS]))
