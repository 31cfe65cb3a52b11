"""The one layout check: what "a segment fits" means for the store, paged restore and KV blocks."""

import pytest

from kvj.errors import LayoutMismatch
from kvj.segments.layout import check_layout, layout_diff, layouts_match


def test_exact_match_after_canonicalisation():
    assert layouts_match({"model": "m", "shape": (1, 2)}, {"shape": [1, 2], "model": "m"})
    assert not layouts_match({"model": "m"}, {"model": "m", "block_size": 16})  # a field more is another layout
    assert layouts_match(None, {})  # no layout is the empty one: one key for one tensor however it is stored
    assert layouts_match(None, None)
    assert layout_diff({"model": "a", "x": 1}, {"model": "b"}) == ["model='a' (expected 'b')", "x=1 (expected None)"]


def test_only_the_named_fields_count_when_given():
    identity = {"format": "f", "model": "m"}
    assert layout_diff({**identity, "token_ids": [1, 2]}, identity, fields=("format", "model")) == []
    assert layout_diff({"format": "f"}, identity, fields=("format", "model")) == ["model=None (expected 'm')"]


def test_check_names_where_and_every_field():
    with pytest.raises(LayoutMismatch, match=r"segment 7 belongs to another layout: model='q' \(expected 'm'\), "
                                             r"head_dim=64 \(expected 128\)"):
        check_layout({"model": "q", "head_dim": 64}, {"model": "m", "head_dim": 128}, "segment 7",
                      fields=("model", "head_dim"))
    check_layout({"model": "m"}, {"model": "m"}, "segment 7")
