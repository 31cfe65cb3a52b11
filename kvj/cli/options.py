"""The options every command shares (journal, store, mirror, recovery mode, JSON), the checks of
the paths they name, and usage errors."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, TypeVar

import typer

try:  # typer >= 0.20 vendors click; older releases depend on it
    from typer import _click as click
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - depends on the installed typer
    import click  # type: ignore[no-redef]
    from click import get_current_context  # type: ignore[no-redef]

from kvj.errors import InvalidArgument, NotFound, UnsafePath
from kvj.journal.config import STORE_DIR, config_store
from kvj.journal.ranks import holds_ranks, rank_journals, rank_name
from kvj.journal.replay import check_journal, holds_journal
from kvj.trust import check_owner, trusted

JOURNAL_ENV = "KVJ_JOURNAL"
STORE_ENV = "KVJ_STORE"
MIRROR_ENV = "KVJ_MIRROR"
T = TypeVar("T")

JournalOpt = typer.Option("--journal", "-j", envvar=JOURNAL_ENV, show_envvar=True, metavar="DIR",
                          help="Journal directory.")
StoreOpt = typer.Option("--store", "-s", envvar=STORE_ENV, show_envvar=True, metavar="DIR",
                        help="Segment store directory [default: the one JOURNAL/kvj.conf names, else "
                             "JOURNAL/segments].")
MirrorOpt = typer.Option("--mirror", envvar=MIRROR_ENV, show_envvar=True, metavar="DIR",
                         help="Keep a synchronous mirror of the log in DIR (ideally on another device): every "
                              "commit group is synced to both before it counts. The journal remembers it: needed "
                              "once.")
MirrorPolicyOpt = typer.Option("--mirror-policy", metavar="fail|degrade",
                               help="When the mirror fails: fail the writer (the default), or go on with the "
                                    "journal's copy alone after a warning.")
RecoveryModeOpt = typer.Option("--recovery-mode", metavar="MODE",
                               help="What ends the log (kvj-journal(5), RECOVERY MODES): tolerate-torn-tail (the "
                                    "default: a torn tail is cut, a damaged tail is an error), absolute-consistency "
                                    "(both are errors), point-in-time (recovery stops before the first damage and "
                                    "records the loss).")
JsonOpt = typer.Option("--json", help="Print JSON (one object, or NDJSON for record streams) for scripts and jq.")


#: Paths are plain strings, so an unreadable one fails in the command with the OS's error
#: (exit status 77), not in option parsing as a usage error.
JournalArg = Annotated[Optional[str], JournalOpt]
StoreArg = Annotated[Optional[str], StoreOpt]
JsonArg = Annotated[bool, JsonOpt]
MirrorArg = Annotated[Optional[str], MirrorOpt]
MirrorPolicyArg = Annotated[str, MirrorPolicyOpt]
RecoveryModeArg = Annotated[str, RecoveryModeOpt]


def usage_error(message: str) -> Exception:
    """A usage error (exit status 64; 16 for fsck) tied to the command being run."""
    return click.exceptions.UsageError(message, ctx=get_current_context(silent=True))


def usage_and_exit(ctx: "typer.Context") -> None:
    """A command group run without a command (``kvj``, ``kvj record``): its usage on stderr and
    status 64, so that a script notices."""
    from contextlib import redirect_stdout

    from kvj.cli.errors import USAGE

    with redirect_stdout(sys.stderr):  # typer's rich help prints for itself
        text = ctx.get_help()
    if text:
        print(text, file=sys.stderr)
    raise typer.Exit(USAGE)


def journal_path(path: Optional[str], *, writing: bool = False, ranks_ok: bool = False) -> str:
    """Check that ``path`` names a kvj journal directory; returns it absolute.

    Missing, or a directory holding no journal files, is missing input (``FileNotFoundError``);
    unreadable, a permission error, by the OS itself; a seed-era JSON-lines journal is
    ``LegacyJournal`` (pointing at ``kvj migrate``, which alone reads it) and any other file
    ``FormatError``. A command that writes (``writing``) never creates a journal: a path that
    is not one is ``NotFound``, pointing at ``kvj init``. A directory of rank journals (a
    parallel vLLM engine's, ``kvj.journal.ranks``) is returned where ``ranks_ok``, else
    ``NotFound`` naming its rank journals.
    """
    if path is None or not os.fspath(path):  # an empty -j "" would otherwise name the current directory
        raise usage_error(f"no journal given: use --journal DIR or set {JOURNAL_ENV}")
    full = os.path.abspath(os.fspath(path))
    if not writing:
        os.stat(full)  # missing or unreachable: FileNotFoundError, PermissionError, NotADirectoryError
    if os.path.isfile(full):
        check_owner(os.path.dirname(os.path.realpath(full)))  # before a byte of it is read
    elif os.path.isdir(full):
        check_owner(full)
    check_journal(full)
    if os.path.isdir(full) and not holds_journal(full) and holds_ranks(full):
        if ranks_ok:
            return full
        first = os.path.join(full, rank_name(0, 0))
        raise NotFound(f"{full} holds one journal per rank of a tensor/pipeline-parallel engine "
                       f"({', '.join(os.path.basename(j) for j in rank_journals(full).values())}): give one, "
                       f"-j {first}; kvj recover -j {full} recovers them all (fsck, status, inspect, compact and "
                       "prune also take the engine's directory)")
    if not os.path.isdir(full) or not holds_journal(full):
        if writing:
            raise NotFound(f"{full} is not a kvj journal: kvj writes only to a journal made on purpose "
                           f"(kvj init -j {path})")
        raise FileNotFoundError(2, "not a kvj journal (no log files)", full)
    return full


def engine_ranks(path: str, store: Optional[str]) -> Optional[List[Tuple[str, Optional[str]]]]:
    """Each rank of the engine directory ``path`` (``journal_path(..., ranks_ok=True)``) as (rank
    name, its journal checked as ``journal_path`` checks one, or None where that rank never made
    one: nothing of it is durable), in ``kvj.journal.ranks``' order; None when ``path`` is one
    journal. Each rank journal has its own store: a ``--store`` (or KVJ_STORE) is refused."""
    if holds_journal(path) or not holds_ranks(path):
        return None
    if store is not None:
        raise InvalidArgument(f"{path} holds one journal per rank, each with its own store: --store (or {STORE_ENV}) "
                              f"applies to one journal (-j {os.path.join(path, rank_name(0, 0))})")
    return [(rank_name(t, p), journal_path(journal) if os.path.isdir(journal) and holds_journal(journal) else None)
            for (t, p), journal in rank_journals(path).items()]


def on_rank(name: str, run: Callable[[], T]) -> Tuple[Optional[T], int, str]:
    """``run()`` on rank journal ``name`` of an engine directory: its result, or (None, exit status,
    message) once the failure is reported naming the rank, so that the other ranks go on."""
    from kvj.cli.errors import fail

    try:
        return run(), 0, ""
    except (KeyboardInterrupt, typer.Exit, click.exceptions.ClickException):
        raise
    except Exception as exc:
        status, message = fail("kvj", exc, name)
        return None, status, message


def rank_lines(ranks: List[Dict[str, Any]], lines: Callable[[str], Iterable[str]], verb: str,
               verbed: str) -> Iterator[str]:
    """Each rank's lines after its name (``lines(name)``), or why it has none (missing, its error)."""
    for rank in ranks:
        name = rank["rank"]
        if rank.get("missing"):
            yield f"{name}: no journal, nothing to {verb}"
        elif "error" in rank:
            yield f"{name}: not {verbed}: {rank['error']}"
        else:
            yield from (f"{name}: {line}" for line in lines(name))


def store_path(journal: str, store: Optional[str]) -> str:
    """The store directory: ``--store`` (or KVJ_STORE), else the journal's own, as
    ``Journal.open`` finds it: the one its kvj.conf names, or ``segments/`` inside it (never
    a link planted there: a store elsewhere is named with --store or kvj init --store)."""
    if store is not None and not os.fspath(store):
        raise usage_error(f"an empty --store (or {STORE_ENV}) names no store")
    if store is None and os.path.isdir(journal):
        store = config_store(journal)
    if store is not None:
        path = os.path.abspath(os.fspath(store))
    else:  # segments/ inside the journal
        path = os.path.join(journal, STORE_DIR)
        if os.path.islink(path) and not trusted():
            raise UnsafePath(f"{path} is a symbolic link: refused (name a store elsewhere with --store or "
                             f"{STORE_ENV})")
    if os.path.isdir(path):
        check_owner(path)
    return path
