"""``raw``: the bytes as they are."""

from __future__ import annotations

from kvj.errors import FormatError
from kvj.segments.codecs.base import Buffer, Codec
from kvj.segments.codecs.registry import register


@register
class RawCodec(Codec):
    """Stores the bytes unchanged."""

    name = "raw"

    def __init__(self) -> None:
        super().__init__()

    def encode(self, buf: memoryview, itemsize: int) -> Buffer:
        return buf

    def decode_into(self, data: memoryview, out: memoryview, itemsize: int) -> None:
        if len(data) != len(out):
            raise FormatError(f"raw chunk holds {len(data)} bytes, expected {len(out)}")
        out[:] = data
