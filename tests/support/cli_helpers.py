"""Shared by the CLI, recovery, compaction and fsck tests: run the real ``kvj`` entry point,
build small journals with segments, and reach into the store for damage."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from types import ModuleType
from typing import Dict, List, Optional, Tuple

import torch

from kvj.journal.config import default_store_path
from kvj.journal.journal import Journal
from kvj.journal.replay import replay

_BIN = os.path.join(os.path.dirname(sys.executable), "kvj")
KVJ = [_BIN] if os.path.exists(_BIN) else [sys.executable, "-m", "kvj.cli.main"]
JOURNAL_REPLAY = [os.path.join(os.path.dirname(sys.executable), "journal_replay")]
if not os.path.exists(JOURNAL_REPLAY[0]):
    JOURNAL_REPLAY = [sys.executable, "-c", "from kvj.cli.main import journal_replay_main; journal_replay_main()"]

BLOCK_TOKENS = 16

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gen_docs() -> ModuleType:
    """``scripts/gen_docs.py``, the man page and completion generator (a developer tool, not in the wheel)."""
    if "gen_docs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gen_docs", os.path.join(ROOT, "scripts", "gen_docs.py"))
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        sys.modules["gen_docs"] = module
    return sys.modules["gen_docs"]


def env(**extra: Optional[str]) -> Dict[str, str]:
    """The test process's environment without kvj settings, NO_COLOR set; None in ``extra`` unsets."""
    e = {k: v for k, v in os.environ.items() if k not in ("KVJ_JOURNAL", "KVJ_STORE", "FORCE_COLOR")}
    e["NO_COLOR"] = "1"
    e.update(extra)  # type: ignore[arg-type]
    return {k: v for k, v in e.items() if v is not None}


def kvj(*args: object, input: Optional[str] = None, extra_env: Optional[Dict[str, Optional[str]]] = None,
        prog: Optional[List[str]] = None, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess:
    """Run the installed ``kvj`` (or ``prog``) as a user would."""
    return subprocess.run([*(prog or KVJ), *map(str, args)], capture_output=True, text=True, input=input,
                          env=env(**(extra_env or {})), timeout=timeout, **kw)  # type: ignore[call-overload]


def interruptible(argv: List[str], **kwargs: object) -> subprocess.Popen:
    """Start a child a test will stop with Ctrl-C (SIGINT): with SIGINT at its default action,
    whatever this test run inherited. A suite started in the background (``&``, nohup, some CI
    runners) has SIGINT ignored, which kvj rightly keeps, so a child would never see it."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def assert_fails(proc: subprocess.CompletedProcess, status: int, *needles: str, prog: str = "kvj") -> str:
    """The command failed with ``status`` and exactly one stderr line, no traceback."""
    assert proc.returncode == status, f"status {proc.returncode}, expected {status}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def tree(path: object) -> Dict[str, object]:
    """Every entry under ``path`` with its type, mode, size, mtime and content digest: equal
    before and after a command exactly when the command wrote nothing there."""
    import hashlib
    import stat

    found: Dict[str, object] = {}
    root = os.fspath(path)  # type: ignore[call-overload]
    if not os.path.lexists(root):
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(full, "rb") as f:
                    digest = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
            found[os.path.relpath(full, root)] = (stat.S_IFMT(st.st_mode), st.st_mode, st.st_size, st.st_mtime_ns,
                                                  digest)
    return found


def block(request: int, index: int) -> torch.Tensor:
    """A small, deterministic KV block ([2, 16 tokens, 2 heads, 8 dims], bf16)."""
    g = torch.Generator().manual_seed(request * 1000 + index)
    return torch.randn(2, BLOCK_TOKENS, 2, 8, generator=g).to(torch.bfloat16)


def build(path: str, *, requests: int = 2, blocks: int = 3, ended: int = 1, training: bool = True) -> Dict[str, object]:
    """A journal with requests in flight (``blocks`` segments each), ended ones, and training state.

    Returns what was written: request -> segment keys in order, and the training keys.
    """
    keys: Dict[str, List[str]] = {}
    train: Dict[str, object] = {}
    with Journal.open(path) as j:
        for r in range(requests + ended):
            rid = f"req-{r}"
            j.start(rid, prompt_hash=f"h{r}", tokens=list(range(r, r + 5)), meta={"n": r})
            for b in range(blocks):
                j.flush(rid, b, block(r, b), token_range=(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS),
                        layout={"model": "tiny"}).result()
            j.alloc("cuda:0", 0x1000 * (r + 1), 4096, f"kv:{rid}")
        for r in range(requests, requests + ended):
            j.end(f"req-{r}")
            j.free("cuda:0", 0x1000 * (r + 1))
        if training:
            w = j.store.put(torch.arange(64, dtype=torch.float32).reshape(8, 8)).key
            m1 = j.store.put(torch.full((8, 8), 1.5)).key
            m2 = j.store.put(torch.full((8, 8), 2.5)).key
            j.checkpoint(10, {"w": w})
            j.delta(11, 10, {"m": m1})
            j.delta(12, 11, {"m": m2})
            train = {"w": w, "d11": m1, "d12": m2}
        j.sync()
    state = replay(path)
    for rid, req in state.requests.items():
        keys[rid] = [req.segments[b].key for b in sorted(req.segments)]  # type: ignore[misc]
    return {"keys": keys, "training": train}


def segment_file(journal: str, key: str) -> str:
    from kvj.segments.store import SegmentStore

    with SegmentStore(default_store_path(journal)) as store:
        return store.backend.path(key)  # type: ignore[attr-defined]


def flip_byte(path: str, offset_from_end: int = 40) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def append_torn_tail(journal: str, nbytes: int = 30) -> Tuple[str, int, bytes]:
    """Append the start of a commit group that was never finished (what a crash mid-write leaves).

    Returns the log file, its size before, and the bytes appended.
    """
    from kvj.journal.framing import encode_group_header
    from kvj.journal.reader import list_logs

    last = list_logs(journal)[-1]
    size = os.path.getsize(last)
    data = (encode_group_header(500, 3, 10**6) + b"\x01" * 200)[:nbytes]
    with open(last, "ab") as f:
        f.write(data)
    return last, size, data


HOLDER = textwrap.dedent("""
    import sys, time
    from kvj.journal.recovery import DirLock
    from kvj.journal.journal import Journal
    what, path = sys.argv[1], sys.argv[2]
    if what == "writer":
        j = Journal.open(path)
    else:
        DirLock(path, "COMPACT", "compactor").acquire()
    print("ready", flush=True)
    time.sleep(120)
""")


class Holder:
    """A live process holding a journal's writer or compactor lock (killed on exit)."""

    def __init__(self, path: str, what: str = "writer"):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, what, path], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "ready", line

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> "Holder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def run_cli(capsys, *args: object, prog: str = "kvj") -> Tuple[int, str, str]:  # type: ignore[no-untyped-def]
    """Run the CLI in this process (same code path as the console script, minus process start)."""
    from kvj.cli.main import app, legacy_app, run

    capsys.readouterr()
    status = run(app if prog == "kvj" else legacy_app, [str(a) for a in args], prog)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def in_process(capsys, *args: object, prog: str = "kvj") -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """``run_cli`` shaped like ``kvj()``'s result, for ``assert_fails`` and friends."""
    status, out, err = run_cli(capsys, *args, prog=prog)
    return subprocess.CompletedProcess([prog, *map(str, args)], status, out, err)


def ndjson(text: str) -> List[dict]:
    import json

    return [json.loads(line) for line in text.splitlines() if line.strip()]
