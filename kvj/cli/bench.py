"""``kvj bench``: measure this disk and machine, and recommend settings."""

from __future__ import annotations

import importlib
from typing import Annotated, Optional

import typer

from .common import JsonOpt, emit_json, out

DirOpt = typer.Option("--dir", metavar="DIR", help="A directory on the disk to measure [default: $TMPDIR].")

app = typer.Typer(no_args_is_help=False)


@app.callback(invoke_without_command=True)
def bench(ctx: typer.Context,
          directory: Annotated[Optional[str], DirOpt] = None,
          seconds: Annotated[float, typer.Option(min=0.05, help="Seconds per test.")] = 1.0,
          as_json: Annotated[bool, JsonOpt] = False) -> None:
    """Measure fsync latency, journal throughput per commit policy, and recommend settings.

    Like pg_test_fsync: run it on the disk that will hold the journal. Without a
    subcommand it measures 8 KiB write+fdatasync, write+fsync and O_DSYNC latency, kvj's
    durable records/s at several commit policies (and when waiting for every record),
    then prints advice. kvj bench journal compares kvj with SQLite and the seed design;
    kvj bench codecs measures the tensor codecs.
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..bench.disk import format_report, run

    result = run(str(directory) if directory else None, seconds)
    if as_json:
        emit_json(result)
    else:
        out.print(format_report(result), markup=False, highlight=False)


@app.command("journal")
def journal(directory: Annotated[Optional[str], DirOpt] = None,
            records: Annotated[int, typer.Option(min=100, help="Records per contender.")] = 100_000,
            as_json: Annotated[bool, JsonOpt] = False) -> None:
    """Compare kvj's group commit with SQLite (WAL, synchronous=FULL), the seed design
    (a JSON line and fsync per record, and batched) and the fsync floor, side by side.
    """
    from ..bench.journal import format_table, run

    rows = run(str(directory) if directory else None, records)
    if as_json:
        emit_json(rows)
    else:
        out.print(format_table(rows), markup=False, highlight=False)


@app.command("codecs")
def codecs(as_json: Annotated[bool, JsonOpt] = False) -> None:
    """Compare kvj's tensor codecs with torch.save, safetensors and zstd on identical tensors."""
    try:
        module = importlib.import_module("kvj.bench.codecs")
    except ModuleNotFoundError:
        raise typer.BadParameter("this kvj has no codec benchmark (kvj.bench.codecs)") from None
    rows = module.run()
    if as_json:
        emit_json(rows)
    else:
        out.print(module.format_table(rows), markup=False, highlight=False)
