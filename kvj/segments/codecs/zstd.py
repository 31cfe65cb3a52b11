"""``zstd``: zstandard on the plain bytes, and the zstd helpers the other codecs share."""

from __future__ import annotations

import threading
from typing import Any, Tuple

import zstandard

from kvj.errors import FormatError
from kvj.segments.codecs.base import Buffer, Codec
from kvj.segments.codecs.registry import register

#: Largest zstd window a reader accepts (bounds decoder memory on hostile input).
MAX_WINDOW_LOG = 27

_local = threading.local()


def compressor(key: Tuple[Any, ...]) -> zstandard.ZstdCompressor:
    """A per-thread compressor for ``key`` (zstd contexts must not be shared across threads)."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(key)
    if comp is None:
        kind = key[0]
        if kind == "entropy":
            # Fast strategy, minimum-size hash table and 7-byte matches: almost no matches are
            # found, so the block is Huffman-coded literals, close to the order-0 entropy.
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=6, chain_log=6,
                search_log=1, window_log=17, target_length=0, write_content_size=True)
        else:
            _, level, long = key
            params = zstandard.ZstdCompressionParameters.from_level(
                level, enable_ldm=bool(long), window_log=MAX_WINDOW_LOG if long else 0,
                write_content_size=True)
        comp = cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor(max_window_size=1 << MAX_WINDOW_LOG)
    return dec


def _check_declared(data: Buffer, raw_len: int) -> None:
    """Refuse a frame whose header does not declare exactly ``raw_len`` bytes (before decoding)."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise FormatError(f"bad zstd frame: {exc}") from None
    if declared != raw_len:
        raise FormatError(f"zstd frame declares {declared} bytes, expected {raw_len}")


def zstd_decompress(data: Buffer, raw_len: int) -> bytes:
    """One zstd frame that must hold exactly ``raw_len`` bytes, its declared size checked first
    (a hostile frame cannot make the reader allocate more)."""
    _check_declared(data, raw_len)
    try:
        out = _decompressor().decompress(data, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd frame does not decode: {exc}") from None
    if len(out) != raw_len:
        raise FormatError(f"zstd frame decoded to {len(out)} bytes, expected {raw_len}")
    return out


def zstd_decompress_into(data: Buffer, out: memoryview) -> None:
    """:func:`zstd_decompress` straight into ``out``, which the frame must fill exactly (no copy)."""
    raw_len = len(out)
    _check_declared(data, raw_len)
    got = 0
    try:
        reader = _decompressor().stream_reader(data, read_size=max(1, len(data)))
        while got < raw_len:
            n = reader.readinto(out[got:])
            if not n:
                break
            got += n
        extra = reader.read(1) if got == raw_len else b""
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd frame does not decode: {exc}") from None
    if got != raw_len or extra:
        raise FormatError(f"zstd frame decoded to {got + len(extra)}{'+' if extra else ''} bytes, "
                          f"expected {raw_len}")


@register
class ZstdCodec(Codec):
    """zstandard on the plain bytes; ``long`` enables long-distance matching (large window)."""

    name = "zstd"

    def __init__(self, level: int = 3, long: bool = False) -> None:
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise FormatError(f"zstd level {level!r} out of range")
        super().__init__(level=level, long=bool(long))

    def encode(self, buf: memoryview, itemsize: int) -> Buffer:
        return compressor(("zstd", self.params["level"], self.params["long"])).compress(buf)

    def decode_into(self, data: memoryview, out: memoryview, itemsize: int) -> None:
        zstd_decompress_into(data, out)
