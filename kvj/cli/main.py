"""Entry points ``kvj`` and ``journal_replay``, and the one place failures become exit statuses.

``run`` invokes the click command behind a typer app and turns every exception into one
line on stderr and a status from ``errors.EXIT_CODES`` (``FSCK_CODES`` for fsck). No
traceback reaches the user unless KVJ_DEBUG=1.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from typing import Annotated, Callable, List, NoReturn, Optional

import typer

from kvj import __version__
from kvj.cli.options import click, usage_and_exit
from kvj.cli.output import OutputClosed, OutputFailed, StdoutGuard, reset_done, work_done
from kvj.cli.errors import DONE_UNREPORTED, EXIT_CODES, FSCK_USAGE, INTERRUPTED, IOERR, OK, USAGE, fail, report

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


#: The commands, in the order help lists them: name -> (module under kvj.cli, its function, or
#: None for a module whose typer app is a group of commands). A command's module is imported
#: only when it runs (``kvj status`` pays for no other command's imports) or when help,
#: completion or the docs need them all.
COMMANDS = {
    "status": ("status", "status"), "init": ("init", "init"), "migrate": ("init", "migrate"),
    "record": ("record", None), "flush": ("flush", "flush"), "replay": ("replay", "replay"),
    "recover": ("recover", "recover"), "serve": ("serve", "serve"), "handoff": ("handoff", "handoff"), "inspect": ("inspect", "inspect"),
    "compact": ("compact", "compact"), "prune": ("prune", "prune"), "fsck": ("fsck", "fsck"),
    "dump": ("dump", "dump"), "replicate": ("replicate", "replicate"), "restore": ("restore", "restore"),
    "verify": ("verify", "verify"), "bench": ("bench", None), "demo": ("demo", "demo"),
}

#: ``journal_replay``: the recovery command under the name of the well-known write-up.
legacy_app = typer.Typer(name="journal_replay", add_completion=False, pretty_exceptions_enable=False,
                         context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_STATUS_HELP)


def _register(typer_app: typer.Typer, argv: Optional[List[str]]) -> None:
    """Give ``typer_app`` its commands: for ``kvj``, only the command ``argv`` begins with, if it
    begins with one (and no shell completion is asking), else all of them, in ``COMMANDS`` order."""
    if typer_app is legacy_app:
        if not legacy_app.registered_commands:
            legacy_app.command()(importlib.import_module("kvj.cli.recover").journal_replay)
        return
    if typer_app is not app:
        return
    named = argv[0] if argv else None
    only = named in COMMANDS and "_KVJ_COMPLETE" not in os.environ
    app.registered_commands.clear()
    app.registered_groups.clear()
    for name, (module, function) in COMMANDS.items():
        if only and name != named:
            continue
        loaded = importlib.import_module(f"kvj.cli.{module}")
        if function is None:
            app.add_typer(loaded.app, name=name)
        else:
            command = getattr(loaded, function)  # kvj serve passes vLLM's options on (its context_settings)
            app.command(name, context_settings=getattr(command, "context_settings", None))(command)


def command(typer_app: typer.Typer, argv: Optional[List[str]] = None) -> "click.Command":
    """The click command behind a typer app (what docs and completions are generated from): for
    ``kvj``, with every command, or with only the one ``argv`` begins with (see ``_register``).

    Help shows what a user types, never typer's internal type names: a flag has no type
    column (not ``<bool>``), an argument only the metavar it was given (not ``<list[str]>``),
    and the usage line names arguments as man pages do (``FILE...``, ``[KEY]``, not
    ``{FILE}...``).
    """
    _register(typer_app, argv)
    root = typer.main.get_command(typer_app)
    todo = [root]
    while todo:
        cmd = todo.pop()
        todo += list(getattr(cmd, "commands", {}).values())
        for param in cmd.params:
            if getattr(param, "is_flag", False) or param.param_type_name == "argument":
                param.display_type_rich = _no_type  # type: ignore[method-assign]
            elif param.metavar is None:  # --status STATUS, --codec auto|raw|..., not --status <str>
                choices = _choices(param)
                param.metavar = "|".join(choices) if choices else (param.name or "").upper()
            if param.param_type_name == "argument":
                param.get_usage_pieces = _usage_pieces(param)  # type: ignore[method-assign]
                param.type = _no_metavar(param.type)
        cmd.get_help_option = _typeless(cmd.get_help_option)  # type: ignore[method-assign]
    return root


def _typeless(make: Callable[..., Optional["click.Option"]]) -> Callable[..., Optional["click.Option"]]:
    """``get_help_option`` whose -h/--help shows no type either."""
    def get_help_option(ctx: object) -> Optional["click.Option"]:
        option = make(ctx)
        if option is not None:
            option.display_type_rich = _no_type  # type: ignore[method-assign]
        return option
    return get_help_option


def _choices(param: "click.Parameter") -> List[str]:
    """A choice parameter's values (typer >= 0.20 keeps them on type_descriptor, click on type)."""
    holder = getattr(param, "type_descriptor", None) or getattr(param, "type", None)
    return [str(getattr(c, "value", c)) for c in getattr(holder, "choices", None) or ()]


def _no_type(ctx: object = None) -> None:
    return None


def _no_metavar(param_type: "click.ParamType") -> "click.ParamType":
    """A copy of an argument's click type that gives no metavar, the one place typer's help
    (0.28) takes an argument's type name from (``<str>``); it converts values as before."""
    quiet = copy.copy(param_type)
    quiet.get_metavar = lambda *_args, **_kwargs: ""  # type: ignore[method-assign]
    return quiet


def _usage_pieces(param: "click.Parameter") -> Callable[[object], List[str]]:
    """An argument's ``get_usage_pieces``: its name as a man page writes it (``FILE...``, ``[KEY]``)."""
    name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
    return lambda _ctx: [name if param.required else f"[{name}]"]


def run(typer_app: typer.Typer, argv: Optional[List[str]], prog: str) -> int:
    """Run a typer app; return its exit status, reporting any failure as one line on stderr."""
    try:
        from typer.completion import completion_init

        completion_init()  # shell completion scripts call back with _KVJ_COMPLETE set
    except ImportError:  # pragma: no cover - older typer registers completion on import
        pass
    cmd = command(typer_app, sys.argv[1:] if argv is None else argv)
    guard = StdoutGuard(sys.stdout)
    sys.stdout = guard  # type: ignore[assignment]
    reset_done()
    try:
        status = _invoke(cmd, argv, prog)
        guard.flush()  # here, not at exit: a full disk is reported like any other output failure
        return status
    except OutputClosed:
        return OK
    except OutputFailed as failed:
        return output_failed(prog, failed)
    finally:
        sys.stdout = guard.stream


def output_failed(prog: str, failed: OutputFailed) -> int:
    """Report standard output failing: 73 when the command's work was done and is durable
    (the message says what), 74 when nothing was."""
    what = work_done()
    if what is None:
        report(prog, f"cannot write to standard output: {failed.reason}")
        return IOERR
    report(prog, f"{what}; but its report could not be written to standard output: {failed.reason}")
    return DONE_UNREPORTED


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
        return fail(prog, exc)[0]
    return rv if isinstance(rv, int) else 0


def main(argv: Optional[List[str]] = None) -> NoReturn:
    """``kvj``: the console script."""
    sys.exit(run(app, argv, "kvj"))


def journal_replay_main(argv: Optional[List[str]] = None) -> NoReturn:
    """``journal_replay``: the console script (same as ``kvj recover``)."""
    sys.exit(run(legacy_app, argv, "journal_replay"))


if __name__ == "__main__":
    main()
