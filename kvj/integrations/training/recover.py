"""Recovering training state: the journal's checkpoint XOR its newest readable delta (a
damaged delta falls back to the one before it, ``RecoveredState.fallback`` says why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple, Union

import torch

from kvj.errors import FormatError, SegmentCorrupt, SegmentMissing
from kvj.integrations.training.delta import unxor
from kvj.integrations.training.host import Capture, materialize, parse_document
from kvj.integrations.training.journal import STREAM_PREFIX, TREE
from kvj.journal.state import JournalState
from kvj.segments import device as cuda
from kvj.segments.tensors import DTYPES

if TYPE_CHECKING:
    from kvj.segments.store import SegmentStore


@dataclass
class RecoveredState:
    """Training state rebuilt from the journal: ``state``, as saved after ``step`` (its tensors
    on the device asked for), and ``base``, the full save the deltas are against (on the CPU)."""

    step: int
    state: Dict[str, Any]
    base_step: int
    base: Capture
    fallback: Optional[str] = None  #: why a newer delta listed in the journal was not used


def _inline_streams(parsed: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """The streams a stored document carries itself (CPU tensors)."""
    try:
        return {n: (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8))
                .view(DTYPES[dtype]) for n, (dtype, data) in (parsed.get("inline") or {}).items()}
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"bad training state document: {exc}") from None


def _load(store: "SegmentStore", keys: Mapping[str, str]) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor],
                                                                   Dict[str, torch.Tensor]]:
    """A save's document (parsed), its streams stored as segments, and those inside the document."""
    if TREE not in keys:
        raise FormatError("training record has no state document: written by kvj 0.1.0's flat format, "
                          "which this kvj does not resume (finish that run with kvj 0.1.0)")
    doc = parse_document(store.get(keys[TREE]).numpy().tobytes())
    streams = {k[len(STREAM_PREFIX):]: store.get(v) for k, v in keys.items() if k.startswith(STREAM_PREFIX)}
    return doc, streams, _inline_streams(doc)


def _placed(doc: Mapping[str, Any], streams: Mapping[str, torch.Tensor],
            device: Union[str, torch.device]) -> Dict[str, Any]:
    """The state ``doc`` describes, from host ``streams``: what was captured on a device goes to
    ``device`` (one upload per stream, done on return), the rest stays views of ``streams``."""
    target = cuda.CUDA.resolve(device)
    starts = (doc.get("device") or {}) if target.type != "cpu" else {}
    if not (isinstance(starts, dict) and all(n in streams and isinstance(s, int) for n, s in starts.items())):
        raise FormatError(f"bad training state document: device {starts!r:.80}")
    on_device: Dict[str, Tuple[int, torch.Tensor]] = {}
    last = None
    for name, start in starts.items():
        part = streams[name][start:]
        if target.type != "cuda":
            on_device[name] = (start, part.to(target))
            continue
        uploaded, last = cuda.CUDA.upload(part, target)
        on_device[name] = (start, uploaded)
    if last is not None:  # one h2d stream runs the uploads in order: the last event covers them all
        cuda.CUDA.finish(last, cuda.CUDA.side_stream(target, "h2d"))
    return materialize(doc, streams, on_device)


def recover_training(source: Union[JournalState, Mapping[str, Any]], store: "SegmentStore",
                     device: Union[str, torch.device] = "cpu") -> Optional[RecoveredState]:
    """The newest training state the journal can rebuild, its tensors on ``device``; None when
    nothing was checkpointed. ``source``: ``kvj.replay`` state or the ``training`` part of a
    recovery manifest."""
    if isinstance(source, JournalState):
        checkpoint, deltas = source.checkpoint, source.deltas
    else:
        checkpoint, deltas = source.get("checkpoint"), source.get("deltas") or []
    if not checkpoint:
        return None
    base_step = checkpoint["step"]
    base_doc, base_stored, base_inline = _load(store, checkpoint["keys"])
    base_streams = {**base_stored, **base_inline}
    base = Capture(base_streams, base_doc)
    fallback = None
    for delta in sorted((d for d in deltas if d["base_step"] == base_step), key=lambda d: -d["step"]):
        try:
            doc, stored, inline = _load(store, delta["keys"])
        except (SegmentMissing, SegmentCorrupt) as exc:
            fallback = f"delta of step {delta['step']} unreadable ({exc})"
            continue
        whole = set((delta.get("meta") or {}).get("whole", []))
        if set(stored) | set(inline) != set(base_streams):
            raise FormatError(f"delta of step {delta['step']} holds streams {sorted({*stored, *inline})}, "
                              f"its base {sorted(base_streams)}")
        streams = {n: t if n in whole else unxor(base_streams[n], t) for n, t in stored.items()}
        return RecoveredState(delta["step"], _placed(doc, {**streams, **inline}, device), base_step, base, fallback)
    # The state gets copies: a restored optimizer may keep the tensors it is given, and its
    # steps must not change the base the next deltas are XORed against.
    streams = {n: t.clone() for n, t in base_streams.items()}
    return RecoveredState(base_step, _placed(base_doc, streams, device), base_step, base, fallback)
