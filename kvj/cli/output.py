"""What commands print: the rich consoles (stdout for results, stderr for the rest), JSON lines,
warnings, progress bars, units, and the guard that turns a failing standard output into status 73/74."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, List, Optional

if TYPE_CHECKING:
    from rich.console import Console

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
