"""The one check of whether a segment fits where it is loaded: its layout (part of its digest)
against the expected one, so "fits" means one thing to the store, restore and the integrations."""

from __future__ import annotations

from typing import Iterable, List, Optional

from kvj.errors import LayoutMismatch
from kvj.segments.segfile import Layout, canonical_layout

_ABSENT = object()


def layout_diff(actual: Layout, expected: Layout, fields: Optional[Iterable[str]] = None) -> List[str]:
    """How ``actual`` differs from ``expected``: one ``key=value (expected value)`` per field; every
    field after canonicalisation (tuples equal lists), or only ``fields`` when given."""
    a, e = canonical_layout(actual), canonical_layout(expected)
    if fields is None:
        if a == e:
            return []
        if a is None or e is None:
            return [f"layout={a!r} (expected {e!r})"]
        fields = sorted(set(a) | set(e))
    a, e = a or {}, e or {}
    return [f"{k}={a.get(k)!r} (expected {e.get(k)!r})" for k in fields if a.get(k, _ABSENT) != e.get(k, _ABSENT)]


def layouts_match(actual: Layout, expected: Layout) -> bool:
    """Whether ``actual`` equals ``expected`` (see :func:`layout_diff`)."""
    return not layout_diff(actual, expected)


def check_layout(actual: Layout, expected: Layout, where: str, fields: Optional[Iterable[str]] = None) -> None:
    """Raise ``LayoutMismatch`` naming ``where`` and every differing field unless ``actual`` fits."""
    diff = layout_diff(actual, expected, fields)
    if diff:
        raise LayoutMismatch(f"{where} belongs to another layout: " + ", ".join(diff))
