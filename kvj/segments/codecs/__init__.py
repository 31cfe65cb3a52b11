"""How segment bytes are encoded: an optional filter over a segment's raw bytes, then a chunk codec.

``base`` holds the interfaces, ``registry`` the names (a header's codec and filter fields are
rebuilt from them), ``auto`` the choice per segment. The codecs: ``raw``, ``zstd``, ``byteplane``
(byte planes of floats, each coded on its own); the filters: ``rowdedup`` (each distinct row
once, stored in headers) and ``xordelta`` (against a base its caller keeps).
"""

from kvj.segments.codecs.base import Backpressure, Codec, Element, Filter, Pipeline
from kvj.segments.codecs.registry import codec_names, get_codec

__all__ = ["Backpressure", "Codec", "Element", "Filter", "Pipeline", "codec_names", "get_codec"]
