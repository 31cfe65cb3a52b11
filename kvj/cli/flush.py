"""``kvj flush``: store tensors from files as segments and journal them."""

from __future__ import annotations

import os
import re
from enum import Enum
from typing import Annotated, Any, Dict, List, Optional, Sequence, Tuple

import typer

from kvj.cli.common import (
    JournalArg,
    JsonArg,
    MirrorArg,
    MirrorPolicyArg,
    StoreArg,
    done,
    emit_json,
    journal_path,
    out,
    parse_pairs,
    parse_range,
    progress,
    store_path,
    usage_error,
)
from kvj.errors import FormatError, InvalidArgument
from kvj.journal.journal import Journal
from kvj.journal.replay import replay
from kvj.journal.state import RequestState
from kvj.ops.inspection import human_size, short_key
from kvj.segments.codecs import codec_names


Codec = Enum("Codec", {name: name for name in codec_names()}, type=str)  # type: ignore[misc]


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


def load_tensors(path: str) -> List[Tuple[str, Any]]:
    """(name, CPU tensor) pairs from a .safetensors, .npy or .pt file, in natural name order.

    .pt files are read with ``torch.load(weights_only=True)``: no pickled code runs.
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
    raise usage_error(f"{path}: unsupported file type (use .safetensors, .npy or .pt)")


def ordered(tensors: List[Tuple[str, Any]], order: Optional[str]) -> List[Tuple[str, Any]]:
    """``tensors`` in the ``--order NAME,NAME,...`` given (each name exactly once), else as loaded."""
    if order is None:
        return tensors
    names = [n.strip() for n in order.split(",")]
    by_name = dict(tensors)
    if len(by_name) != len(tensors):
        raise InvalidArgument("--order needs distinct tensor names, but the files repeat some")
    unknown = [n for n in names if n not in by_name]
    missing = [n for n, _t in tensors if n not in names]
    if unknown or missing or len(set(names)) != len(names):
        raise InvalidArgument(f"--order must name each tensor exactly once; the files hold "
                              f"{', '.join(n for n, _t in tensors)}")
    return [(n, by_name[n]) for n in names]


def plan_ranges(req: RequestState, tensors: Sequence[Tuple[str, Any]], first_seg: int,
                token_range: Optional[Tuple[int, int]], block_tokens: Optional[int], start: Optional[int],
                token_dim: Optional[int]) -> List[Tuple[int, Tuple[int, int]]]:
    """(segment number, token range) for each tensor, refusing input that does not fit the request.

    Refused (``InvalidArgument``, nothing stored): an empty tensor; a tensor without a
    dimension of its token count (``--token-dim`` names which one); tensors of different
    dtypes or shapes; a range overlapping a segment the request already has; a first range
    that leaves a gap after the tokens already covered (such a segment could never be
    restored).
    """
    plan = []
    for i, (name, tensor) in enumerate(tensors):
        if token_range is not None:
            rng = token_range
        else:
            pos = start if start is not None else _resume(req, first_seg, len(tensors))
            rng = (pos + i * block_tokens, pos + (i + 1) * block_tokens)  # type: ignore[operator]
        plan.append((first_seg + i, rng))
        count = rng[1] - rng[0]
        if tensor.numel() == 0 or count == 0:
            raise InvalidArgument(f"tensor {name} has shape {list(tensor.shape)}: an empty tensor or token range "
                                  "cannot be a KV segment")
        shape = list(tensor.shape)
        if token_dim is not None:
            if not -len(shape) <= token_dim < len(shape) or shape[token_dim] != count:
                raise InvalidArgument(f"tensor {name} has shape {shape}: its dimension {token_dim} is not "
                                      f"{count} tokens")
        elif count not in shape:
            raise InvalidArgument(f"tensor {name} has shape {shape}, no dimension of {count} tokens: check "
                                  "--block-tokens or --tokens (--token-dim names the token dimension)")
        first_name, first = tensors[0]
        if (tensor.dtype, shape) != (first.dtype, list(first.shape)):
            raise InvalidArgument(f"tensor {name} ({str(tensor.dtype).replace('torch.', '')} {shape}) differs from "
                                  f"{first_name} ({str(first.dtype).replace('torch.', '')} {list(first.shape)}): "
                                  "the blocks of a request share dtype and shape")
    kept = {seg: ref for seg, ref in req.segments.items() if seg not in {s for s, _r in plan}}
    covered = [(ref.tokens, f"segment {seg}") for seg, ref in sorted(kept.items()) if ref.tokens]
    for (seg, (lo, hi)), (name, _t) in zip(plan, tensors):
        for (a, b), what in covered:
            if lo < b and a < hi:
                raise InvalidArgument(f"tensor {name}: tokens {lo}..{hi} overlap {what} (tokens {a}..{b}) of "
                                      f"request {req.id}")
        covered.append(((lo, hi), f"tensor {name}"))
    resume = _covered_from_zero([ref.tokens for ref in kept.values() if ref.tokens])
    first_lo = min(lo for _s, (lo, _hi) in plan)
    if first_lo > resume:
        raise InvalidArgument(f"tokens {resume}..{first_lo} of request {req.id} would not be covered by any "
                              f"segment (a gap after its durable tokens): start at token {resume}")
    return plan


def _covered_from_zero(ranges: Sequence[Tuple[int, int]]) -> int:
    pos = 0
    for lo, hi in sorted(ranges):
        if lo > pos:
            break
        pos = max(pos, hi)
    return pos


def _resume(req: RequestState, first_seg: int, count: int) -> int:
    """Where new blocks start by default: after the tokens covered by segments kept."""
    replaced = set(range(first_seg, first_seg + count))
    return _covered_from_zero([ref.tokens for seg, ref in req.segments.items() if ref.tokens and seg not in replaced])


def check_layout(req: RequestState, layout: Dict[str, Any], store: Any, tensor: Any) -> None:
    """A request's segments keep one layout, dtype and shape: refuse a flush that changes them."""
    if not req.segments:
        return
    from kvj.segments.layout import layouts_match

    newest = req.segments[max(req.segments)]
    if not layouts_match(newest.layout, layout):
        raise InvalidArgument(f"request {req.id}'s segments have layout {newest.layout or {}}, not {layout}: "
                              "a request's layout cannot change (give the same --layout)")
    if newest.key and store.exists(newest.key):
        info = store.info(newest.key)
        dtype = str(tensor.dtype).replace("torch.", "")
        if (info.dtype, list(info.shape)) != (dtype, list(tensor.shape)):
            raise InvalidArgument(f"request {req.id}'s segment {newest.seg} is {info.dtype} {list(info.shape)}, "
                                  f"the new tensors are {dtype} {list(tensor.shape)}: a request's blocks share dtype "
                                  "and shape")


def flush(
    files: Annotated[List[str], typer.Argument(metavar="FILE", help=".safetensors, .npy or .pt files.")],
    journal: JournalArg = None,
    store: StoreArg = None,
    request: Annotated[Optional[str], typer.Option("--request", "-r", metavar="ID",
                                                   help="Store the tensors as KV segments of this request.")] = None,
    tokens: Annotated[Optional[str], typer.Option(metavar="START:END",
                                                  help="Token range of the one tensor given.")] = None,
    block_tokens: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="Each tensor covers the next N "
                                                        "tokens, from --start.")] = None,
    start: Annotated[Optional[int], typer.Option(metavar="TOKEN", min=0, help="First token for --block-tokens "
                                                 "[default: the request's resume position].")] = None,
    segment: Annotated[Optional[int], typer.Option(metavar="N", min=0, help="Number of the first segment "
                                                   "[default: after the request's last one].")] = None,
    order: Annotated[Optional[str], typer.Option(metavar="NAME,NAME,...", help="Order in which the tensors "
                                                 "become blocks [default: the files in the order given, each "
                                                 "file's tensors in natural name order: blk2 before blk10].")] = None,
    token_dim: Annotated[Optional[int], typer.Option(metavar="DIM", help="The tensor dimension that indexes "
                                                     "tokens; its size must be the block's token count "
                                                     "[default: any dimension of that size].")] = None,
    checkpoint: Annotated[Optional[int], typer.Option(metavar="STEP", min=0, help="Store the tensors as a full "
                                                      "training checkpoint at STEP.")] = None,
    delta: Annotated[Optional[int], typer.Option(metavar="STEP", min=0, help="Store the tensors as a delta at "
                                                 "STEP (with --base-step).")] = None,
    base_step: Annotated[Optional[int], typer.Option(metavar="STEP", min=0,
                                                     help="The step a --delta applies to.")] = None,
    layout: Annotated[Optional[List[str]], typer.Option(
        metavar="KEY=VALUE", help="Model/layout the segments belong to (repeatable); loading into another is "
        "refused.")] = None,
    codec: Annotated[Codec, typer.Option(help="Compression codec.")] = Codec.auto,
    as_json: JsonArg = False,
    mirror: MirrorArg = None,
    mirror_policy: MirrorPolicyArg = "fail",
) -> None:
    """Store tensors from files as durable segments, then journal them.

    With --request, each tensor becomes the next KV segment of a request in flight,
    covering --tokens START:END (one tensor) or --block-tokens N each from --start, in
    natural name order (blk2 before blk10) or the --order given; each line printed says
    which tensor became which segment. With --checkpoint or --delta, the tensors (by
    name) become a training checkpoint or a delta. Every segment is durable before the
    record that points at it; the command exits once the records are durable too. .pt
    files are read with weights_only=True (no pickle).

    Input that does not fit the request is refused before anything is stored (status
    64): an empty tensor, a tensor with no dimension of its token count, blocks of
    different dtypes or shapes, a layout other than the request's earlier segments',
    token ranges overlapping its segments, or a gap after the tokens it already covers.
    """
    modes = [m for m, on in (("--request", request is not None), ("--checkpoint", checkpoint is not None),
                             ("--delta", delta is not None)) if on]
    if len(modes) != 1:
        raise usage_error("give exactly one of --request, --checkpoint and --delta")
    if (delta is None) != (base_step is None):
        raise usage_error("--delta and --base-step go together")
    if request is not None and (tokens is None) == (block_tokens is None):
        raise usage_error("with --request, give --tokens START:END (one tensor) or --block-tokens N")
    if request is None and (order, token_dim, start, segment) != (None, None, None, None):
        raise usage_error("--order, --token-dim, --start and --segment apply to --request")
    if tokens is not None and start is not None:
        raise usage_error("--start applies to --block-tokens (--tokens gives the range itself)")
    token_range = parse_range(tokens, "token range") if tokens else None
    path = journal_path(journal, legacy_ok=False, writing=True)
    tensors = ordered([item for f in files for item in load_tensors(f)], order)
    if token_range is not None and len(tensors) != 1:
        raise usage_error(f"--tokens covers one tensor, but the files hold {len(tensors)}: use --block-tokens")
    if request is None and len({name for name, _t in tensors}) != len(tensors):
        raise usage_error("the files repeat a tensor name: a checkpoint or delta maps each name to one segment")
    from kvj.segments.store import SegmentStore

    layout_map = parse_pairs(layout, "--layout")
    with Journal.open(path, create=False, mirror=mirror,
                      mirror_policy=mirror_policy) as j, \
            SegmentStore(store_path(path, store)) as seg_store, progress() as update:
        rows: List[Dict[str, Any]] = []
        if request is not None:
            req = replay(path).requests.get(request)
            if req is None or req.ended:
                raise InvalidArgument(f"request {request} is not in flight: record its start first "
                                      "(kvj record start)")
            seg_no = segment if segment is not None else max(req.segments, default=-1) + 1
            plan = plan_ranges(req, tensors, seg_no, token_range, block_tokens, start, token_dim)
            check_layout(req, layout_map, seg_store, tensors[0][1])
            for i, ((name, tensor), (seg, rng)) in enumerate(zip(tensors, plan)):
                info = seg_store.put(tensor.contiguous(), layout=layout_map, codec=codec.value)
                lsn = j.flush(request, seg, token_range=rng, info=info).result()
                rows.append({"name": name, "segment": seg, "tokens": list(rng), "lsn": lsn, **info.to_dict()})
                update("storing segments", i + 1, len(tensors))
        else:
            keys: Dict[str, str] = {}
            for i, (name, tensor) in enumerate(tensors):
                info = seg_store.put(tensor.contiguous(), layout=layout_map, codec=codec.value)
                keys[name] = info.key
                rows.append({"name": name, **info.to_dict()})
                update("storing segments", i + 1, len(tensors))
            lsn = (j.checkpoint(checkpoint, keys) if checkpoint is not None
                   else j.delta(delta, base_step, keys))  # type: ignore[arg-type]
            for row in rows:
                row["lsn"] = lsn
        j.sync()
    done(f"{len(rows)} segments durable in {store_path(path, store)} and journaled in {path} "
         f"(LSN {rows[0]['lsn']}..{rows[-1]['lsn']})" if rows else f"nothing stored in {path}")
    if as_json:
        for row in rows:
            emit_json(row)
        return
    for row in rows:
        where = (f"{row['name']} -> segment {row['segment']}, tokens {row['tokens'][0]}..{row['tokens'][1]}"
                 if "segment" in row else row["name"])
        out.print(f"{where}: {short_key(row['key'])} {human_size(row['raw_size'])} -> {human_size(row['stored_size'])} "
                  f"({row['codec']}), LSN {row['lsn']}", markup=False)
    what = f"request {request}" if request is not None else (
        f"checkpoint step {checkpoint}" if checkpoint is not None else f"delta step {delta} on {base_step}")
    out.print(f"{len(rows)} segments of {what} durable in {store_path(path, store)}", markup=False)
