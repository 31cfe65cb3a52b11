"""``kvj flush``: store tensors from files as segments and journal them."""

from __future__ import annotations

import os
from enum import Enum
from typing import Annotated, Any, Dict, List, Optional, Tuple

import typer

from kvj.cli.common import (
    JournalArg,
    JsonArg,
    StoreArg,
    emit_json,
    journal_path,
    out,
    parse_pairs,
    parse_range,
    progress,
    store_path,
    usage_error,
)
from kvj.errors import FormatError
from kvj.journal.journal import Journal
from kvj.journal.replay import replay
from kvj.ops.inspection import human_size


class Codec(str, Enum):
    auto = "auto"
    raw = "raw"
    zstd = "zstd"
    byteplane = "byteplane"


def load_tensors(path: str) -> List[Tuple[str, Any]]:
    """(name, CPU tensor) pairs from a .safetensors, .npy or .pt file, in file order.

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
            return list(load_file(path, device="cpu").items())
        if suffix in (".pt", ".pth"):
            import torch

            obj = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(obj, torch.Tensor):
                return [(stem, obj)]
            if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
                return [(str(k), v) for k, v in obj.items()]
            if isinstance(obj, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in obj):
                return [(f"{stem}.{i}", v) for i, v in enumerate(obj)]
            raise FormatError(f"{path}: holds a {type(obj).__name__}, not a tensor, a list of tensors or a "
                              "dict of tensors")
    except (FormatError, OSError):
        raise
    except Exception as exc:  # each format's reader raises its own error types on bad input
        raise FormatError(f"{path}: cannot read tensors: {exc}") from None
    raise usage_error(f"{path}: unsupported file type (use .safetensors, .npy or .pt)")


def flush(
    files: Annotated[List[str], typer.Argument(metavar="FILE...", help=".safetensors, .npy or .pt files.")],
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
) -> None:
    """Store tensors from files as durable segments, then journal them.

    With --request, each tensor becomes the next KV segment of a request in flight,
    covering --tokens START:END (one tensor) or --block-tokens N each from --start. With
    --checkpoint or --delta, the tensors (by name) become a training checkpoint or a delta.
    Every segment is durable before the record that points at it; the command exits once
    the records are durable too. .pt files are read with weights_only=True (no pickle).
    """
    modes = [m for m, on in (("--request", request is not None), ("--checkpoint", checkpoint is not None),
                             ("--delta", delta is not None)) if on]
    if len(modes) != 1:
        raise usage_error("give exactly one of --request, --checkpoint and --delta")
    if (delta is None) != (base_step is None):
        raise usage_error("--delta and --base-step go together")
    if request is not None and (tokens is None) == (block_tokens is None):
        raise usage_error("with --request, give --tokens START:END (one tensor) or --block-tokens N")
    token_range = parse_range(tokens, "token range") if tokens else None
    path = journal_path(journal, legacy_ok=False, must_exist=False)
    tensors = [item for f in files for item in load_tensors(f)]
    if token_range is not None and len(tensors) != 1:
        raise usage_error(f"--tokens covers one tensor, but the files hold {len(tensors)}: use --block-tokens")
    from kvj.segments.store import SegmentStore

    layout_map = parse_pairs(layout, "--layout")
    with Journal.open(path) as j, SegmentStore(store_path(path, store)) as seg_store, progress() as update:
        rows: List[Dict[str, Any]] = []
        if request is not None:
            state = replay(path)
            req = state.requests.get(request)
            if req is None or req.ended:
                raise FormatError(f"request {request} is not in flight: record its start first (kvj record start)")
            seg_no = segment if segment is not None else max(req.segments, default=-1) + 1
            pos = start if start is not None else req.resume_position
            for i, (name, tensor) in enumerate(tensors):
                rng = token_range or (pos + i * block_tokens, pos + (i + 1) * block_tokens)  # type: ignore[operator]
                info = seg_store.put(tensor.contiguous(), layout=layout_map, codec=codec.value)
                lsn = j.flush(request, seg_no + i, token_range=rng, info=info).result()
                rows.append({"name": name, "segment": seg_no + i, "tokens": list(rng), "lsn": lsn, **info.to_dict()})
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
    if as_json:
        for row in rows:
            emit_json(row)
        return
    for row in rows:
        where = (f"segment {row['segment']} tokens {row['tokens'][0]}..{row['tokens'][1]}" if "segment" in row
                 else row["name"])
        out.print(f"{where}: {row['key'][:16]} {human_size(row['raw_size'])} -> {human_size(row['stored_size'])} "
                  f"({row['codec']}), LSN {row['lsn']}", markup=False)
    what = f"request {request}" if request is not None else (
        f"checkpoint step {checkpoint}" if checkpoint is not None else f"delta step {delta} on {base_step}")
    out.print(f"{len(rows)} segments of {what} durable in {store_path(path, store)}", markup=False)
