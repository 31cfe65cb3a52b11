"""An armed handoff: the control file ``JOURNAL/handoff.json`` that arms one, read by the vLLM
connector (which hands requests off while it is armed) and by ``kvj status``. Apart from the
manifest (``kvj.ops.handoff``), so that these readers need none of recovery's modules."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from kvj.errors import FormatError, InvalidArgument, InvalidName, KvjError
from kvj.fileio import atomic_write
from kvj.journal import ranks
from kvj.names import check_request_id
from kvj.untrusted import read_json

#: The control file an armed handoff leaves in the journal directory (JSON: to, mode, state, ...).
CONTROL = "handoff.json"
#: What an armed engine does with its requests: hand them all off (vLLM aborts them), or let them finish.
MODES = ("abort", "finish")
#: An armed handoff, or its result written.
STATES = ("armed", "done")
#: A control record is a few hundred bytes: anything far larger is not one.
MAX_CONTROL_BYTES = 1 << 16


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
    """The handoff control record, or None when no handoff was ever armed. A file that is not
    one (read by ``read_json``: never through a symlink, never a FIFO, its size bounded) is
    ``FormatError``, or ``UnsafePath`` for a symlink, FIFO or device: it is written atomically,
    so anything else was put there."""
    path = control_path(journal)
    try:
        control = read_json(path, max_bytes=MAX_CONTROL_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except FormatError as exc:
        raise FormatError(f"not a handoff control file: {exc}") from None
    why = _wrong(control)
    if why:
        raise FormatError(f"{path} is not a handoff control file: {why}")
    return control


def _wrong(control: Any) -> Optional[str]:
    """What makes ``control`` no control record ``arm`` or ``write_control`` writes; None when nothing."""
    if not isinstance(control, dict):
        return f"a JSON {type(control).__name__}, not an object"
    try:
        check_request_id(control.get("to"))
    except InvalidName:
        return "'to' is not an engine name"
    if control.get("state") not in STATES:
        return f"'state' must be one of {', '.join(STATES)}"
    if "mode" in control and control["mode"] not in MODES:
        return f"'mode' must be one of {', '.join(MODES)}"
    if "requests" in control and not (type(control["requests"]) is int and control["requests"] >= 0):
        return "'requests' must be a count"
    manifest = control.get("manifest")
    if manifest is not None and not (isinstance(manifest, str) and manifest.isprintable()
                                     and os.path.basename(manifest) == f"manifest-{control['to']}.json"):
        return "'manifest' must be the path of the handoff manifest"
    return None


def armed_target(journal: str) -> Optional[str]:
    """The engine an armed handoff moves requests to; None when none is armed (one stat then).
    A control file that cannot be read arms nothing: the serving loop goes on, and
    ``kvj status`` reports the file."""
    if not os.path.lexists(control_path(journal)):
        return None
    try:
        control = read_control(journal)
    except (OSError, KvjError):
        return None
    return control["to"] if control is not None and control.get("state") == "armed" else None
