"""``kvj prune``: remove what kvj set aside long ago (torn/, recovery/, the store's quarantine)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Callable, Dict, Iterator, List, Optional, Tuple

import typer

from kvj.cli.options import (JournalArg, JsonArg, StoreArg, engine_ranks, journal_path, on_rank, rank_lines, store_path,
                             usage_error)
from kvj.cli.output import done, show
from kvj.cli.parse import parse_duration
from kvj.ops.inspection import human_size

if TYPE_CHECKING:
    from kvj.ops.prune import PruneResult


def prune(journal: JournalArg = None,
          store: StoreArg = None,
          older_than: Annotated[str, typer.Option("--older-than", metavar="DURATION",
                                                  help="Remove what was set aside longer ago than this (a "
                                                  "DURATION with its unit: 7d, 12h; 7 alone is refused).")] = "",
          dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="List what would be removed; change "
                                                "nothing.")] = False,
          as_json: JsonArg = False) -> None:
    """Remove what kvj set aside long ago: torn/, recovery/ manifests, quarantined segments.

    kvj never deletes what it cuts or sets aside on its own: torn tails and set-aside files
    in JOURNAL/torn/, recovery manifests in JOURNAL/recovery/ and damaged segments in the
    store's quarantine/ stay until this removes those set aside longer ago than
    --older-than. The newest recovery manifest (the one a restarting server reads) is
    always kept. Takes the compactor lock (status 75 while a compactor or recovery runs).

    A tensor/pipeline-parallel vLLM engine's directory (one journal per rank,
    JOURNAL/rank-T-P/) has each rank's journal pruned as above, each under its own lock,
    with its own store, and then the engine's own manifests in JOURNAL/recovery/ (those
    kvj recover -j JOURNAL writes; the newest is kept) under the directory's compactor
    lock, which that recovery holds. A rank that fails (one line on stderr naming it) does
    not stop the others, and its status is the command's.
    """
    if not older_than:
        raise usage_error("give --older-than DURATION (e.g. 7d)")
    from kvj.ops.prune import prune as prune_journal

    path = journal_path(journal, ranks_ok=True)
    ranks = engine_ranks(path, store)
    age = parse_duration(older_than, "--older-than")
    if ranks is not None:
        _prune_engine(path, ranks, age, dry_run, as_json)
        return
    result = prune_journal(path, store_path(path, store), older_than=age, dry_run=dry_run)
    if not dry_run:
        done(f"pruned {path} ({human_size(result.bytes_reclaimed)} reclaimed)")
    show(result, as_json, lambda: _lines(result, dry_run))


def _prune_engine(path: str, ranks: List[Tuple[str, Optional[str]]], older_than: float, dry_run: bool,
                  as_json: bool) -> None:
    """Prune each rank journal of the engine directory ``path`` as one journal is (its own lock and
    store), then the engine's own recovery manifests; one that fails (one line on stderr naming it)
    does not stop the others, and the first failure's status is the command's once all is printed."""
    from kvj.ops.prune import prune as prune_journal
    from kvj.ops.prune import prune_engine

    engine = _Engine(path, dry_run)
    for name, journal in ranks:
        entry: Dict[str, Any] = {"rank": name, "journal": journal or os.path.join(path, name)}
        if journal is None:
            engine.ranks.append({**entry, "missing": True})
            continue
        result = engine.attempt(name, lambda: prune_journal(journal, store_path(journal, None), older_than=older_than,
                                                            dry_run=dry_run))
        engine.ranks.append({**entry, **(result.to_dict() if result else {"error": engine.errors[name]})})
    own = engine.attempt(ENGINE, lambda: prune_engine(path, older_than=older_than, dry_run=dry_run))
    engine.own = own.to_dict() if own else {"error": engine.errors[ENGINE]}
    if not dry_run and engine.results:
        done(f"pruned {', '.join(engine.results)} in {path} ({human_size(engine.reclaimed)} reclaimed)")
    show(engine, as_json, engine.lines)
    if engine.status:
        raise typer.Exit(engine.status)


#: What the engine directory's own manifests are named by, beside its ranks (rank-T-P).
ENGINE = "engine"


@dataclass
class _Engine:
    """What pruning an engine directory did: ``ranks`` as --json shows them (a rank's result,
    ``missing`` or its ``error``), ``own`` for the directory's own manifests, the first failure's
    exit status."""

    path: str
    dry_run: bool
    ranks: List[Dict[str, Any]] = field(default_factory=list)
    own: Dict[str, Any] = field(default_factory=dict)
    results: Dict[str, "PruneResult"] = field(default_factory=dict)  # rank name (or ENGINE) -> result
    errors: Dict[str, str] = field(default_factory=dict)
    status: int = 0

    def attempt(self, name: str, run: Callable[[], "PruneResult"]) -> Optional["PruneResult"]:
        """``run()``'s result, kept under ``name``; None when it failed (reported, its status kept)."""
        result, status, message = on_rank(name, run)
        if result is None:
            self.errors[name], self.status = message, self.status or status
        else:
            self.results[name] = result
        return result

    @property
    def reclaimed(self) -> int:
        return sum(r.bytes_reclaimed for r in self.results.values())

    def to_dict(self) -> Dict[str, Any]:
        removed: Dict[str, int] = {}
        for r in self.results.values():
            for folder, paths in r.removed.items():
                removed[folder] = removed.get(folder, 0) + len(paths)
        return {"journal": self.path, "dry_run": self.dry_run, "ranks": self.ranks, "engine": self.own,
                "totals": {"bytes_reclaimed": self.reclaimed, "removed": removed}}

    def lines(self) -> Iterator[str]:
        """Each rank's lines (after its name), the engine's own manifests', then the engine's."""
        yield from rank_lines(self.ranks, lambda name: _lines(self.results[name], self.dry_run), "prune", "pruned")
        if "error" in self.own:
            yield f"engine {self.path}: its manifests not pruned: {self.own['error']}"
        else:
            yield from (f"engine {self.path}: {line}" for line in _lines(self.results[ENGINE], self.dry_run))
        pruned = sum(1 for rank in self.ranks if rank["rank"] in self.results)
        yield (f"engine {self.path}: {pruned} of {len(self.ranks)} rank journals {'would be ' if self.dry_run else ''}"
               f"pruned; {'would reclaim' if self.dry_run else 'reclaimed'} {human_size(self.reclaimed)} in all")


def _lines(result: PruneResult, dry_run: bool) -> Iterator[str]:
    """What ``kvj prune`` says it removed (or, with --dry-run, would remove)."""
    verb = "would remove" if dry_run else "removed"
    for paths in result.removed.values():
        for p in paths:
            yield f"{verb} {p}"
    counts = ", ".join(f"{len(paths)} from {folder}" for folder, paths in result.removed.items())
    yield (f"{verb} {counts}; {'would reclaim' if dry_run else 'reclaimed'} {human_size(result.bytes_reclaimed)}"
           + (f"; {'would keep' if dry_run else 'kept'} the newest manifest {result.kept_newest_manifest}"
              if result.kept_newest_manifest else ""))
