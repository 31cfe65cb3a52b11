"""What every command shares: the journal/store/json options, output, progress and parsers."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, TypeVar

import typer

try:  # typer >= 0.20 vendors click; older releases depend on it
    from typer import _click as click
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - depends on the installed typer
    import click  # type: ignore[no-redef]
    from click import get_current_context  # type: ignore[no-redef]

from kvj.errors import FormatError, InvalidArgument, NotFound, UnsafePath
from kvj.journal.config import STORE_DIR, config_store
from kvj.journal.replay import check_journal, holds_journal
from kvj.trust import check_owner, trusted
from kvj.journal.ranks import holds_ranks, rank_journals, rank_name

if TYPE_CHECKING:
    from rich.console import Console

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

#: NO_COLOR (no-color.org) turns off every escape sequence, bold included, not just colours.
_STYLES = None if os.environ.get("NO_COLOR") else "auto"


class _LazyConsole:
    """A rich ``Console`` made on first use, so that a command printing only JSON never imports
    rich's console (a twentieth of ``kvj status --json``'s whole run); it stands in for it."""

    def __init__(self, stderr: bool) -> None:
        object.__setattr__(self, "_stderr", stderr)
        object.__setattr__(self, "_made", None)

    @property
    def console(self) -> "Console":
        """The console itself (made now if it was not yet), for APIs that keep one."""
        if self._made is None:
            from rich.console import Console

            object.__setattr__(self, "_made", Console(stderr=self._stderr, highlight=False, soft_wrap=True,
                                                      color_system=_STYLES))  # type: ignore[arg-type]
        return self._made

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.console, name, value)


#: Standard output for results; diagnostics and progress go to stderr.
out: "Console" = _LazyConsole(stderr=False)  # type: ignore[assignment]
err: "Console" = _LazyConsole(stderr=True)  # type: ignore[assignment]


class OutputClosed(BaseException):
    """Whoever read standard output has gone (``kvj inspect | head``): stop quietly.

    A BaseException, so that nothing between the write and the entry point takes it for a
    failure of the command itself.
    """


class OutputFailed(BaseException):
    """Standard output cannot be written: closed (``>&-``), its disk full (``> /dev/full``),
    an I/O error. The command stops; the entry point says whether its work was already done
    (``done``): status 73 when it was, 74 when nothing was. A BaseException, as
    ``OutputClosed``."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error

    @property
    def reason(self) -> str:
        return self.error.strerror or str(self.error)


#: What the running command has made durable, once it has (``done``).
_done: List[str] = []


def done(what: str) -> None:
    """Say, before printing about it, that the command's durable work is done: should its
    output then fail, the error says ``what`` was done, with status 73 (not 74, which
    says nothing after the failure is durable)."""
    _done[:] = [what]


def work_done() -> Optional[str]:
    """What ``done`` last said in this command, or None."""
    return _done[0] if _done else None


def reset_done() -> None:
    _done.clear()


class StdoutGuard:
    """Wraps ``sys.stdout``: a write to a closed pipe raises ``OutputClosed`` once, any other
    failure to write (a closed descriptor, a full disk) ``OutputFailed``; standard output
    then points at /dev/null, so that nothing later (the exit flush) fails again."""

    def __init__(self, stream: Any):
        self.stream = stream  # None when kvj was started with standard output closed

    def _aside(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a real descriptor (captured in tests), or none
            pass

    def _closed(self) -> "OutputClosed":
        self._aside()
        return OutputClosed()

    def _failed(self, error: OSError) -> "OutputFailed":
        self._aside()
        if self.stream is not None:
            try:  # what is still buffered goes to /dev/null now
                self.stream.flush()
            except (OSError, ValueError):
                pass
        return OutputFailed(error)

    def write(self, text: str) -> int:
        if self.stream is None:
            raise self._failed(OSError(errno.EBADF, "standard output is closed"))
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise self._closed() from None
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise self._closed() from None
        except OSError as exc:
            raise self._failed(exc) from None

    def isatty(self) -> bool:
        return self.stream is not None and self.stream.isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def emit_json(obj: Any) -> None:
    """Print one JSON object on one line (NDJSON-friendly), always strict JSON: a non-finite
    float that an older journal may hold is printed as the string "NaN", "Infinity" or
    "-Infinity", never as a bare token no JSON parser accepts."""
    try:
        text = json.dumps(obj, separators=(",", ":"), default=_jsonable, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(obj), separators=(",", ":"), default=_jsonable, allow_nan=False)
    sys.stdout.write(text + "\n")


def show(result: Any, as_json: bool, lines: Callable[[], Iterable[str]]) -> None:
    """Print a command's result: ``result.to_dict()`` as one JSON line, or the plain-text
    lines that ``lines()`` makes."""
    if as_json:
        emit_json(result.to_dict())
        return
    for line in lines():
        out.print(line, markup=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _no_constant(name: str) -> Any:
    raise FormatError(f"{name} is not a JSON value")


def loads_strict(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity (not JSON; what kvj prints must stay JSON);
    anything it cannot read, absurd nesting included, is ``FormatError``."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise FormatError("JSON nested too deeply") from None
    except ValueError as exc:
        raise FormatError(f"not JSON: {exc}") from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


def warn(message: str) -> None:
    """One line on stderr that does not fail the command: ``kvj: warning: message``."""
    err.print(f"kvj: warning: {' '.join(message.split())}", markup=False)


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


def interactive() -> bool:
    """Progress bars and colour only for a person at a terminal."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))


@contextmanager
def progress() -> Iterator[Callable[[str, int, int], None]]:
    """A ``progress(description, done, total)`` callback: a rich bar on a terminal, else silent.

    The bar appears only once the work has taken more than a second.
    """
    if not interactive():
        yield lambda _d, _n, _t: None
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                   console=err.console, transient=True)  # type: ignore[attr-defined]
    tasks: dict = {}
    started = time.monotonic()

    def update(description: str, done: int, total: int) -> None:
        if not bar.live.is_started:
            if time.monotonic() - started < 1.0:
                return
            bar.start()
        if description not in tasks:
            tasks[description] = bar.add_task(description, total=total)
        bar.update(tasks[description], completed=done, total=total)

    try:
        yield update
    finally:
        if bar.live.is_started:
            bar.stop()


# -- journal and store paths ---------------------------------------------------------------


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


# -- units -------------------------------------------------------------------------------


def rate(nbytes: float, seconds: float) -> str:
    """A transfer rate in the unit that suits it (a small one is not "0.00 GB/s")."""
    from kvj.ops.inspection import human_size

    if seconds <= 0:
        return "-"
    per_s = nbytes / seconds
    return f"{per_s / 1e9:.2f} GB/s" if per_s >= 1e9 else f"{human_size(per_s)}/s"


def ago(when: Optional[float], now: Optional[float] = None) -> str:
    """How long ago Unix time ``when`` was, as a person says it."""
    if when is None:
        return "time unknown"
    secs = max(0.0, (time.time() if now is None else now) - when)
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if secs >= size:
            return f"{secs / size:.0f} {unit} ago" if unit != "days" or secs >= 2 * size else "1 day ago"
    return f"{secs:.0f} s ago"


# -- parsers -------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_BARE_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")

#: The one rule every command's time arguments follow (each man page states it).
DURATION_RULE = ("a DURATION is a number with its unit: ms, s, m, h, d or w (90s, 15m, 1h, 7d); a bare number "
                 "is refused, except 0")
TIME_RULE = ("a TIME is ISO 8601 (2026-11-29T15:00, local time unless it names a zone), @ and Unix seconds "
             "(@1796134025, as date -d takes them), or a DURATION ago (10m); a bare number is refused")


def parse_duration(text: str, option: Optional[str] = None) -> float:
    """Seconds from ``90s``, ``15m``, ``1h``, ``2d`` (``DURATION_RULE``: the unit is required,
    so that ``7`` is never read as seven seconds when seven days were meant; ``0`` is zero)."""
    text = text.strip()
    if text == "0":
        return 0.0
    m = _DURATION.match(text)
    if not m:
        why = "has no unit" if _BARE_NUMBER.match(text) else "is not a duration"
        raise typer.BadParameter(f"{text!r} {why}: {DURATION_RULE}", param_hint=option)
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds):
        raise typer.BadParameter(f"{text!r} is too long a duration", param_hint=option)
    return seconds


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(|B|K|KB|KiB|M|MB|MiB|G|GB|GiB|T|TB|TiB)$", re.I)


def parse_size(text: str, option: Optional[str] = None) -> int:
    """Bytes from ``65536``, ``64KiB``, ``64MiB``, ``1G``, ``2T`` (K, M, G, T are binary, as ls -h)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size (use e.g. 64MiB, 512K, 1G)", param_hint=option)
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])


def parse_time(text: str, option: Optional[str] = None, now: Optional[float] = None) -> float:
    """A point in time as Unix seconds (``TIME_RULE``): ISO 8601 (``2026-11-29T15:00``),
    ``@`` and Unix seconds (``@1796134025``), or a duration ago (``10m``). A bare number is
    refused: it could mean seconds ago or Unix seconds, and each reading was once some
    command's."""
    text = text.strip()
    unix = re.fullmatch(r"@(-?\d+(?:\.\d+)?)", text)
    if unix:
        return float(unix.group(1))
    if _BARE_NUMBER.match(text):
        raise typer.BadParameter(f"{text!r} is a bare number: {TIME_RULE}", param_hint=option)
    try:
        return datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError, OSError):
        pass
    try:
        return (time.time() if now is None else now) - parse_duration(text, option)
    except typer.BadParameter:
        raise typer.BadParameter(f"{text!r} is not a time: {TIME_RULE}", param_hint=option) from None


def parse_range(text: str, what: str = "range") -> Tuple[int, int]:
    """``A:B`` (end exclusive) as two non-negative ints."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or int(m.group(1)) > int(m.group(2)):
        raise typer.BadParameter(f"{text!r} is not a {what} START:END with START <= END")
    return int(m.group(1)), int(m.group(2))


def parse_pairs(items: Optional[list], what: str, typed: bool = True) -> dict:
    """``key=value`` options into a dict; with ``typed``, values that parse as JSON keep their type."""
    result: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=what)
        try:
            result[key] = loads_strict(value) if typed else value
        except FormatError:  # not JSON (or NaN, nested absurdly): the text itself
            result[key] = value
    return result

