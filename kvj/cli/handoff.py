"""``kvj handoff``: move a serving engine's live requests to another engine (kvj.ops.handoff)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvj.cli.options import JournalArg, JsonArg, journal_path, usage_error
from kvj.cli.output import done, emit_json, out
from kvj.cli.errors import TEMPFAIL, report
from kvj.ops.armed import MODES
from kvj.ops.handoff import HandoffTimeout, hand_off


def handoff(journal: JournalArg = None,
            to: Annotated[Optional[str], typer.Option("--to", metavar="NAME",
                                                      help="The engine that continues the requests.")] = None,
            mode: Annotated[str, typer.Option(metavar="MODE", help="abort: hand every request off; finish: let "
                                              "them finish here.")] = "abort",
            url: Annotated[Optional[str], typer.Option(metavar="URL", help="The server whose requests to stop: "
                                                       "a kvj serve (POST URL/v1/kvj/handoff: no dev mode, it keeps "
                                                       "accepting requests) or a vllm serve (POST URL/pause; needs "
                                                       "VLLM_SERVER_DEV_MODE=1).")] = None,
            timeout: Annotated[float, typer.Option(min=0.0, metavar="SECONDS",
                                                   help="How long to wait for the requests.")] = 600.0,
            as_json: JsonArg = False) -> None:
    """Hand the live requests of an engine running kvj's vLLM connector off to another engine.

    Arms the handoff (JOURNAL/handoff.json), pauses the server at --url if given (otherwise
    pause it yourself, with mode=abort), waits until every request in flight is journaled
    as moved (a handoff record after its last blocks) or finished, and writes
    JOURNAL/handoff/manifest-NAME.json, kvj recover's manifest schema: the other engine,
    started with "sources": [JOURNAL], continues them with resume(llm, MANIFEST). From a kvj
    serve, the other one is kvj serve --journal ITS_OWN --from JOURNAL: it continues the
    replies handed off and their clients re-attach there with the same ids (docs/serve.md). Exit
    status 75 when the requests are not all journaled within --timeout (the handoff stays
    armed; run the command again once the engine is paused).
    """
    if not to:
        raise usage_error("no target given: use --to NAME")
    if mode not in MODES:
        raise usage_error(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
    path = journal_path(journal)
    try:
        manifest_path, manifest = hand_off(path, to, mode=mode, url=url, timeout=timeout)
    except HandoffTimeout as exc:
        report("kvj handoff", str(exc))
        raise typer.Exit(TEMPFAIL) from None
    done(f"handoff to {to} is done: manifest {manifest_path}")
    if as_json:
        emit_json({"manifest_path": manifest_path, "to": to, "requests": [r["id"] for r in manifest["requests"]]})
    else:
        out.print(f"{len(manifest['requests'])} request(s) handed off to {to}: manifest {manifest_path}", markup=False)
