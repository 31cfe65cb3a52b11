"""``kvj replicate``: ship a journal to an S3 replica, once (cron) or continuously (--follow)."""

from __future__ import annotations

import signal
import threading
from typing import Annotated, Optional

import typer

from kvj.cli.options import JournalArg, JsonArg, StoreArg, journal_path, store_path
from kvj.cli.output import done, emit_json, err, out
from kvj.cli.parse import parse_duration
from kvj.cli.errors import one_line
from kvj.ops.inspection import human_size
from kvj.replica.lease import DEFAULT_TTL, UNREADABLE
from kvj.replica.remote import open_remote
from kvj.replica.ship import DEFAULT_GRACE, DEFAULT_INTERVAL, Replicator, RoundResult, replicate_once

REPLICA_ENV = "KVJ_REPLICA"


def _summary(result: RoundResult) -> str:
    parts = [f"replicated through LSN {result.last_lsn} (lease generation {result.generation})",
             f"{result.segments_uploaded} segments ({human_size(result.segment_bytes)})",
             f"{result.parts_uploaded} log parts ({human_size(result.log_bytes)})"]
    if result.snapshot_lsn is not None:
        parts.append(f"snapshot at LSN {result.snapshot_lsn}")
    if result.objects_deleted:
        parts.append(f"{result.objects_deleted} objects deleted")
    return ", ".join(parts)


def replicate(journal: JournalArg = None,
              store: StoreArg = None,
              to: Annotated[Optional[str], typer.Option("--to", envvar=REPLICA_ENV, show_envvar=True,
                                                        metavar="URL", help="The replica: s3://bucket/prefix.")] = None,
              follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep replicating (a service) until "
                                                   "SIGTERM or Ctrl-C.")] = False,
              interval: Annotated[str, typer.Option(metavar="DURATION", help="With --follow: time between rounds, "
                                                    "the most a lost node can lose (plus one round's upload "
                                                    "time).")] = f"{DEFAULT_INTERVAL:g}s",
              lease_ttl: Annotated[str, typer.Option("--lease-ttl", metavar="DURATION", help="How long the "
                                                     "replica's lease lasts unless renewed (at most 1h).")]
              = f"{DEFAULT_TTL:g}s",
              grace: Annotated[str, typer.Option(metavar="DURATION", help="Delete an object from the replica only "
                                                 "after the manifest has not needed it for this long.")]
              = f"{int(DEFAULT_GRACE)}s",
              break_lease: Annotated[Optional[str], typer.Option("--break-lease", metavar="HOLDER", help="Take the "
                                                                 "lease from HOLDER before it expires: the holder "
                                                                 "exactly as the 'leased by' error names it, or "
                                                                 f"'{UNREADABLE}' for a lock.json that is not a kvj "
                                                                 "lease. Only when that replicator is gone.")] = None,
              as_json: JsonArg = False) -> None:
    """Replicate the journal to S3-compatible object storage, like Litestream.

    Ships the log files' durable bytes (whole commit groups, CRC-checked, fsynced here
    first), the newest snapshot and every segment (create-only, per key) under
    s3://bucket/prefix, then commits the replica's manifest by compare-and-swap. A lease
    object (lock.json) admits one replicator per replica: a second one exits with status
    75 naming the holder; a takeover after the lease expires fences the old holder out.
    A lease lasts at most 1 h after it was written, whatever its expiry says (a holder
    renews it every half TTL). --break-lease HOLDER takes it over at once, only from the
    holder named (so a lease taken meanwhile by another replicator is not broken); if
    that holder still runs, its next commit fails and it stops: breaking a lease never
    lets two replicators commit, at worst one loses its round.
    What compaction deleted locally leaves the replica once its manifest no longer needs
    it, after the grace period. The writer never waits on replication or the network.

    Without --follow: one round, for cron. With --follow: a round every --interval (1 s
    by default: a lost node loses at most the last interval plus one round's upload
    time); an unreachable endpoint is retried with backoff, never fatal. An upload may
    take 30 s plus the time its bytes take at 256 KiB/s (a slower one counts as stalled,
    and its round is retried); a download fails after 30 s without a byte. A write whose
    answer was lost (a dropped
    connection) is recognised on the next try, not taken for another writer's. A
    manifest or lease that is not what kvj writes (names that are not kvj's, numbers
    that do not fit, deep nesting) is refused with status 65, and text from the replica
    (a holder's name) is printed escaped. Credentials,
    region and endpoint come from the AWS environment variables (AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP) or ~/.aws.
    """
    from kvj.cli.options import usage_error

    if not to:
        raise usage_error(f"no replica given: use --to s3://bucket/prefix or set {REPLICA_ENV}")
    path = journal_path(journal)
    every = parse_duration(interval)
    remote = open_remote(to)
    replicator = Replicator(path, remote, store=store_path(path, store), lease_ttl=parse_duration(lease_ttl),
                            grace=parse_duration(grace), break_lease=break_lease)
    with replicator:
        if replicator.lease.broken is not None:
            err.print(f"kvj: warning: broke the lease of {replicator.lease.broken}; this replicator holds it now "
                      f"(generation {replicator.lease.generation}), and the old holder is fenced out", markup=False)
        if not follow:
            result = replicate_once(replicator)
            done(f"replication round to {to} is done")
            if as_json:
                emit_json(result.to_dict())
            else:
                out.print(_summary(result), markup=False)
            return
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())

        def on_round(result: RoundResult) -> None:
            done(f"replication rounds to {to} are done")
            if as_json:
                emit_json(result.to_dict())
            elif result.committed:
                out.print(_summary(result), markup=False)

        def on_error(exc: BaseException) -> None:
            err.print(f"kvj: warning: round failed, retrying: {one_line(str(exc))}", markup=False)

        try:
            replicator.follow(every, stop, on_round, on_error)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
