"""``kvj dump``: one segment to a .npy, .safetensors or .pt file, verified."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvj.cli.options import JournalArg, JsonArg, StoreArg, journal_path, store_path, usage_error
from kvj.cli.output import done, emit_json, out
from kvj.errors import InvalidArgument, NotFound
from kvj.ops.inspection import human_size, short_key


def dump(key: Annotated[Optional[str], typer.Argument(metavar="KEY", show_default=False,
                                                      help="Segment key, or a prefix of at least 8 hex digits "
                                                      "(as kvj inspect prints it).")] = None,
         output: Annotated[str, typer.Option("--output", "-o", metavar="FILE",
                                             help="Where to write it; the suffix picks the format: .npy, "
                                             ".safetensors or .pt.")] = "",
         journal: JournalArg = None,
         store: StoreArg = None,
         request: Annotated[Optional[str], typer.Option("--request", "-r", metavar="ID",
                                                        help="The segment of this request (with --segment).")] = None,
         segment: Annotated[Optional[int], typer.Option("--segment", metavar="N", min=0,
                                                        help="Which of the request's segments (its block number).")]
         = None,
         as_json: JsonArg = False) -> None:
    """Write one segment to a file, verified: by KEY, or by --request and --segment.

    The segment is read through the store, which checks every chunk CRC and the digest, so
    a damaged segment is refused (status 65), never written out. The file is written
    durably and read back to check it holds exactly the segment's bytes, dtype and shape.
    .pt files load with torch.load(weights_only=True); numpy has no bfloat16, so such a
    segment goes to .safetensors or .pt. The journal is only read. See kvj inspect
    --segment KEY for a segment's header and who refers to it, without decoding it.
    """
    if not output:
        raise usage_error("give --output FILE (.npy, .safetensors or .pt)")
    if (key is None) == (request is None) or (request is None) != (segment is None):
        raise usage_error("give a KEY, or --request ID and --segment N")
    from kvj.journal.replay import replay
    from kvj.ops.dump import dump_segment, resolve_key, segment_users
    from kvj.segments.check import opened_store

    path = journal_path(journal) if journal is not None or store is None else None
    root = store_path(path, store) if path is not None else store_path("", store)
    state = replay(path) if path is not None else None
    with opened_store(root, root) as seg_store:
        if seg_store is None:
            raise NotFound(f"no segment store at {root}")
        if request is not None:
            req = state.requests.get(request) if state is not None else None
            ref = req.segments.get(segment) if req is not None else None
            if ref is None or not ref.key:
                raise InvalidArgument(f"the journal has no segment {segment} of request {request}")
            key, name = ref.key, f"{request}.{segment}"
        else:
            key = resolve_key(seg_store, key)  # type: ignore[arg-type]
            name = short_key(key)
        result = dump_segment(seg_store, key, output, name)
    done(f"segment {key} written to {result['path']}, verified")
    result["users"] = segment_users(state, key) if state is not None else []
    if as_json:
        emit_json(result)
        return
    who = "; ".join(f"request {u['request']} segment {u['segment']} tokens {u['tokens'][0]}..{u['tokens'][1]}"
                    if "request" in u and u["tokens"] else
                    f"request {u['request']} segment {u['segment']}" if "request" in u else
                    f"training step {u['training_step']} {u['tensor']}" for u in result["users"])
    out.print(f"segment {key}" + (f" ({who})" if who else "") + f": {result['dtype']} {result['shape']}, "
              f"{human_size(result['raw_size'])} -> {result['path']} ({result['format']}, "
              f"{human_size(result['bytes'])}), verified", markup=False)
