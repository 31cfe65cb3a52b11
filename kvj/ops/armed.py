"""An armed handoff: the control file ``JOURNAL/handoff.json`` that arms one, read by the vLLM
connector (which hands requests off while it is armed) and by ``kvj status``. Apart from the
manifest (``kvj.ops.handoff``), so that these readers need none of recovery's modules."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from kvj.errors import InvalidArgument
from kvj.fileio import atomic_write
from kvj.journal import ranks
from kvj.names import check_request_id

#: The control file an armed handoff leaves in the journal directory (JSON: to, mode, state, ...).
CONTROL = "handoff.json"
#: What an armed engine does with its requests: hand them all off (vLLM aborts them), or let them finish.
MODES = ("abort", "finish")


def control_path(journal: str) -> str:
    return os.path.join(journal, CONTROL)


def arm(journal: str, to: str, mode: str = "abort") -> Dict[str, Any]:
    """Arm a handoff of ``journal``'s engine to engine ``to`` (a name: the characters of a
    request id); returns the control record written."""
    check_request_id(to)
    if mode not in MODES:
        raise InvalidArgument(f"handoff mode must be one of {', '.join(MODES)}, not {mode!r}")
    if not os.path.isdir(journal):
        raise InvalidArgument(f"{journal} is not a journal directory")
    sizes = ranks.read_sizes(journal)
    if sizes is not None and sizes != (1, 1):
        raise InvalidArgument(f"{journal} is a tensor- or pipeline-parallel engine's journal "
                              f"({sizes[0]} x {sizes[1]} ranks): kvj hands off engines of one rank only")
    control = {"to": to, "mode": mode, "state": "armed", "armed_at": time.time()}
    write_control(journal, control)
    return control


def write_control(journal: str, control: Dict[str, Any]) -> None:
    """Replace the control file with ``control`` (atomically, fsynced): arming, or the result."""
    atomic_write(control_path(journal), (json.dumps(control, sort_keys=True) + "\n").encode())


def read_control(journal: str) -> Optional[Dict[str, Any]]:
    """The handoff control record, or None when no handoff was ever armed (or it is unreadable)."""
    try:
        with open(control_path(journal), encoding="utf-8") as f:
            control = json.load(f)
    except (OSError, ValueError):
        return None
    return control if isinstance(control, dict) and isinstance(control.get("to"), str) else None


def armed_target(journal: str) -> Optional[str]:
    """The engine an armed handoff moves requests to; None when none is armed (one stat then)."""
    if not os.path.exists(control_path(journal)):
        return None
    control = read_control(journal)
    return control["to"] if control is not None and control.get("state") == "armed" else None
