"""Entry points ``kvj`` and ``journal_replay``, and the one place failures become exit statuses.

``run`` invokes the click command behind a typer app and turns every exception into one
line on stderr and a status from ``errors.EXIT_CODES`` (``FSCK_CODES`` for fsck). No
traceback reaches the user unless KVJ_DEBUG=1.
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated, List, NoReturn, Optional

import typer

from kvj import __version__
from kvj.cli import bench, compact, dump, flush, fsck, init, inspect, prune, record, recover, replay
from kvj.cli import replicate, restore, verify
from kvj.cli.common import OutputClosed, StdoutGuard, click, usage_and_exit
from kvj.cli.errors import EXIT_CODES, FSCK_USAGE, INTERRUPTED, OK, USAGE, classify, debug, report

EXIT_STATUS_HELP = "Exit status: " + "; ".join(f"{code} {text.split(':')[0].split(' (')[0]}"
                                                for code, text in EXIT_CODES.items()) + ". See kvj(1)."

app = typer.Typer(name="kvj", no_args_is_help=False, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown",
                  context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_STATUS_HELP)


def _print_version(value: bool) -> None:
    if value:
        print(f"kvj {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(ctx: typer.Context,
         version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """Make GPU KV caches and training state survive crashes: a write-ahead journal of what is
    in flight, a store of checksummed tensor segments, and recovery.

    After a crash: kvj fsck, then kvj recover (or kvj replay to look first). The journal
    directory comes from --journal or KVJ_JOURNAL; the segment store defaults to its
    segments/ folder (--store or KVJ_STORE to change it).
    """
    if ctx.invoked_subcommand is None:
        usage_and_exit(ctx)


app.command("init")(init.init)
app.command("migrate")(init.migrate)
app.add_typer(record.app, name="record")
app.command("flush")(flush.flush)
app.command("replay")(replay.replay)
app.command("recover")(recover.recover)
app.command("inspect")(inspect.inspect)
app.command("compact")(compact.compact)
app.command("prune")(prune.prune)
app.command("fsck")(fsck.fsck)
app.command("dump")(dump.dump)
app.command("replicate")(replicate.replicate)
app.command("restore")(restore.restore)
app.command("verify")(verify.verify)
app.add_typer(bench.app, name="bench")

#: ``journal_replay``: the recovery command under the name of the well-known write-up.
legacy_app = typer.Typer(name="journal_replay", add_completion=False, pretty_exceptions_enable=False,
                         context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_STATUS_HELP)
legacy_app.command()(recover.journal_replay)


def command(typer_app: typer.Typer) -> "click.Command":
    """The click command behind a typer app (what docs and completions are generated from)."""
    return typer.main.get_command(typer_app)


def run(typer_app: typer.Typer, argv: Optional[List[str]], prog: str) -> int:
    """Run a typer app; return its exit status, reporting any failure as one line on stderr."""
    try:
        from typer.completion import completion_init

        completion_init()  # shell completion scripts call back with _KVJ_COMPLETE set
    except ImportError:  # pragma: no cover - older typer registers completion on import
        pass
    cmd = command(typer_app)
    guard = StdoutGuard(sys.stdout)
    sys.stdout = guard  # type: ignore[assignment]
    try:
        return _invoke(cmd, argv, prog)
    except OutputClosed:
        return OK
    finally:
        sys.stdout = guard.stream


def _invoke(cmd: "click.Command", argv: Optional[List[str]], prog: str) -> int:
    try:
        rv = cmd.main(args=argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.UsageError as exc:
        ctx = exc.ctx
        where = ctx.command_path if ctx is not None else prog
        hint = f" (see '{where} --help')" if ctx is not None else ""
        report(prog, f"{exc.format_message()}{hint}")
        return FSCK_USAGE if ctx is not None and ctx.info_name == "fsck" else USAGE
    except typer.Abort:
        report(prog, "interrupted")
        return INTERRUPTED
    except click.exceptions.ClickException as exc:
        report(prog, exc.format_message())
        return USAGE
    except (Exception, KeyboardInterrupt) as exc:
        status, message = classify(exc)
        if debug():
            traceback.print_exc()
        report(prog, message)
        return status
    return rv if isinstance(rv, int) else 0


def main(argv: Optional[List[str]] = None) -> NoReturn:
    """``kvj``: the console script."""
    sys.exit(run(app, argv, "kvj"))


def journal_replay_main(argv: Optional[List[str]] = None) -> NoReturn:
    """``journal_replay``: the console script (same as ``kvj recover``)."""
    sys.exit(run(legacy_app, argv, "journal_replay"))


if __name__ == "__main__":
    main()
