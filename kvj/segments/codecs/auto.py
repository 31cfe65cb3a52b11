"""How a segment is encoded: :func:`choose` picks its pipeline (row dedup or none, then the chunk
codec; ``auto`` from a cheap sample), stepping down under backpressure (CODEC CHOICE).

The codecs are imported where they are tried: a store that only reads headers loads no numpy.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Hashable, List, Optional, Tuple, Union

from kvj.segments.codecs.base import Backpressure, Codec, Element, Pipeline
from kvj.segments.codecs.raw import RawCodec
from kvj.segments.codecs.registry import AUTO, get_codec


#: Minimum sampled ratio for compression to be worth its CPU, by pressure level.
_MIN_GAIN = {Backpressure.NORMAL: 1.03, Backpressure.BUSY: 1.15}
_SAMPLE_SLICE = 64 << 10
_SAMPLE_SLICES = 4


def _sample(buf: memoryview, itemsize: int) -> memoryview:
    n = len(buf)
    if n <= _SAMPLE_SLICE * _SAMPLE_SLICES:
        return buf
    step = (n - _SAMPLE_SLICE) // (_SAMPLE_SLICES - 1)
    parts = [buf[(i * step) // itemsize * itemsize:][:_SAMPLE_SLICE] for i in range(_SAMPLE_SLICES)]
    return memoryview(b"".join(parts))


def auto_codec(buf: memoryview, itemsize: int, is_float: bool, pressure: int = 0) -> Codec:
    """A codec for one segment from a sample of at most 256 KiB: byte planes (for floats, chosen per
    plane), zstd or raw, whichever is smallest; raw unless one saves ``_MIN_GAIN`` (more under pressure)."""
    from kvj.segments.codecs.byteplane import BytePlaneCodec, split_planes
    from kvj.segments.codecs.zstd import ZstdCodec, compressor

    if pressure >= Backpressure.SATURATED or len(buf) < 4096:
        return RawCodec()
    sample = _sample(buf, itemsize)
    n = len(sample)
    best: Codec = RawCodec()
    best_size = n / _MIN_GAIN[pressure]
    zsize = len(compressor(("zstd", 1, False)).compress(sample))
    if zsize < best_size:
        best, best_size = ZstdCodec(level=1), zsize
    if itemsize > 1 or is_float:
        modes, total = [], 0
        for plane in split_planes(sample, itemsize, is_float):
            raw = len(plane)
            esize = len(compressor(("entropy",)).compress(plane))
            zsz = len(compressor(("zstd", 1, False)).compress(plane)) if pressure == 0 else raw
            choice, size = min((("r", raw), ("e", esize), ("z", zsz)), key=lambda t: t[1])
            if size > raw * 0.98:
                choice, size = "r", raw
            modes.append(choice)
            total += size
        if total < best_size and set(modes) != {"r"}:
            best, best_size = BytePlaneCodec("".join(modes), fp=is_float, level=1), total
    return best


def choose(raw: memoryview, element: Element, shape: Tuple[int, ...], *, codec: Union[str, Codec] = AUTO,
           pressure: int = Backpressure.NORMAL, dedup: Optional[bool] = None,
           memo: Optional["AutoChoices"] = None) -> Pipeline:
    """The pipeline for one segment's raw bytes.

    ``codec`` is a registered name (with ``element``'s defaults), a :class:`Codec` or ``auto``
    (:func:`auto_codec`, remembered for like segments in ``memo``). Row dedup runs when ``dedup``
    says so; by default when the segment is large enough, the flush path not backed up and a
    sample of its rows repeats.
    """
    from kvj.segments.codecs.rowdedup import RowDedupFilter

    if isinstance(codec, Codec):
        chosen = codec
    elif codec == AUTO:
        chosen = memo.choose(raw, element.word, element.is_float, pressure, (element.name, shape)) \
            if memo is not None else auto_codec(raw, element.word, element.is_float, pressure)
    else:
        chosen = get_codec(codec, default_params(codec, element))
    rows = None
    if dedup is None and pressure == Backpressure.NORMAL:
        rows = RowDedupFilter.for_segment(raw, shape, element.itemsize, sample=True)
    elif dedup:
        rows = RowDedupFilter.for_segment(raw, shape, element.itemsize, sample=False)
    return Pipeline(chosen, rows)


def default_params(name: str, element: Element) -> Dict[str, Any]:
    """Parameters of codec ``name`` when only its name is given (byte planes by element)."""
    if name == "byteplane":
        top = "e" if element.is_float else "z"
        return {"planes": "r" * (element.word - 1) + top, "fp": element.is_float}
    return {}


class AutoChoices:
    """``auto`` for a stream of small segments: one sample serves the next ``REUSE`` segments of
    the same kind (dtype and shape) at the same backpressure level.

    Sampling a small segment costs about as much as compressing it, and one model's blocks are
    alike; segments over ``SMALL`` bytes are sampled each time (their sample is a small part).
    """

    REUSE = 64
    SMALL = 2 << 20
    MAX_KINDS = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chosen: Dict[Hashable, List[Any]] = {}  # key -> [codec, uses left]

    def choose(self, buf: memoryview, itemsize: int, is_float: bool, pressure: int, kind: Hashable) -> Codec:
        """:func:`auto_codec` of ``buf``, or the choice made for a like segment recently."""
        if len(buf) > self.SMALL:
            return auto_codec(buf, itemsize, is_float, pressure)
        key = (kind, pressure)
        with self._lock:
            entry = self._chosen.get(key)
            if entry is not None and entry[1] > 0:
                entry[1] -= 1
                return entry[0]
        codec = auto_codec(buf, itemsize, is_float, pressure)
        with self._lock:
            if len(self._chosen) >= self.MAX_KINDS:
                self._chosen.clear()
            self._chosen[key] = [codec, self.REUSE - 1]
        return codec
