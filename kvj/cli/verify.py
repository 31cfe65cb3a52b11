"""``kvj verify --remote``: check a replica's log continuity and segments without restoring it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvj.cli.options import JsonArg, usage_error
from kvj.cli.output import emit_json, out, progress
from kvj.cli.errors import DATAERR
from kvj.replica.remote import open_remote
from kvj.replica.verify import verify_remote


def verify(remote: Annotated[Optional[str], typer.Option("--remote", metavar="URL",
                                                         help="The replica: s3://bucket/prefix.")] = None,
           sample: Annotated[float, typer.Option(min=0.0001, max=1.0, metavar="FRACTION",
                                                 help="Read this fraction of the segments in full (all are "
                                                 "checked for presence).")] = 1.0,
           seed: Annotated[Optional[int], typer.Option(metavar="N", help="Seed for choosing the sample "
                                                       "[default: random, printed].")] = None,
           as_json: JsonArg = False) -> None:
    """Verify a replica: log continuity, CRCs, and every needed segment present and intact.

    Reads the manifest, downloads the snapshot and every log part (each must match the
    BLAKE3 the manifest recorded), reads the log back strictly (every CRC, LSNs
    continuous from the snapshot to the end), then checks that every segment the
    replicated state needs is present, and reads the sampled fraction of them in full
    (chunk CRCs and content digest). An object whose size differs from the one the
    manifest or the journal declares is a problem found without reading it. Exit status
    0 when all is well, 65 when anything is missing, damaged or not what kvj writes
    (each problem is listed).
    """
    if not remote:
        raise usage_error("no replica given: use --remote s3://bucket/prefix")
    with progress() as update:
        report = verify_remote(open_remote(remote), sample=sample, seed=seed, progress=update)
    if as_json:
        emit_json(report.to_dict())
    else:
        snap = f", snapshot at LSN {report.snapshot_lsn}" if report.snapshot_lsn is not None else ""
        out.print(f"{report.url}: log through LSN {report.last_lsn} in {report.logs} files ({report.parts} parts)"
                  f"{snap}; {report.segments_present}/{report.segments_needed} needed segments present, "
                  f"{report.segments_read} read in full (sample {report.sample:g}, seed {report.seed})", markup=False)
        for problem in report.problems:
            out.print(f"problem: {problem}", markup=False)
        out.print("ok" if report.ok else f"{len(report.problems)} problems", markup=False)
    if not report.ok:
        raise typer.Exit(DATAERR)
