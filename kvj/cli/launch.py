"""The console scripts' first code: Ctrl-C is honoured from the first instant kvj runs.

Before anything else is imported, a SIGINT handler ends the process at once with one line and
status 130 (fsck: 32; ``inspect -f``: 0): every kvj write survives a SIGKILL, so no clean-up
is needed, and no import or thread pool can swallow or delay it. Python runs handlers in the
main thread only, so a watcher thread on the wakeup fd forwards a signal that landed in
another thread. A closed standard descriptor gets /dev/null, so no file kvj opens takes its
number (writing output then fails as ``kvj.cli.output.OutputFailed``).
"""

from __future__ import annotations

import _signal  # the C module: ``signal`` would import enum first, time in which Ctrl-C would be Python's
import _thread
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, List, NoReturn, Optional

_prog = "kvj"
_status = 130
_message: Optional[str] = "interrupted"

#: Statuses for Ctrl-C that a command has from its first instant on (by its name on the command line).
FIRST_STATUS = {"fsck": 32}  # kvj.cli.errors.FSCK_CANCELED (that module imports too much to be imported here)


def on_interrupt(status: int, message: Optional[str] = "interrupted") -> None:
    """What Ctrl-C means from now on: exit ``status``, printing ``message`` unless None."""
    global _status, _message
    _status, _message = status, message


#: Held by the one handler run that ends the process: Ctrl-C comes twice (sent on by the
#: watcher), and a second handler run inside the first must not print its line again.
_ending = _thread.allocate_lock()


def _interrupted(_signum: int, _frame: Any) -> None:
    if not _ending.acquire(False):
        return
    try:
        sys.stdout.flush()
    except BaseException:  # a closed pipe, or a flush the signal arrived in the middle of
        pass
    if _message:
        try:
            os.write(2, f"{_prog}: error: {_message}\n".encode())
        except OSError:
            pass
    os._exit(_status)


def _command(argv: List[str]) -> Optional[str]:
    """The command named on a ``kvj`` command line (its first word that is not an option)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _forward(wakeup: int, main: int) -> None:
    """The watcher: on the first SIGINT whichever thread it landed in, send it to ``main``."""
    while os.read(wakeup, 1) != bytes([_signal.SIGINT]):
        pass
    _signal.pthread_kill(main, _signal.SIGINT)


def _watch() -> None:
    """Start the watcher on Python's wakeup fd (a byte for each signal a Python handler takes)."""
    wakeup, notify = os.pipe()
    os.set_blocking(notify, False)  # as set_wakeup_fd requires: a full pipe drops a byte, never blocks
    _signal.set_wakeup_fd(notify)
    os.register_at_fork(after_in_child=lambda: _signal.set_wakeup_fd(-1))  # a forked child's is not ours
    _thread.start_new_thread(_forward, (wakeup, _thread.get_ident()))


def _install(prog: str, argv: List[str]) -> None:
    global _prog, _status
    _prog = prog
    handled = _signal.getsignal(_signal.SIGINT) is not _signal.SIG_IGN  # started with Ctrl-C ignored (nohup, &): keep it so
    if handled:
        _signal.signal(_signal.SIGINT, _interrupted)
    if prog == "kvj":
        _status = FIRST_STATUS.get(_command(argv) or "", _status)
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:  # closed: /dev/null, so that no file kvj opens takes its number
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if handled:
        _watch()  # after the standard descriptors: its pipe must not take one's number


def kvj() -> NoReturn:
    """``kvj``: the console script. ``kvj serve`` is vLLM's server: its parser reads every flag, and
    Ctrl-C and SIGTERM are its graceful shutdown (``kvj.cli.serve``), so it starts before the above."""
    if sys.argv[1:2] == ["serve"]:
        from kvj.cli.serve import main

        sys.exit(main(sys.argv[2:]))
    _start("kvj", "main")


def journal_replay() -> NoReturn:
    """``journal_replay``: the console script."""
    _start("journal_replay", "journal_replay_main")


def _start(prog: str, entry: str) -> NoReturn:
    """Install the handlers, then run ``kvj.cli.main``'s ``entry``. As the process ends, the cycle
    collector is frozen: it need not walk what the command built before the interpreter frees
    it (after a replay of 10^5 records its passes at exit took ~50 ms, two thirds of the
    interpreter's shutdown). Exit handlers and threads end as ever. Not after a command that
    imported Triton (torch's compiler, under transformers' Trainer: kvj demo, kvj bench
    training): frozen cycles are never freed, and Triton's bindings (nanobind) then report
    each of their objects still alive at exit as leaked, ~30 lines on stderr."""
    _install(prog, sys.argv[1:])
    import gc

    from kvj.cli import main

    try:
        getattr(main, entry)()
    finally:
        if "triton" not in sys.modules:
            gc.freeze()
