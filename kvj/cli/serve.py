"""``kvj serve``: vLLM's own OpenAI-compatible server whose replies survive ``kill -9`` and power loss.

``kvj serve MODEL --journal DIR [any vllm serve option]``. vLLM's parser reads the whole command
line (``kvj.cli.launch`` hands ``kvj serve`` here before anything else, so typer never sees
vLLM's flags) with a ``kvj`` group added; the typer command below exists so that ``kvj --help``,
the man page and completions list ``serve`` and its ``kvj`` options.
"""

from __future__ import annotations

import argparse
import json
from typing import Annotated, Any, Callable, List, Optional, Tuple

import typer

from kvj.cli.parse import parse_duration, parse_size
from kvj.cli.errors import INTERRUPTED, OK, USAGE, fail, report
from kvj.journal.reader import RECOVERY_MODES

PROG = "kvj serve"
USAGE_LINE = "kvj serve MODEL --journal DIR [--retention DURATION] [--admission arrival|durable] [vllm serve options]"
DESCRIPTION = ("vLLM's OpenAI-compatible server (its app, endpoints and options, in process) with kvj's "
               "connector: streams, Responses background mode and replies survive kill -9, SIGTERM and power "
               "loss. On start it recovers DIR and continues every reply that was in flight, in the background, "
               "while new requests are served. A client re-attaches with Last-Event-ID or ?starting_after=N. "
               "kvj serve --help=kvj lists kvj's options, --help=all every option.")

#: kvj serve's own options: flag, metavar or choices, default, help. The argparse group and the typer
#: command (docs) are both made from this.
OPTIONS: List[Tuple[str, Any, Optional[str], str]] = [
    ("--journal", "DIR", None, "Journal directory (created if missing): the engine's journal and store, and "
     "kvj serve's reply journal in DIR/replies/. Required."),
    ("--retention", "DURATION", "1h", "How long a finished reply stays fetchable after it finished (GET, "
     "re-attach), a DURATION with its unit (90s, 15m, 1h, 7d); then it is ended and compacted away."),
    ("--retention-bytes", "SIZE", "1GiB", "Budget for finished replies held (their tokens and request "
     "bodies); beyond it the oldest finished go first."),
    ("--admission", ("arrival", "durable"), "arrival", "arrival: a request is acknowledged at once; its "
     "record and tokens are group-committed within ~20 ms (a power loss in that window loses them). durable: "
     "acknowledged only once its start record is durable, and each token sent only once durable."),
    ("--store-bytes", "SIZE", None, "The segment store's byte budget: KV blocks of ended requests are a prefix "
     "cache evicted least recently used first beyond it (default: the journal's kvj.conf budget, else 16GiB)."),
    ("--recovery-mode", RECOVERY_MODES, "tolerate-torn-tail", "How the start-up recovery judges the end of "
     "the engine journal's log, as kvj recover --recovery-mode."),
    ("--from", "DIR", None, "The journal of a kvj serve that handed its running replies off to this one (kvj "
     "handoff -j DIR --to NAME --url URL): they continue here, their KV loaded read-only from DIR's store, and "
     "their clients re-attach here with the same ids."),
]
DEFAULT_STORE_BYTES = 16 << 30


def _typed(parse: Callable[[str, Optional[str]], Any], flag: str) -> Callable[[str], Any]:
    """An argparse ``type`` from one of kvj's parsers (their error, argparse's way)."""
    def convert(text: str) -> Any:
        try:
            return parse(text, flag)
        except typer.BadParameter as exc:
            raise argparse.ArgumentTypeError(str(exc.message)) from None
    return convert


def make_parser() -> Any:
    """vLLM's ``vllm serve`` parser with a ``kvj`` argument group."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog=PROG, usage=USAGE_LINE, description=DESCRIPTION))
    group = parser.add_argument_group("kvj", "kvj serve's own options (every other option is vllm serve's)")
    types = {"--retention": parse_duration, "--retention-bytes": parse_size, "--store-bytes": parse_size}
    for flag, shape, default, text in OPTIONS:
        kwargs: dict = {"default": default, "help": text}
        if isinstance(shape, tuple):
            kwargs["choices"] = shape
        else:
            kwargs["metavar"] = shape
        if flag in types:
            kwargs["type"] = _typed(types[flag], flag)
            kwargs["default"] = None if default is None else types[flag](default, flag)
        group.add_argument(flag, required=flag == "--journal", **kwargs)
    return parser


def parse(argv: List[str]) -> Tuple[Any, Any]:
    """vLLM's args (with kvj's connector in ``--kv-transfer-config``) and kvj serve's ``Options``."""
    import os

    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    from kvj.journal.config import config_max_store_bytes
    from kvj.serve.launch import Options, refusal, transfer_config

    cli_env_setup()
    parser = make_parser()
    parser.error = _refuse  # type: ignore[method-assign]  # one line, as every kvj command's
    if any(a in ("--kv-transfer-config", "-kvtc") or a.startswith("--kv-transfer-config=") for a in argv):
        parser.error("kvj serve configures the KV connector itself: leave --kv-transfer-config out")
    args = parser.parse_args(argv)
    if getattr(args, "kv_transfer_config", None) is not None:  # from a --config file
        parser.error("kvj serve configures the KV connector itself: leave kv-transfer-config out of --config")
    why = refusal(args)
    if why is not None:
        parser.error(f"kvj serve does not run {why}")
    journal = os.path.abspath(args.journal)
    budget = args.store_bytes
    if budget is None:
        try:
            budget = config_max_store_bytes(journal)
        except Exception:  # a kvj.conf every command refuses: the start-up says so, in one line
            budget = None
    source = os.path.abspath(getattr(args, "from")) if getattr(args, "from") else None
    if source == journal:
        parser.error("--from names this server's own journal")
    options = Options(journal, args.retention, args.retention_bytes, args.admission,
                      DEFAULT_STORE_BYTES if budget is None else budget, args.recovery_mode, source)
    # parsed by vLLM exactly as the flag would be
    args = parser.parse_args(argv + ["--kv-transfer-config", json.dumps(transfer_config(options))])
    if args.model_tag is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    return args, options


def _refuse(message: str) -> None:
    """argparse's error, as one line (``kvj serve: error: ...``) and the usage status."""
    report(PROG, message)
    raise SystemExit(2)


def main(argv: List[str]) -> int:
    """``kvj serve ARGS``: its exit status (kvj(1)'s: 64 usage, 65 damaged journal, 75 locked, 77 permission)."""
    try:
        args, options = parse(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, sysexits' 64 here)
        return OK if exc.code in (0, None) else USAGE
    except (ValueError, TypeError) as exc:  # vLLM's own checks of its options
        report(PROG, str(exc))
        return USAGE
    except KeyboardInterrupt:  # Ctrl-C while vLLM imports: nothing was started or written
        report(PROG, "interrupted")
        return INTERRUPTED
    from vllm.logger import configure_logging_from_args

    from kvj.serve.launch import run

    configure_logging_from_args(args) if hasattr(args, "log_config_file") else None
    try:
        run(args, options)
    except (Exception, KeyboardInterrupt) as exc:
        return fail(PROG, exc)[0]
    return OK


def serve(ctx: typer.Context,
          model: Annotated[Optional[str], typer.Argument(metavar="MODEL", help="The model to serve (as vllm "
                                                         "serve's).", show_default=False)] = None,
          journal: Annotated[Optional[str], typer.Option("--journal", metavar="DIR", help=OPTIONS[0][3])] = None,
          retention: Annotated[str, typer.Option("--retention", metavar="DURATION", help=OPTIONS[1][3])] = "1h",
          retention_bytes: Annotated[str, typer.Option("--retention-bytes", metavar="SIZE",
                                                       help=OPTIONS[2][3])] = "1GiB",
          admission: Annotated[str, typer.Option("--admission", metavar="arrival|durable",
                                                 help=OPTIONS[3][3])] = "arrival",
          store_bytes: Annotated[Optional[str], typer.Option("--store-bytes", metavar="SIZE",
                                                             help=OPTIONS[4][3])] = None,
          recovery_mode: Annotated[str, typer.Option("--recovery-mode", metavar="|".join(RECOVERY_MODES),
                                                     help=OPTIONS[5][3])] = "tolerate-torn-tail",
          source: Annotated[Optional[str], typer.Option("--from", metavar="DIR", help=OPTIONS[6][3])] = None) -> None:
    """Serve MODEL with vLLM's OpenAI-compatible server; replies survive kill -9 and power loss.

    kvj serve MODEL --journal DIR [any vllm serve option] runs vLLM's own server (its app, its
    endpoints, its options, in this process) with kvj's connector. After a crash, a SIGTERM or a
    power loss, start it again on the same journal: it recovers DIR (as kvj recover; damage is
    refused with status 65), and continues every reply that was in flight, token for token, in
    the background while new requests are served. A client that lost its stream re-attaches:
    Responses with GET /v1/responses/ID?stream=true&starting_after=N; chat and completions with
    GET /v1/chat/completions/ID?stream=true (or /v1/completions/ID) and Last-Event-ID: N, ID
    being the reply's id (its X-Request-Id). Every other option is vllm serve's: kvj serve
    --help lists them all. docs/serve.md has the operator's page and the extension endpoints.
    Exit status as kvj(1): 64 a usage error, 65 a damaged journal, 75 a journal another writer
    holds, 77 a journal it may not write.
    """
    argv = ([model] if model else []) + (["--journal", journal] if journal else []) + [
        "--retention", retention, "--retention-bytes", retention_bytes, "--admission", admission,
        "--recovery-mode", recovery_mode] + (["--store-bytes", store_bytes] if store_bytes else []) + \
        (["--from", source] if source else []) + list(ctx.args)
    raise typer.Exit(main(argv))


#: typer lets vLLM's options through to ``serve`` (``ctx.args``); ``kvj.cli.main`` registers it with these.
serve.context_settings = {"allow_extra_args": True, "ignore_unknown_options": True,  # type: ignore[attr-defined]
                          "help_option_names": ["-h", "--help"]}
