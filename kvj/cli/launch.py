"""The console scripts' first code: Ctrl-C is honoured from the first instant.

Before anything else is imported, a SIGINT handler is installed that ends the process at
once with one line on stderr and status 130 (``kvj fsck``: 32, as e2fsck; ``kvj inspect
-f``: 0, silently, as the normal way to stop following). Stopping at any point is safe:
every write kvj makes survives a SIGKILL at any instant (data before the metadata that
points at it, atomic renames, a torn tail cut and kept on the next open), so an interrupt
needs no clean-up. Handling it here, rather than as a KeyboardInterrupt travelling up the
stack, means that no import in progress prints a traceback and no thread pool waiting for
its workers delays or swallows it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, NoReturn, Optional

_prog = "kvj"
_status = 130
_message: Optional[str] = "interrupted"


def on_interrupt(status: int, message: Optional[str] = "interrupted") -> None:
    """What Ctrl-C means from now on: exit ``status``, printing ``message`` unless None."""
    global _status, _message
    _status, _message = status, message


def _interrupted(_signum: int, _frame: Any) -> None:
    try:
        sys.stdout.flush()
    except BaseException:  # a closed pipe, or a flush the signal arrived in the middle of
        pass
    if _message:
        os.write(2, f"{_prog}: error: {_message}\n".encode())
    os._exit(_status)


def _install(prog: str) -> None:
    global _prog
    _prog = prog
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # started with Ctrl-C ignored (nohup, &): keep it so
        signal.signal(signal.SIGINT, _interrupted)


def kvj() -> NoReturn:
    """``kvj``: the console script."""
    _install("kvj")
    from kvj.cli.main import main

    main()


def journal_replay() -> NoReturn:
    """``journal_replay``: the console script."""
    _install("journal_replay")
    from kvj.cli.main import journal_replay_main

    journal_replay_main()
