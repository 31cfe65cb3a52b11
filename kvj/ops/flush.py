"""Flushing tensors from files into a journal as segments (``kvj flush``): ``load_tensors`` reads
.safetensors, .npy or .pt (no pickle), ``plan_segments`` refuses a plan that does not fit the
request before anything is stored, ``flush_request``/``flush_training`` store each tensor
durably before the record that points at it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from kvj.errors import FormatError, InvalidArgument
from kvj.journal.journal import Journal
from kvj.journal.replay import replay
from kvj.journal.state import RequestState

if TYPE_CHECKING:  # the store and the loaders pull in torch; importing this module does not
    import torch

    from kvj.segments.store import SegmentInfo, SegmentStore

Tensors = Sequence[Tuple[str, "torch.Tensor"]]
#: ``progress(description, done, total)``, called after each segment stored.
Progress = Callable[[str, int, int], None]


def natural_key(name: str) -> List[Any]:
    """Sort key that puts ``blk2`` before ``blk10`` (digits compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _load_pt(path: str) -> Any:
    """``torch.load(weights_only=True)``; a file it refuses is one kvj line, not torch's advice
    to pass ``weights_only=False`` (an option kvj does not offer: it would run pickled code)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises pickle's UnpicklingError; kvj never imports pickle
            if type(exc).__name__ != "UnpicklingError":
                raise
            found = re.search(r"WeightsUnpickler error: (.*?)(?:\.\s|\s+Check the documentation|$)", str(exc), re.S)
            reason = f" ({' '.join(found.group(1).split())})" if found else ""
            raise FormatError(f"{path}: refused: kvj reads .pt files with weights_only=True and this one holds "
                              f"more than tensors{reason}; save a tensor, or a list or dict of tensors") from None


def load_tensors(path: str) -> List[Tuple[str, "torch.Tensor"]]:
    """(name, CPU tensor) pairs from a .safetensors, .npy or .pt file, in natural name order.

    .pt files are read with ``torch.load(weights_only=True)``: no pickled code runs. A file
    that is no such file is ``FormatError``; another suffix is ``InvalidArgument``.
    """
    stem, suffix = os.path.splitext(os.path.basename(path))
    suffix = suffix.lower()
    with open(path, "rb"):  # missing or unreadable: the OS error, with the file name
        pass
    try:
        if suffix == ".npy":
            import numpy

            array = numpy.load(path, allow_pickle=False)
            import torch

            return [(stem, torch.from_numpy(array))]
        if suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise FormatError("reading .safetensors needs the safetensors package "
                                  "(pip install safetensors)") from None
            return sorted(load_file(path, device="cpu").items(), key=lambda kv: natural_key(kv[0]))
        if suffix in (".pt", ".pth"):
            import torch

            obj = _load_pt(path)
            if isinstance(obj, torch.Tensor):
                return [(stem, obj)]
            if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
                return sorted(((str(k), v) for k, v in obj.items()), key=lambda kv: natural_key(kv[0]))
            if isinstance(obj, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in obj):
                return [(f"{stem}.{i}", v) for i, v in enumerate(obj)]
            raise FormatError(f"{path}: holds a {type(obj).__name__}, not a tensor, a list of tensors or a "
                              "dict of tensors")
    except (FormatError, OSError):
        raise
    except Exception as exc:  # each format's reader raises its own error types on bad input
        raise FormatError(f"{path}: cannot read tensors: {exc}") from None
    raise InvalidArgument(f"{path}: unsupported file type (use .safetensors, .npy or .pt)")


def ordered(tensors: Tensors, order: Optional[Sequence[str]]) -> List[Tuple[str, "torch.Tensor"]]:
    """``tensors`` in the ``order`` of names given (each name exactly once), else as loaded."""
    if order is None:
        return list(tensors)
    names = [n.strip() for n in order]
    by_name = dict(tensors)
    if len(by_name) != len(tensors):
        raise InvalidArgument("--order needs distinct tensor names, but the files repeat some")
    unknown = [n for n in names if n not in by_name]
    missing = [n for n, _t in tensors if n not in names]
    if unknown or missing or len(set(names)) != len(names):
        raise InvalidArgument(f"--order must name each tensor exactly once; the files hold "
                              f"{', '.join(n for n, _t in tensors)}")
    return [(n, by_name[n]) for n in names]


@dataclass
class PlannedSegment:
    """One tensor of a plan: the segment of the request it becomes and the tokens it covers."""

    name: str
    tensor: "torch.Tensor"
    segment: int
    tokens: Tuple[int, int]


def plan_segments(req: RequestState, tensors: Tensors, *, token_range: Optional[Tuple[int, int]] = None,
                  block_tokens: Optional[int] = None, start: Optional[int] = None, segment: Optional[int] = None,
                  token_dim: Optional[int] = None) -> List[PlannedSegment]:
    """Which segment of request ``req`` each tensor becomes, covering which tokens.

    The tensors become segments ``segment``, ``segment + 1``, ... (default: after the
    request's last one), covering ``token_range`` (one tensor) or ``block_tokens`` each from
    ``start`` (default: the request's resume position without the segments they replace).

    Refused (``InvalidArgument``, nothing stored): no tensor, or a token range for more than
    one; an empty tensor; a tensor without a dimension of its token count (``token_dim``
    names which one); tensors of different dtypes or shapes; a range overlapping a segment
    the request keeps; a first range that leaves a gap after the tokens already covered
    (such a segment could never be restored).
    """
    if (token_range is None) == (block_tokens is None):
        raise InvalidArgument("give a token range (one tensor) or a block size in tokens")
    if (block_tokens is not None and block_tokens < 1) or (start is not None and start < 0):
        raise InvalidArgument("a block covers at least one token, from a token position of 0 or more")
    if not tensors:
        raise InvalidArgument("the files hold no tensor: nothing to flush")
    if token_range is not None and len(tensors) != 1:
        raise InvalidArgument(f"--tokens covers one tensor, but the files hold {len(tensors)}: use --block-tokens")
    first_seg = segment if segment is not None else max(req.segments, default=-1) + 1
    replaced = set(range(first_seg, first_seg + len(tensors)))
    kept = dataclasses.replace(req, segments={s: ref for s, ref in req.segments.items() if s not in replaced})
    pos = start if start is not None else kept.resume_position
    plan = []
    first_name, first = tensors[0]
    for i, (name, tensor) in enumerate(tensors):
        rng = token_range if token_range is not None else (pos + i * block_tokens, pos + (i + 1) * block_tokens)
        plan.append(PlannedSegment(name, tensor, first_seg + i, rng))  # type: ignore[arg-type]
        count = rng[1] - rng[0]
        shape = list(tensor.shape)
        if tensor.numel() == 0 or count == 0:
            raise InvalidArgument(f"tensor {name} has shape {shape}: an empty tensor or token range cannot be a "
                                  "KV segment")
        if token_dim is not None:
            if not -len(shape) <= token_dim < len(shape) or shape[token_dim] != count:
                raise InvalidArgument(f"tensor {name} has shape {shape}: its dimension {token_dim} is not "
                                      f"{count} tokens")
        elif count not in shape:
            raise InvalidArgument(f"tensor {name} has shape {shape}, no dimension of {count} tokens: check "
                                  "--block-tokens or --tokens (--token-dim names the token dimension)")
        if (tensor.dtype, shape) != (first.dtype, list(first.shape)):
            raise InvalidArgument(f"tensor {name} ({_dtype(tensor)} {shape}) differs from {first_name} "
                                  f"({_dtype(first)} {list(first.shape)}): the blocks of a request share dtype "
                                  "and shape")
    covered = [(ref.tokens, f"segment {seg}") for seg, ref in sorted(kept.segments.items()) if ref.tokens]
    for p in plan:
        lo, hi = p.tokens
        for (a, b), what in covered:
            if lo < b and a < hi:
                raise InvalidArgument(f"tensor {p.name}: tokens {lo}..{hi} overlap {what} (tokens {a}..{b}) of "
                                      f"request {req.id}")
        covered.append(((lo, hi), f"tensor {p.name}"))
    resume, first_lo = kept.resume_position, min(p.tokens[0] for p in plan)
    if first_lo > resume:
        raise InvalidArgument(f"tokens {resume}..{first_lo} of request {req.id} would not be covered by any "
                              f"segment (a gap after its durable tokens): start at token {resume}")
    return plan


def _dtype(tensor: "torch.Tensor") -> str:
    return str(tensor.dtype).replace("torch.", "")


def check_layout(req: RequestState, layout: Mapping[str, Any], store: "SegmentStore",
                 tensor: "torch.Tensor") -> None:
    """A request's segments keep one layout, dtype and shape: refuse (``InvalidArgument``) new
    ones that change them."""
    if not req.segments:
        return
    from kvj.segments.layout import layouts_match

    newest = req.segments[max(req.segments)]
    if not layouts_match(newest.layout, dict(layout)):
        raise InvalidArgument(f"request {req.id}'s segments have layout {newest.layout or {}}, not {dict(layout)}: "
                              "a request's layout cannot change (give the same --layout)")
    if newest.key and store.exists(newest.key):
        info = store.info(newest.key)
        if (info.dtype, list(info.shape)) != (_dtype(tensor), list(tensor.shape)):
            raise InvalidArgument(f"request {req.id}'s segment {newest.seg} is {info.dtype} {list(info.shape)}, "
                                  f"the new tensors are {_dtype(tensor)} {list(tensor.shape)}: a request's blocks "
                                  "share dtype and shape")


@dataclass
class Flushed:
    """A tensor stored and journaled: its segment (a request's, with its tokens; a training
    step's has neither) and the LSN of the record pointing at it."""

    name: str
    info: "SegmentInfo"
    lsn: int
    segment: Optional[int] = None
    tokens: Optional[Tuple[int, int]] = None

    def to_dict(self) -> Dict[str, Any]:
        where = {} if self.segment is None else {"segment": self.segment, "tokens": list(self.tokens or ())}
        return {"name": self.name, **where, "lsn": self.lsn, **self.info.to_dict()}


def _ignore(_description: str, _done: int, _total: int) -> None:
    pass


def flush_request(journal: Journal, request_id: str, tensors: Tensors, *, token_range: Optional[Tuple[int, int]] = None,
                  block_tokens: Optional[int] = None, start: Optional[int] = None, segment: Optional[int] = None,
                  token_dim: Optional[int] = None, layout: Optional[Mapping[str, Any]] = None, codec: str = "auto",
                  progress: Progress = _ignore) -> List[Flushed]:
    """Store ``tensors`` as the next segments of request ``request_id`` (in flight in
    ``journal``) as ``plan_segments`` places them, in ``journal.store``; returns once they
    and their records are durable. A plan that does not fit, or a layout, dtype or shape
    other than the request's segments', is refused before anything is stored."""
    req = replay(journal.path).requests.get(request_id)
    if req is None or req.ended:
        raise InvalidArgument(f"request {request_id} is not in flight: record its start first (kvj record start)")
    plan = plan_segments(req, tensors, token_range=token_range, block_tokens=block_tokens, start=start,
                        segment=segment, token_dim=token_dim)
    layout = dict(layout or {})
    check_layout(req, layout, journal.store, plan[0].tensor)
    flushed = []
    for i, p in enumerate(plan):
        info = journal.store.put(p.tensor.contiguous(), layout=layout, codec=codec)
        lsn = journal.flush(request_id, p.segment, token_range=p.tokens, info=info).result()
        flushed.append(Flushed(p.name, info, lsn, p.segment, p.tokens))
        progress("storing segments", i + 1, len(plan))
    journal.sync()
    return flushed


def flush_training(journal: Journal, tensors: Tensors, step: int, *, base_step: Optional[int] = None,
                   layout: Optional[Mapping[str, Any]] = None, codec: str = "auto",
                   progress: Progress = _ignore) -> List[Flushed]:
    """Store ``tensors`` (by name) in ``journal.store`` as the full training checkpoint at
    ``step``, or with ``base_step`` as a delta at ``step`` on that step; returns once the
    segments and the record are durable. No tensor, or a name twice, is ``InvalidArgument``."""
    if not tensors:
        raise InvalidArgument("the files hold no tensor: nothing to flush")
    if len({name for name, _t in tensors}) != len(tensors):
        raise InvalidArgument("the files repeat a tensor name: a checkpoint or delta maps each name to one segment")
    infos = []
    for i, (name, tensor) in enumerate(tensors):
        infos.append((name, journal.store.put(tensor.contiguous(), layout=dict(layout or {}), codec=codec)))
        progress("storing segments", i + 1, len(tensors))
    keys = {name: info.key for name, info in infos}
    lsn = journal.checkpoint(step, keys) if base_step is None else journal.delta(step, base_step, keys)
    journal.sync()
    return [Flushed(name, info, lsn) for name, info in infos]
