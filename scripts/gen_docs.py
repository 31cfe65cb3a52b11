"""Generate the man pages (``man/kvj.1``, ``man/kvj-<command>.1``, ``man/journal_replay.1``) and
the shell completions (``completions/``) from the CLI definition itself.

    python scripts/gen_docs.py            # rewrite man/ and completions/ in this checkout
    python scripts/gen_docs.py --check    # exit 1 if any generated file is stale

Output is deterministic (no dates), so a test can regenerate into a temporary directory and
compare. The format pages (kvj-journal.5, kvj-segment.5, ...) are written by hand, not here.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

from kvj import __version__
from kvj.cli.parse import DURATION_RULE, TIME_RULE
from kvj.cli.errors import EXIT_CODES, FSCK_CODES
from kvj.cli.main import app, command, legacy_app

MANUAL = "kvj manual"
COMPLETE_VAR = "_{}_COMPLETE"

ENVIRONMENT = [
    ("KVJ_JOURNAL", "Journal directory, when --journal is not given."),
    ("KVJ_STORE", "Segment store directory, when --store is not given (default: the store the journal's kvj.conf "
                  "names, else its segments/ folder)."),
    ("KVJ_MIRROR", "Mirror directory, when --mirror is not given (init, record, flush, recover, journal_replay): a "
                   "synchronous second copy of the log; the journal records it, so it is needed once."),
    ("NO_COLOR", "When set, output has no colour. Colour and progress bars appear only when standard output "
                 "and standard error are terminals."),
    ("KVJ_DEBUG", "When set to 1, an internal error prints its Python traceback before the one-line message."),
    ("KVJ_TRUST_OWNER", "When set to 1, kvj run as root (every command, and kvj.Journal.open and SegmentStore in "
                        "the library) works on a journal or store directory another user owns, "
                        "or that everyone or a group other than root's may write (refused otherwise, with status 77: "
                        "whoever can write it could plant links there to turn a privileged kvj against the machine; "
                        "as git's safe.directory and logrotate). Better: run kvj as that user."),
]

FILES = [
    ("JOURNAL/NNNNNNNNNNNNNNNN.log", "Log files, numbered; all but the newest are sealed (kvj-journal(5))."),
    ("JOURNAL/snapshot-LSN.snap", "Snapshots written by kvj compact."),
    ("JOURNAL/kvj.conf", "Written by kvj init (JSON): the commit policy and the segment store. Every path that "
                         "opens the journal reads it (every command, kvj.Journal.open and the integrations); what "
                         "is given explicitly wins: --store or KVJ_STORE, store= and policy= of kvj.Journal.open. "
                         "A kvj.conf that is not valid is refused with status 65. See kvj-init(1)."),
    ("JOURNAL/LOCK, JOURNAL/COMPACT", "Writer and compactor locks; each holds its owner's pid."),
    ("JOURNAL/torn/", "Bytes cut from torn tails and log files set aside by recovery or fsck --repair (kept "
                      "until kvj prune removes them)."),
    ("JOURNAL/recovery/manifest-EPOCH.json", "Recovery manifests written by kvj recover."),
    ("JOURNAL/segments/", "The default segment store (kvj-segment(5))."),
    ("JOURNAL/ranks.json, JOURNAL/rank-T-P/", "A tensor/pipeline-parallel vLLM engine's directory: one journal per "
                                              "rank (each with its own store), the layout in ranks.json. kvj "
                                              "recover (and journal_replay), fsck, status, inspect, compact and "
                                              "prune -j JOURNAL cover every rank; the other commands take one rank's journal (kvj-journal(5), "
                                              "Rank journals)."),
]

#: What a command's exit status means beyond the common list.
EXIT_NOTES: Dict[str, str] = {
    "kvj-status": "kvj status exits 0 whenever it could read the journal, whatever it found there (no writer, "
                  "damage, warnings): the report says what, and --json gives it to scripts. It fails only when "
                  "it cannot look: 66 when DIR is not a journal, 64 for a usage error, 77 for an unsafe path.",
}

EXAMPLES: Dict[str, List[Tuple[str, str]]] = {
    "status": [("The first command in an incident", "kvj status -j /var/lib/kvj"),
               ("Is a writer alive? (for a health check)", "kvj status -j /var/lib/kvj --json | jq .writer")],
    "kvj": [("After a reboot: check, then recover", "kvj fsck -j /var/lib/kvj && kvj recover -j /var/lib/kvj")],
    "init": [("A journal whose store lives on another disk", "kvj init -j /var/lib/kvj --store /data/kvj-segments")],
    "migrate": [("From the seed's JSON lines to a kvj journal",
                 "kvj migrate /var/lib/kvjournal/journal.jsonl -j /var/lib/kvj --drop-segments")],
    "record": [("Record a request's start and end", "kvj record start req-42 -j J --tokens 1,2,3\n"
                                                    "kvj record end req-42 -j J"),
               ("Copy the records of one request into another journal",
                "kvj inspect -j A --json -r req-42 | kvj record ndjson -j B")],
    "flush": [("Store two 16-token KV blocks of a request", "kvj flush -j J -r req-42 --block-tokens 16 b0.npy b1.npy"),
              ("Store a training checkpoint", "kvj flush -j J --checkpoint 1000 model.safetensors")],
    "replay": [("What is in flight, as of LSN 5000", "kvj replay -j J --at 5000")],
    "recover": [("Look first, then recover and time loading onto the GPU",
                 "kvj recover -j J --dry-run\nkvj recover -j J --device cuda:0")],
    "inspect": [("Follow a live journal, segment records only", "kvj inspect -j J -f -t segment"),
                ("One request's records as NDJSON", "kvj inspect -j J --json -r req-42 | jq .lsn"),
                ("A segment's header and who refers to it, without decoding it",
                 "kvj inspect -j J --segment e8c7997e62d8"),
                ("Statistics, saved for the incident report", "kvj inspect -j J --stats --export stats.svg")],
    "dump": [("Block 3 of a request, for a look in numpy or torch", "kvj dump -j J -r req-42 --segment 3 -o b3.pt"),
             ("A segment by the key prefix kvj inspect prints", "kvj dump -j J e8c7997e62d8 -o seg.safetensors")],
    "compact": [("Hourly from cron", "0 * * * * kvj compact -j /var/lib/kvj --grace 1h"),
                ("What it would remove and reclaim, changing nothing", "kvj compact -j J --dry-run"),
                ("Keep a serving engine's prefix cache within 200 GiB, least recently used out first",
                 "*/10 * * * * kvj compact -j /var/lib/kvj --max-store-bytes 200GiB")],
    "prune": [("Daily from cron: drop what was set aside more than a week ago",
               "30 3 * * * kvj prune -j /var/lib/kvj --older-than 7d")],
    "fsck": [("Check, then repair what can be repaired", "kvj fsck -j J || kvj fsck -j J --repair")],
    "bench": [("Measure the disk the journal will live on", "kvj bench --dir /var/lib/kvj"),
              ("kvj against SQLite and the fsync floor, three interleaved rounds",
               "kvj bench journal --dir /var/lib/kvj --repeat 3")],
    "demo": [("Replay a run's kill points", "kvj demo --seed 766060")],
    "journal_replay": [("Recover a journal after a reboot, as the KVJournal write-up's script does",
                        "journal_replay --log /var/lib/kvj --kv-store /var/lib/kvj/segments --recover")],
}


# -- roff ----------------------------------------------------------------------------------


def esc(text: str) -> str:
    """Escape text for roff: backslashes, and a leading dot or quote."""
    text = text.replace("\\", "\\e")
    return re.sub(r"^([.'])", r"\\&\1", text, flags=re.M)


def opt(text: str) -> str:
    """An option name with hyphens that must stay hyphens (not dashes)."""
    return esc(text).replace("-", "\\-")


def paragraphs(help_text: str) -> List[str]:
    """Help text split into paragraphs, each joined into one line."""
    text = inspect.cleandoc(help_text or "").partition("\f")[0]
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def _choices(param) -> Optional[List[str]]:  # type: ignore[no-untyped-def]
    """A choice parameter's values (typer >= 0.20 keeps them on type_descriptor, click on type)."""
    holder = getattr(param, "type_descriptor", None) or getattr(param, "type", None)
    choices = getattr(holder, "choices", None)
    return [str(getattr(c, "value", c)) for c in choices] if choices else None


def _param_lines(param, ctx) -> List[str]:  # type: ignore[no-untyped-def]
    """.TP entry for one option or argument."""
    if param.param_type_name == "argument":
        name = (param.metavar or param.name.upper())
        head = f"\\fI{esc(name)}\\fR"
    else:
        names = ", ".join(f"\\fB{opt(o)}\\fR" for o in param.opts + param.secondary_opts)
        metavar = ""
        if not getattr(param, "is_flag", False) and not getattr(param, "count", False):
            choices = _choices(param)
            metavar = param.metavar or ("|".join(choices) if choices else param.name.upper())
        head = names + (f" \\fI{esc(metavar)}\\fR" if metavar else "")
    text = getattr(param, "help", None) or ""
    extra = []
    if param.param_type_name == "option" and not getattr(param, "is_flag", False):
        default = param.default
        if default not in (None, (), [], "") and not callable(default) and param.show_default is not False:
            extra.append(f"Default: {getattr(default, 'value', default)}.")
    envvar = getattr(param, "envvar", None)
    if envvar:
        extra.append(f"Environment: {envvar if isinstance(envvar, str) else ', '.join(envvar)}.")
    if getattr(param, "required", False):
        extra.append("Required.")
    return [".TP", head, esc(" ".join([text] + extra).strip())]


def _synopsis(path: str, cmd) -> str:  # type: ignore[no-untyped-def]
    parts = [f"\\fB{esc(path)}\\fR"]
    if any(p.param_type_name == "option" for p in cmd.params):
        parts.append("[\\fIOPTIONS\\fR]")
    if getattr(cmd, "commands", None):
        parts.append("\\fICOMMAND\\fR [\\fIARGS\\fR]")
    for p in cmd.params:
        if p.param_type_name == "argument":
            name = esc(p.metavar or p.name.upper())
            parts.append(f"\\fI{name}\\fR" if p.required else f"[\\fI{name}\\fR]")
    return " ".join(parts)


def _exit_status(name: str) -> List[str]:
    fsck = name == "kvj-fsck"
    lines = [".SH EXIT STATUS"]
    if name in EXIT_NOTES:
        lines.append(esc(EXIT_NOTES[name]))
    if fsck:
        lines.append("As e2fsck(8); when errors were both corrected and left, the status is their sum (5).")
    for code, meaning in (FSCK_CODES if fsck else EXIT_CODES).items():
        lines += [".TP", f"\\fB{code}\\fR", esc(meaning[0].upper() + meaning[1:] + ".")]
    if not fsck:
        lines += [".PP", esc("kvj fsck uses e2fsck's statuses instead; see kvj-fsck(1).")]
    return lines


def _examples(name: str) -> List[str]:
    if name not in EXAMPLES:
        return []
    lines = [".SH EXAMPLES"]
    for title, code in EXAMPLES[name]:
        lines += [".PP", esc(title + ":"), ".PP", ".RS 4", ".nf"] + [esc(c) for c in code.split("\n")]
        lines += [".fi", ".RE"]
    return lines


def _command_sections(path: str, cmd, ctx, level: str = ".SH") -> List[str]:  # type: ignore[no-untyped-def]
    """DESCRIPTION, OPTIONS and, for groups, a section per subcommand."""
    lines: List[str] = []
    paras = paragraphs(cmd.help or "")
    if level == ".SH":
        lines.append(".SH DESCRIPTION")
    for p in paras:
        lines += [".PP", esc(p)]
    params = [p for p in cmd.params if getattr(p, "expose_value", True) or p.name == "version"]
    args = [p for p in params if p.param_type_name == "argument"]
    opts = [p for p in params if p.param_type_name == "option"]
    if args:
        lines.append(f"{level} ARGUMENTS" if level == ".SH" else ".PP\n\\fBArguments:\\fR")
        for p in args:
            lines += _param_lines(p, ctx)
    if opts:
        lines.append(f"{level} OPTIONS" if level == ".SH" else ".PP\n\\fBOptions:\\fR")
        for p in opts:
            lines += _param_lines(p, ctx)
        lines += [".TP", "\\fB\\-h\\fR, \\fB\\-\\-help\\fR", "Show the help and exit."]
    if path == "kvj":  # each command has its own page
        return lines
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        lines += [".SH " + esc(f"{path} {name}").upper(), ".PP", _synopsis(f"{path} {name}", sub)]
        lines += _command_sections(f"{path} {name}", sub, ctx, level=".SS")
    return lines


def _takes_times(cmd) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``cmd`` or one of its subcommands has a DURATION or TIME option."""
    if any("DURATION" in (p.metavar or "") or "TIME" in (p.metavar or "") for p in cmd.params):
        return True
    return any(_takes_times(sub) for sub in getattr(cmd, "commands", {}).values())


def _time_arguments() -> List[str]:
    """The one rule for time arguments, the same on every page that takes them."""
    rule = (f"Every kvj command reads time arguments the same way: {DURATION_RULE}; {TIME_RULE}. An option "
            "named LSN takes a log sequence number, never a time (kvj restore --at takes either: a bare integer "
            "is an LSN).")
    return [".SH TIME ARGUMENTS", ".PP", esc(rule[0].upper() + rule[1:])]


def man_page(name: str, path: str, cmd, section_title: str, see_also: List[str]) -> str:  # type: ignore[no-untyped-def]
    """One man page for ``cmd``, invoked as ``path``."""
    short = paragraphs(cmd.help or "")[0] if cmd.help else ""
    title = opt(name.upper())
    lines = [f'.TH {title} 1 "" "kvj {__version__}" "{section_title}"',
             ".SH NAME", f"{opt(name)} \\- {esc(short[0].lower() + short[1:] if short else '')}",
             ".SH SYNOPSIS", _synopsis(path, cmd)]
    lines += _command_sections(path, cmd, None)
    if name == "kvj" or _takes_times(cmd):
        lines += _time_arguments()
    if name == "kvj":
        lines += [".SH COMMANDS"]
        for sub_name, sub in sorted(cmd.commands.items()):
            lines += [".TP", f"\\fBkvj {esc(sub_name)}\\fR",
                      esc(paragraphs(sub.help or "")[0]) + f" See kvj\\-{sub_name}(1)."]
        lines += [".SH ENVIRONMENT"]
        for var, text in ENVIRONMENT:
            lines += [".TP", f"\\fB{var}\\fR", esc(text)]
        lines += [".SH FILES"]
        for f, text in FILES:
            lines += [".TP", f"\\fI{esc(f)}\\fR", esc(text)]
    else:
        lines += [".SH ENVIRONMENT", ".PP", "See kvj(1) for KVJ_JOURNAL, KVJ_STORE, KVJ_MIRROR, KVJ_TRUST_OWNER, "
                  "NO_COLOR and KVJ_DEBUG."]
    lines += _exit_status(name)
    lines += _examples(name.split("-", 1)[1] if name.startswith("kvj-") else name)
    refs = [ref.partition("(") for ref in see_also]
    lines += [".SH SEE ALSO", ", ".join(f"\\fB{opt(page)}\\fR({section}" for page, _, section in refs)]
    return "\n".join(lines) + "\n"


def generate() -> Dict[str, str]:
    """Relative path -> content of every generated file."""
    root = command(app)
    files: Dict[str, str] = {}
    subs = sorted(root.commands)
    pages = [f"kvj-{s}(1)" for s in subs]
    formats = ["kvj-journal(5)", "kvj-segment(5)"]
    files["man/kvj.1"] = man_page("kvj", "kvj", root, MANUAL, pages + formats + ["journal_replay(1)"])
    for name in subs:
        see_also = ["kvj(1)"] + (["journal_replay(1)"] if name == "recover" else []) + formats
        files[f"man/kvj-{name}.1"] = man_page(f"kvj-{name}", f"kvj {name}", root.commands[name], MANUAL, see_also)
    files["man/journal_replay.1"] = man_page("journal_replay", "journal_replay", command(legacy_app), MANUAL,
                                             ["kvj-recover(1)", "kvj(1)", "kvj-journal(5)"])
    from typer._completion_shared import get_completion_script

    for prog in ("kvj", "journal_replay"):
        var = COMPLETE_VAR.format(prog.upper())
        files[f"completions/{prog}.bash"] = get_completion_script(prog_name=prog, complete_var=var, shell="bash") + "\n"
        files[f"completions/_{prog}"] = get_completion_script(prog_name=prog, complete_var=var, shell="zsh") + "\n"
        files[f"completions/{prog}.fish"] = get_completion_script(prog_name=prog, complete_var=var, shell="fish") + "\n"
    return files


def write(target: str) -> List[str]:
    """Write every generated file under ``target``; returns the paths written."""
    written = []
    for rel, content in generate().items():
        path = os.path.join(target, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        written.append(rel)
    return written


def stale(target: str) -> List[str]:
    """Generated files under ``target`` that are missing or differ from what the CLI defines."""
    found = []
    for rel, content in generate().items():
        try:
            with open(os.path.join(target, rel), encoding="utf-8") as f:
                if f.read() == content:
                    continue
        except FileNotFoundError:
            pass
        found.append(rel)
    return found


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gen_docs.py", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="checkout to write into (default: this one)")
    parser.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.root)
        for rel in bad:
            print(f"stale: {rel} (run python scripts/gen_docs.py)", file=sys.stderr)
        return 1 if bad else 0
    for rel in write(args.root):
        print(rel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
