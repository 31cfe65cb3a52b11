"""``kvj flush``: store tensors from files as segments and journal them."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, List, Optional

import typer

from kvj.cli.options import (JournalArg, JsonArg, MirrorArg, MirrorPolicyArg, StoreArg, journal_path, store_path,
                             usage_error)
from kvj.cli.output import done, emit_json, out, progress
from kvj.cli.parse import parse_pairs, parse_range
from kvj.journal.journal import Journal
from kvj.ops.inspection import human_size, short_key
from kvj.segments.codecs import codec_names


Codec = Enum("Codec", {name: name for name in codec_names()}, type=str)  # type: ignore[misc]


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
    64): files holding no tensor, an empty tensor, a tensor with no dimension of its token count, blocks of
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
    from kvj.ops.flush import flush_request, flush_training, load_tensors, ordered

    token_range = parse_range(tokens, "token range") if tokens else None
    path = journal_path(journal, writing=True)
    tensors = ordered([item for f in files for item in load_tensors(f)],
                      order.split(",") if order is not None else None)
    layout_map = parse_pairs(layout, "--layout")
    stored_in = store_path(path, store)
    with Journal.open(path, create=False, store=stored_in, mirror=mirror, mirror_policy=mirror_policy) as j, \
            progress() as update:
        if request is not None:
            flushed = flush_request(j, request, tensors, token_range=token_range, block_tokens=block_tokens,
                                    start=start, segment=segment, token_dim=token_dim, layout=layout_map,
                                    codec=codec.value, progress=update)
        else:
            step = checkpoint if checkpoint is not None else delta
            flushed = flush_training(j, tensors, step, base_step=base_step,  # type: ignore[arg-type]
                                     layout=layout_map, codec=codec.value, progress=update)
    done(f"{len(flushed)} segments durable in {stored_in} and journaled in {path} "
         f"(LSN {flushed[0].lsn}..{flushed[-1].lsn})")
    if as_json:
        for f in flushed:
            emit_json(f.to_dict())
        return
    for f in flushed:
        where = f.name if f.tokens is None else f"{f.name} -> segment {f.segment}, tokens {f.tokens[0]}..{f.tokens[1]}"
        out.print(f"{where}: {short_key(f.info.key)} {human_size(f.info.raw_size)} -> "
                  f"{human_size(f.info.stored_size)} ({f.info.codec}), LSN {f.lsn}", markup=False)
    what = f"request {request}" if request is not None else (
        f"checkpoint step {checkpoint}" if checkpoint is not None else f"delta step {delta} on {base_step}")
    out.print(f"{len(flushed)} segments of {what} durable in {stored_in}", markup=False)
