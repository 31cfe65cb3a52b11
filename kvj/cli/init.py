"""``kvj init`` and ``kvj migrate``: journals are made on purpose, never by a typo."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from kvj.cli.options import JournalArg, JsonArg, MirrorArg, StoreArg, usage_error
from kvj.cli.output import done, emit_json, out
from kvj.cli.parse import parse_duration, parse_size
from kvj.cli.render import lsn_span
from kvj.ops.inspection import human_size

#: The smallest log file size kvj init accepts (the library's CommitPolicy takes any size).
MIN_FILE_SIZE = 64 << 10


def init(journal: JournalArg = None,
         store: StoreArg = None,
         max_delay: Annotated[str, typer.Option(metavar="DURATION", help="Longest a record waits for its commit "
                                                "group (commit policy; a DURATION: 100ms, 1s).")] = "100ms",
         max_records: Annotated[int, typer.Option(metavar="N", min=1, help="Commit as soon as this many records "
                                                  "wait (commit policy).")] = 100,
         file_size: Annotated[str, typer.Option(metavar="SIZE", help="Start a new log file past this size "
                                                 "(at least 64KiB; a bare number is bytes).")] = "64MiB",
         mirror: MirrorArg = None,
         max_store_bytes: Annotated[Optional[str], typer.Option(metavar="SIZE", help="The segment store's byte "
                                                                "budget: kvj compact evicts least recently used "
                                                                "segments nothing needs down to it (64GiB, 500M; "
                                                                "a bare number is bytes).")] = None,
         as_json: JsonArg = False) -> None:
    """Create a journal: the directory, its first log file, and kvj.conf with the settings.

    kvj.conf (JSON) records the commit policy (--max-delay, --max-records, --file-size),
    the segment store (--store; by default JOURNAL/segments) and its byte budget
    (--max-store-bytes; by default none). Every path that opens
    the journal reads it: kvj record and kvj flush, recover, fsck, compact, prune,
    status, replicate, and programs through kvj.Journal.open("JOURNAL") and the
    integrations, so the segments go to that store and recovery finds them there. What
    is given explicitly wins over the file: --store or KVJ_STORE on a later command,
    store= and policy= passed to kvj.Journal.open. A kvj.conf that is not valid JSON, or
    holds a value the commit policy refuses, is refused (status 65; kvj fsck's 8) by
    every command that reads it; kvj status shows why. The directory must be missing or
    empty. kvj record and kvj flush
    write only to a journal made this way (or by a program through kvj.Journal.open): a
    mistyped path is refused, never turned into a new journal. With --mirror, the
    journal keeps a synchronous copy of its log in that directory from its first log
    file on (the journal records it; kvj-journal(5), MIRROR).

    A commit policy value that cannot work (--max-delay that is not a duration or is
    longer than a day, --max-records 0, --file-size under 64KiB or of 2^63 bytes or
    more), or a --max-store-bytes that is not a size, is a usage error (status 64) and
    nothing is created.
    """
    from kvj.errors import InvalidArgument
    from kvj.journal.config import CommitPolicy, check_policy_value
    from kvj.ops.init import init as init_journal

    if not journal:
        raise usage_error("give the journal directory to create: kvj init -j DIR")
    if store is not None and not store:
        raise usage_error("an empty --store names no store")
    size = parse_size(file_size)
    if size < MIN_FILE_SIZE:
        raise typer.BadParameter(f"{file_size!r} is under 64KiB: a log file that small rotates every few "
                                 "records (a bare number is bytes: 64MiB, 1GiB)", param_hint="--file-size")
    budget = parse_size(max_store_bytes, "--max-store-bytes") if max_store_bytes is not None else None
    settings = {"max_delay": parse_duration(max_delay, "--max-delay"), "max_records": max_records,
                "file_size_limit": size}
    for name, option in (("max_delay", "--max-delay"), ("max_records", "--max-records"),
                         ("file_size_limit", "--file-size")):
        try:
            check_policy_value(name, settings[name])
        except InvalidArgument as exc:
            raise typer.BadParameter(str(exc), param_hint=option) from None
    policy = CommitPolicy(**settings)
    config = init_journal(journal, store=store, policy=policy, mirror=mirror, max_store_bytes=budget)
    done(f"created journal {os.path.abspath(journal)}")
    if as_json:
        emit_json({"journal": journal, **config})
        return
    out.print(f"created journal {journal}: commit within {policy.max_delay * 1000:g} ms or {policy.max_records} "
              f"records, log files of {human_size(policy.file_size_limit)}, segment store "
              f"{config['store'] or 'JOURNAL/segments'}"
              + (f" of at most {human_size(budget)}" if budget is not None else ""), markup=False)


def migrate(seed: Annotated[str, typer.Argument(metavar="SEED", help="The seed-era JSON-lines journal file.")],
            journal: JournalArg = None,
            store: StoreArg = None,
            drop_segments: Annotated[bool, typer.Option("--drop-segments", help="Migrate even though seg_flush "
                                                        "records cannot be carried over (those requests resume "
                                                        "at token 0).")] = False,
            as_json: JsonArg = False) -> None:
    """Turn a seed-era JSON-lines journal into a new kvj journal.

    Its start and end records are written, in order, into a new journal at --journal (made
    as kvj init makes one). A seed seg_flush points at bytes in the seed's KV file, which a
    kvj journal cannot refer to (kvj segments are content-addressed and verified): such a
    journal is refused (status 64) unless --drop-segments, and then the output counts the
    pointers left behind per request. A last line without its newline (a write cut short)
    is left out and reported; a complete line that is no seed-era record, the last one
    too (an unsafe id such as ../x, NaN or a number no float holds), is refused with
    status 65 naming the line, and nothing is created. The seed file is only read. This is
    the one command that reads a seed-era journal: every other refuses it (status 65),
    pointing here.
    """
    from kvj.ops.init import migrate as migrate_journal

    if not journal:
        raise usage_error("give the new journal directory: kvj migrate SEED -j DIR")
    result = migrate_journal(seed, journal, store=store, drop_segments=drop_segments)
    done(f"migrated {result['records']} records into {result['journal']}")
    if as_json:
        emit_json(result)
        return
    dropped = result["segments_dropped"]
    out.print(f"migrated {result['records']} records from {result['seed']} into {result['journal']} "
              f"({lsn_span(result['first_lsn'], result['last_lsn'])})", markup=False)
    if dropped:
        out.print(f"left behind {sum(dropped.values())} seg_flush pointers of {len(dropped)} requests (they resume "
                  f"at token 0): " + ", ".join(f"{rid} {n}" for rid, n in sorted(dropped.items())), markup=False)
    if result["torn_last_line"]:
        out.print(f"left out the torn last line ({result['torn_last_line']['length']} bytes)", markup=False)
