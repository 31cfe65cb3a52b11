"""``kvj demo --quick``: pull the plug on kvj's own model server and fine-tuning loop, then
prove that kvj brings both back exactly (``kvj demo`` without ``--quick`` runs the stacks
people run instead: ``kvj.demo.stacks``).

1. Two processes start under kvj: one serves several chat requests with a transformers
   Llama (KV cache journaled block by block), one fine-tunes a Qwen2 with AdamW (state
   journaled every step: full checkpoints plus XOR deltas).
2. Mid-flight, each gets SIGKILL at a random point (a crash; the power-loss states of the
   disk are what the crash-test suite covers).
3. ``kvj fsck`` and ``kvj recover`` run through the real command line.
4. Both processes restart from the recovery manifest and finish.
5. The proof: every request's tokens equal an uninterrupted run's, the fine-tuned
   weights and optimizer state are bit-identical (SHA-256), and what was lost and
   recomputed, and how long recovery took.

Everything runs on the CPU in about a minute; files go to ``./demo-out`` (``kvj demo --out``).
Models are built from configs with fixed seeds: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from kvj.demo import crashrun
from kvj.errors import InvalidArgument
from kvj.demo.workload import GenerationWorkload, ModelSpec

MARKER = ".kvj-demo"
WORK = GenerationWorkload(ModelSpec("llama", "demo"), requests=4, max_new_tokens=64, stagger=6)


def _train_spec():  # -> TrainSpec (import deferred: it pulls in torch)
    from kvj.demo.training import TrainSpec
    return TrainSpec(ModelSpec("qwen2", "tiny"), steps=60, batch=16, seq_len=64, full_every=10)


@dataclass
class Crash:
    """What the two processes had done when they were killed."""

    gen: crashrun.Killed = field(default_factory=crashrun.Killed)
    train: crashrun.Killed = field(default_factory=crashrun.Killed)


def prepare(out: str) -> str:
    """Create (or reuse a previous demo's) output directory."""
    out = os.path.abspath(out)
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.exists(os.path.join(out, MARKER)):
            raise InvalidArgument(f"{out} exists and was not made by the demo; choose another --out")
        shutil.rmtree(out)
    os.makedirs(out)
    open(os.path.join(out, MARKER), "w").close()
    return out


def _model_stream(stats: Dict[str, Any]) -> Dict[str, int]:
    """The save statistics of the model's parameters (the stream named ``model.<dtype>``)."""
    return next(v for k, v in stats["per_stream"].items() if k.startswith("model."))


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def print_verdict(console: Console, ok: bool) -> None:
    """The demo's last word: the proof held (every request and the fine-tune), or it did not."""
    verdict = ("[bold green]PROOF: every request continued token for token, and the fine-tune ended "
               "bit-identical.[/]" if ok else "[bold red]MISMATCH: see above.[/]")
    console.print(Panel(verdict, expand=False))


def operator_recover(console: Console, journal: str) -> Tuple[Dict[str, Any], str, float]:
    """Run ``kvj fsck`` and ``kvj recover`` on ``journal`` as an operator would, printing both;
    the recovery manifest, its path and the seconds both commands took."""
    t0 = time.perf_counter()
    fsck = crashrun.kvj("fsck", "--journal", journal, check_codes=(0, 1))
    fsck_s = time.perf_counter() - t0
    console.print(f"[bold]$ kvj fsck --journal {os.path.relpath(journal)}[/]  (exit {fsck.returncode}, {_ms(fsck_s)})")
    console.print(fsck.stdout.strip(), style="dim", markup=False, highlight=False)
    t0 = time.perf_counter()
    rec = crashrun.kvj("recover", "--journal", journal)
    rec_s = time.perf_counter() - t0
    console.print(f"[bold]$ kvj recover --journal {os.path.relpath(journal)}[/]  ({_ms(rec_s)})")
    console.print(rec.stdout.strip(), style="dim", markup=False, highlight=False)
    folder = os.path.join(journal, "recovery")
    path = os.path.join(folder, sorted(os.listdir(folder))[-1])
    with open(path, encoding="utf-8") as f:
        return json.load(f), path, fsck_s + rec_s


class Demo:
    def __init__(self, console: Console, out: str, seed: int, device: str):
        self.c = console
        self.out = out
        self.seed = seed
        self.device = device
        self.spec = _train_spec()
        self.gen_journal = os.path.join(out, "serve", "journal")
        self.results = os.path.join(out, "serve", "delivered")
        self.train_journal = os.path.join(out, "train", "journal")

    def gen_argv(self, *extra: str) -> List[str]:
        return crashrun.worker("generate", "--journal", self.gen_journal, "--results", self.results,
                               "--device", self.device, *WORK.argv(), *extra)

    def train_argv(self, *extra: str) -> List[str]:
        return crashrun.worker("train", "--journal", self.train_journal, "--device", self.device,
                               *self.spec.argv(), *extra)

    def say(self, text: str) -> None:
        self.c.print(text)

    def step(self, n: int, title: str) -> None:
        self.c.print()
        self.c.rule(f"[bold]{n}. {title}", align="left")

    # -- 1 and 2: run, then pull the plug ------------------------------------------------

    def crash(self) -> Crash:
        self.step(1, "Serving and fine-tuning under kvj")
        items = WORK.items()
        total = sum(-(-len(p) // WORK.block_size) + m - 1 for _, p, m, _ in items)  # forward passes
        r = random.Random(self.seed)
        target = r.randint(int(total * 0.35), int(total * 0.65))
        self.say(f"Server: a {WORK.model.arch} model ({WORK.model.size} size, random weights, seed "
                 f"{WORK.model.seed}) serves {len(items)} chats that share a {WORK.shared_prefix}-token system "
                 f"prompt; every {WORK.block_size} tokens of KV cache become one journaled segment.")
        self.say(f"Trainer: fine-tunes a {self.spec.model.arch} model with AdamW for {self.spec.steps} steps; "
                 f"full state every {self.spec.full_every} steps, an XOR delta at every other step.")
        train_target = r.randint(self.spec.steps // 4, self.spec.steps * 3 // 4)
        self.say(f"[dim]Each gets SIGKILL at a random point: the server after forward pass {target} of about {total}, "
                 f"the trainer after step {train_target} (kill seed {self.seed}: kvj demo --seed {self.seed} "
                 "replays these kill points).")
        seen = [0]

        def gen_now(event: Dict[str, Any]) -> bool:
            seen[0] += event.get("event") == "step"
            return seen[0] >= target

        crash = Crash()
        gen_proc, train_proc = crashrun.start(self.gen_argv()), crashrun.start(self.train_argv())
        with self.c.status("serving and training (the models are built from their configs first)..."), \
                ThreadPoolExecutor(2) as pool:
            gen_f = pool.submit(crashrun.kill_when, gen_proc, gen_now)
            train_f = pool.submit(crashrun.kill_when, train_proc,
                                  lambda e: e.get("event") == "step" and e["step"] >= train_target)
            crash.gen, crash.train = gen_f.result(), train_f.result()
        self.step(2, "Crash: SIGKILL mid-flight")
        self._show_crash(crash)
        return crash

    def _show_crash(self, crash: Crash) -> None:
        progress = crash.gen.progress()
        delivered = {e["id"] for e in crash.gen.last("finish")}
        table = Table(title="At the moment of the kill", title_justify="left")
        for col in ("request", "prompt", "state", "KV positions computed"):
            table.add_column(col)
        for rid, prompt, max_new, _ in WORK.items():
            state = ("delivered" if rid in delivered else "in flight" if rid in progress else "not started")
            table.add_row(rid, f"{len(prompt)} tokens", state, str(progress.get(rid, 0)))
        self.c.print(table)
        steps = [e["step"] for e in crash.train.last("step")]
        self.say(f"Trainer: {'finished' if crash.train.finished else 'killed'} after reporting step "
                 f"{max(steps, default=0)} of {self.spec.steps}.")

    # -- 3: recovery through the command line -----------------------------------------------

    def recover(self, journal: str) -> Tuple[Dict[str, Any], str, float]:
        return operator_recover(self.c, journal)

    # -- 4: resume --------------------------------------------------------------------------

    def resume(self, crash: Crash) -> Dict[str, Any]:
        self.step(3, "After the reboot: kvj fsck, kvj recover")
        gen_manifest, gen_path, gen_cli_s = self.recover(self.gen_journal)
        train_manifest = None
        if not crash.train.finished:
            train_manifest, train_path, train_cli_s = self.recover(self.train_journal)
        self.step(4, "Resume from the recovery manifests")
        t0 = time.perf_counter()
        with self.c.status("resuming both processes..."), ThreadPoolExecutor(2) as pool:
            gen_f = pool.submit(crashrun.finish, self.gen_argv("--resume", "--manifest", gen_path))
            train_f = (pool.submit(crashrun.finish, self.train_argv("--resume", "--manifest", train_path))
                       if train_manifest is not None else None)
            gen_events = gen_f.result()
            train_events = train_f.result() if train_f is not None else None
        self.say(f"Both processes finished {time.perf_counter() - t0:.1f} s after the restart "
                 "(including model construction).")
        return {"gen_manifest": gen_manifest, "gen_events": gen_events, "gen_cli_s": gen_cli_s,
                "train_manifest": train_manifest, "train_events": train_events,
                "train_cli_s": train_cli_s if train_manifest is not None else 0.0}

    # -- 5: the uninterrupted runs, and the proof ---------------------------------------------

    def reference(self) -> Tuple[Dict[str, List[int]], Tuple[str, str]]:
        import torch

        self.step(5, "The same work without a crash, for comparison")
        torch.set_num_threads(1)  # as the workload processes run (bit-identical arithmetic)
        torch.use_deterministic_algorithms(True)
        with self.c.status("running both uninterrupted, in this process..."):
            tokens, _ = crashrun.uninterrupted_generation(WORK, "hf", self.device)
            digests = crashrun.uninterrupted_training(self.spec, self.device)
        self.say("done.")
        return tokens, digests

    def proof(self, crash: Crash, resumed: Dict[str, Any], expected: Dict[str, List[int]],
              digests: Tuple[str, str]) -> bool:
        from kvj.demo.worker import read_results

        self.step(6, "The proof")
        got = read_results(self.results)
        progress = crash.gen.progress()
        planned = {r["id"]: r for r in resumed["gen_manifest"]["requests"]}
        done = next(e for e in resumed["gen_events"] if e["event"] == "done")["requests"]
        table = Table(title="Server: every request, against the uninterrupted run", title_justify="left")
        for col in ("request", "tokens identical", "KV at kill", "restored from kvj", "recomputed",
                    "restore", "re-prefill instead"):
            table.add_column(col, justify="right" if col not in ("request", "tokens identical") else "left")
        ok = True
        recomputed_total = restored_total = 0
        for rid, _, max_new, _ in WORK.items():
            same = got.get(rid) == expected[rid]
            ok &= same
            mark = f"[green]yes[/] ({max_new}/{max_new})" if same else "[red]NO[/]"
            entry = done.get(rid)
            if rid in planned and entry is not None:
                pos = planned[rid]["resume_position"]
                lost = progress.get(rid, 0) - pos
                recomputed_total += lost
                restored_total += pos
                table.add_row(rid, mark, str(progress.get(rid, 0)), str(pos), str(lost), _ms(entry["restore_s"]),
                              _ms(entry["prefill_s"]) if "prefill_s" in entry else "-")
            else:
                how = "delivered before the crash" if rid not in done else "started after the restart"
                table.add_row(rid, mark, str(progress.get(rid, 0)), "-", "-", "-", how)
        self.c.print(table)
        self.say(f"KV positions restored from the journal: {restored_total}; recomputed (computed before the "
                 f"kill but not yet durable): {recomputed_total}. `kvj fsck` + `kvj recover` took "
                 f"{resumed['gen_cli_s']:.1f} s as commands (mostly Python start-up).")

        if resumed["train_events"] is None:
            self.say("Trainer: it finished before its kill point, so there was nothing to resume.")
            train_ok = True
        else:
            events = resumed["train_events"]
            done_t = events[-1]
            back = next((e for e in events if e["event"] == "resumed"), None)
            killed_at = max((e["step"] for e in crash.train.last("step")), default=0)
            train_ok = (done_t["params_sha256"], done_t["state_sha256"]) == digests
            ok &= train_ok
            verdict = "[green]bit-identical[/]" if train_ok else "[red]DIFFERENT[/]"
            resumed_at = back["step"] if back else 0
            if back is None:
                source = "nothing durable yet: it started over from step 0"
            elif back["base_step"] == resumed_at:
                source = f"the checkpoint of step {resumed_at}, rebuilt in {_ms(back['restore_s'])}"
            else:
                source = (f"step {resumed_at} = checkpoint {back['base_step']} XOR its delta, rebuilt in "
                          f"{_ms(back['restore_s'])}")
            self.say(f"Trainer: killed after step {killed_at}; the journal held {source}; "
                     f"{killed_at - resumed_at} step(s) redone; final weights and AdamW state {verdict} "
                     "to the uninterrupted run.")
            self.say(f"  sha256(params) {done_t['params_sha256'][:16]}... vs {digests[0][:16]}...")
            stats = done_t["stats"]
            if stats and stats["fulls"] and stats["deltas"]:
                self.say(f"  bytes after the restart: {stats['fulls']} full checkpoints "
                         f"{_mb(stats['full_stored'] / stats['fulls'])} each, {stats['deltas']} deltas "
                         f"{_mb(stats['delta_stored'] / stats['deltas'])} each "
                         f"(parameters: {_mb(_model_stream(stats)['delta_stored'] / stats['deltas'])} "
                         f"as XOR vs {_mb(_model_stream(stats)['full_stored'] / stats['fulls'])} full).")
        print_verdict(self.c, ok)
        self.say(f"[dim]Journals and segments are in {os.path.relpath(self.out)}/; try "
                 f"`kvj inspect --journal {os.path.relpath(self.gen_journal)} --stats`.")
        return ok

    def run(self) -> bool:
        t0 = time.perf_counter()
        self.c.print(Panel.fit("[bold]kvj demo[/]: a model server and a fine-tuning run crash mid-flight (SIGKILL);\n"
                               "kvj brings both back exactly where the disk says they were.", border_style="cyan"))
        crash = self.crash()
        if crash.gen.finished:
            self.say("[yellow]The server finished before its kill point; run the demo again for another one.")
            return False
        resumed = self.resume(crash)
        expected, digests = self.reference()
        ok = self.proof(crash, resumed, expected, digests)
        self.say(f"[dim]Demo took {time.perf_counter() - t0:.0f} s.")
        return ok


def demo(out: str = "demo-out", seed: Optional[int] = None, device: str = "cpu", quick: bool = False,
         requests: int = 4, max_new: int = 96, steps: int = 24) -> bool:
    """Run the demo into ``out``; True when every proof held. The default is the stacks people
    run (``kvj.demo.stacks``: vLLM with KvjConnector, HF Trainer + PEFT with KvjCallback;
    ``requests`` prompts of ``max_new`` tokens each, a fine-tune of ``steps`` steps); ``quick``
    is kvj's own transformers loop and AdamW loop (this module, on ``device``). Without
    ``seed`` the kill points are drawn at random (the seed is printed, so a run can be replayed)."""
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)
    seed = seed if seed is not None else random.randrange(1_000_000)
    if quick:
        return Demo(console, prepare(out), seed, device).run()
    from kvj.demo.stacks import Stacks

    if not 1 <= requests <= 8 or max_new < 16 or steps < 4:
        raise InvalidArgument("the demo takes 1 to 8 requests, at least 16 new tokens and at least 4 steps")
    if device != "cpu":
        raise InvalidArgument("--device is for --quick: the vLLM engine picks its own device")
    return Stacks(console, prepare(out), seed, requests, max_new, steps).run()
