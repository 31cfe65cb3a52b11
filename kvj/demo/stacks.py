"""``kvj demo``: pull the plug on the stacks people run, then prove kvj brings them back exactly.

* Serving: a vLLM engine (a random-weight Qwen2, CPU backend) with ``KvjConnector`` serves a
  batch of requests in a child process and is SIGKILLed mid-generation (some requests
  mid-decode); ``kvj fsck`` and ``kvj recover`` run through the real command line; a fresh
  engine resumes every request from the manifest (``kvj.integrations.vllm.resuming``); then it
  takes live requests and hands them off (``kvj.integrations.vllm.drain``) mid-decode to a
  second engine, which continues them loading their KV from the first engine's store.
* Training: the nightly LoRA fine-tune, ``transformers.Trainer`` + PEFT with ``KvjCallback``,
  is SIGKILLed mid-run, recovered and resumed with ``KvjCallback.resume(trainer)``.
* The proof: every request's tokens (and logprobs) equal an uninterrupted engine's, with the
  KV restored against recomputed; the adapter and optimizer state are bit-identical
  (SHA-256) and every step's loss equal to an uninterrupted fine-tune's.

The demo is a list of steps (``Stacks.steps``): each part (``VllmPart``, ``TrainerPart``)
does its share of each. Kill points come from one seed, printed (``kvj demo --seed N``
replays them). Without vLLM the serving part is left out in one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

import kvj
from kvj.demo import crashrun
from kvj.demo.run import operator_recover, print_verdict

#: Logprobs of a resumed request against the uninterrupted engine's: float32 on the CPU
#: backend, batched otherwise after the resume (the e2e tests' tolerance).
LOGPROB_TOL = 5e-5
#: Seconds each step of the served engine lasts at least, as a larger model's would: the kill
#: lands mid-decode however busy the machine is (the parent reacts to a step within a few).
PACE = 0.05
ENGINE_TIMEOUT = 900.0  #: seconds an engine may take (start-up is 30-90 s on a loaded 2-core machine)


def vllm_available() -> bool:
    """Whether vLLM can be imported here (looked up without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # ValueError: a module object without a spec stands in for it
        return False


class Engine:
    """A ``python -m kvj.demo.vllm_engine`` child process and its results directory."""

    def __init__(self, root: str, name: str, model: str, journal: str, jobs: List[Dict[str, Any]],
                 in_process: bool = False, events: bool = False, sources: Sequence[str] = ()):
        self.name, self.out = name, os.path.join(root, f"{name}-out")
        self.log = os.path.join(root, f"{name}.log")
        read, write = os.pipe() if events else (None, None)
        spec = {"model": model, "journal": journal, "out": self.out, "jobs": jobs, "in_process": in_process,
                "events_fd": write, "sources": list(sources)}
        path = os.path.join(root, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        with open(self.log, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvj.demo.vllm_engine", path], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         pass_fds=(write,) if events else ())
        self.events = None
        if events:
            os.close(write)
            self.events = os.fdopen(read, "r")

    def result(self, n: int) -> Optional[Dict[str, Any]]:
        path = os.path.join(self.out, f"job-{n}.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def _failed(self) -> RuntimeError:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return RuntimeError(f"vLLM engine {self.name} exited {self.proc.returncode}:\n{f.read()[-4000:]}")

    def wait(self) -> None:
        """Until it exits; raises with its log's tail unless it exited 0."""
        try:
            self.proc.wait(timeout=ENGINE_TIMEOUT)
        finally:
            self.kill()
        if self.proc.returncode != 0:
            raise self._failed()

    def kill_when(self, now: Callable[[Dict[str, Any]], bool]) -> bool:
        """SIGKILL it (its whole process group) at the first of its step events for which
        ``now(event)``; False if it exited first."""
        assert self.events is not None
        try:
            for line in self.events:
                if now(json.loads(line)):
                    return True
        finally:
            self.kill()
            self.events.close()
        if self.proc.returncode not in (0, -signal.SIGKILL):
            raise self._failed()
        return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _in_flight(journal: str) -> Dict[int, Tuple[int, int]]:
    """Prompt length -> (generated tokens journaled, tokens of KV durable) of each request in flight."""
    state = kvj.replay(journal)
    return {int(r.meta.get("prompt_len", 0)): (len(r.output), r.resume_position) for r in state.in_flight()}


class VllmPart:
    """Serving: a vLLM engine with KvjConnector, killed mid-generation, recovered, resumed."""

    def __init__(self, demo: "Stacks", requests: int, max_new: int):
        self.d, self.max_new = demo, max_new
        self.root = os.path.join(demo.out, "vllm")
        os.makedirs(self.root)
        self.journal = os.path.join(self.root, "journal")
        rng = random.Random(11)  # the prompts: fixed
        lengths = [60, 90, 124, 200, 150, 40, 180, 100][:requests]
        self.prompts = [[rng.randrange(1024) for _ in range(n)] for n in lengths]
        self.target = demo.rng.randint(8, max(8, max_new * 2 // 3))  # generated tokens journaled at the kill
        self.job = {"serve": self.prompts, "max_tokens": max_new}
        #: The handoff: live requests the resumed engine takes, handed off to a second engine once
        #: one of them has generated ``self.at`` tokens.
        self.live = [[rng.randrange(1024) for _ in range(n)] for n in [70, 110, 45][:min(3, requests)]]
        self.at = demo.rng.randint(4, max(4, max_new // 3))

    def intro(self) -> str:
        return (f"Server: vLLM (CPU backend) with KvjConnector serves {len(self.prompts)} requests "
                f"(prompts of {', '.join(str(len(p)) for p in self.prompts)} tokens, {self.max_new} new tokens each) "
                f"with a random-weight Qwen2; every 32 tokens of KV are a journaled block. SIGKILL once a request "
                f"has generated {self.target} tokens.")

    def run(self) -> None:
        from kvj.demo.vllm_engine import build_model

        self.model = build_model(os.path.join(self.root, "qwen2"))
        self.reference = Engine(self.root, "reference", self.model, os.path.join(self.root, "reference-journal"),
                                [self.job, {"serve": self.live, "max_tokens": self.max_new}], in_process=True)
        # In process: the engine core steps when the driver does (in its own process it runs ahead).
        self.engine = Engine(self.root, "served", self.model, self.journal, [{**self.job, "pace": PACE}],
                             in_process=True, events=True)

    def crash(self) -> None:
        killed = self.engine.kill_when(lambda e: max(e["generated"]) >= self.target)
        self.at_kill = _in_flight(self.journal)
        self.missed = not killed or not self.at_kill

    def crash_rows(self, table: Table) -> None:
        for p in self.prompts:
            n, kv = self.at_kill.get(len(p), (None, 0))
            state = ("finished" if n is None else f"decoding: {n} tokens generated" if n else "in prefill")
            table.add_row("vLLM", f"request with a {len(p)}-token prompt", f"{state}; KV of {kv} tokens durable")

    def recover(self) -> None:
        _, self.manifest, self.cli_s = operator_recover(self.d.c, self.journal)

    def resume(self) -> None:
        """The resumed engine continues the killed one's requests, then takes live requests and hands
        them off (``kvj.integrations.vllm.drain``) to a second engine, which continues them from
        the handoff manifest, loading their KV from the first engine's store (the blocks its
        connector finds there when it starts: so it starts once the drain is done)."""
        handoff = {"handoff": self.live, "max_tokens": self.max_new, "at": self.at, "to": "takeover"}
        # In process, so that the handoff's requests are still decoding when it drains them.
        self.resumed = Engine(self.root, "resumed", self.model, self.journal, [{"resume": self.manifest}, handoff],
                              in_process=True)
        self.resumed.wait()
        self.takeover = Engine(self.root, "takeover", self.model, os.path.join(self.root, "takeover-journal"),
                               [{"resume": self.resumed.result(1)["manifest"]}], sources=[self.journal])
        self.takeover.wait()
        self.reference.wait()

    def show_handoff(self) -> None:
        drained = self.resumed.result(1)
        self.d.say(f"The resumed engine took {len(self.live)} more requests (prompts of "
                   f"{', '.join(str(len(p)) for p in self.live)} tokens); once one had generated {self.at} tokens, "
                   f"`drain(llm, \"takeover\")` handed all of them off (generated so far: "
                   f"{', '.join(map(str, drained['generated']))}) to a second engine with its "
                   f"own journal, which continued them from {os.path.relpath(drained['manifest'])}, loading their KV "
                   "from the first engine's store (read-only).")

    def proof(self) -> bool:
        ok = self._compare("vLLM + KvjConnector: every request against an uninterrupted engine",
                           self.resumed.result(0), self.prompts, self.reference.result(0))
        job = self.resumed.result(0)
        self.d.say(f"`kvj fsck` + `kvj recover` took {self.cli_s:.1f} s as commands; the resumed engine "
                   f"finished every request {job['seconds']:.1f} s after it started serving.")
        ok &= self._compare("Handoff: every live request, continued on the second engine, against an "
                            "uninterrupted engine", self.takeover.result(0), self.live, self.reference.result(1))
        return ok

    def _compare(self, title: str, job: Dict[str, Any], prompts: List[List[int]], reference: Dict[str, Any]) -> bool:
        ref = {tuple(p): r for p, r in zip(prompts, reference["requests"])}
        table = Table(title=title, title_justify="left")
        for col in ("request", "tokens identical", "logprobs (max diff)", "tokens journaled before",
                    "KV restored", "recomputed"):
            table.add_column(col, justify="left" if col in ("request", "tokens identical") else "right")
        ok, restored, recomputed = bool(job["requests"]), 0, 0
        for r in job["requests"]:
            want = ref[tuple(r["prompt"])]
            same = r["all_token_ids"] == want["token_ids"]
            got_lp, want_lp = r.get("logprobs", []), want["logprobs"][r["resumed_at"]:]
            diff = max((abs(a - b) for a, b in zip(got_lp, want_lp)), default=0.0)
            lp_ok = len(got_lp) == len(want_lp) and diff <= LOGPROB_TOL
            ok &= same and lp_ok
            restored += r["restored"] + r["reused"]
            recomputed += r["recomputed"]
            table.add_row(f"{len(r['prompt'])}-token prompt",
                          f"[green]yes[/] ({len(r['all_token_ids'])}/{len(want['token_ids'])})" if same else "[red]NO[/]",
                          f"{diff:.1e}" if lp_ok else f"[red]{diff:.1e}[/]", str(r["resumed_at"]),
                          str(r["restored"] + r["reused"]), str(r["recomputed"]))
        self.d.c.print(table)
        self.d.say(f"KV tokens restored from kvj's journal: {restored}; recomputed by vLLM: {recomputed}.")
        return ok


class TrainerPart:
    """Training: HF Trainer + PEFT LoRA with KvjCallback, killed mid-run, recovered, resumed."""

    def __init__(self, demo: "Stacks", steps: int):
        from kvj.demo.hf_training import LoraRun

        self.d, self.missed = demo, False  # finishing before its kill point leaves nothing to prove
        self.run_spec = LoraRun(steps=steps)
        self.root = os.path.join(demo.out, "train")
        self.journal = os.path.join(self.root, "journal")
        self.argv = crashrun.worker("hf-train", "--journal", self.journal, "--output-dir",
                                    os.path.join(self.root, "trainer-out"), *self.run_spec.argv())
        self.target = demo.rng.randint(max(2, steps // 4), max(2, steps * 3 // 4))

    def intro(self) -> str:
        return (f"Trainer: the nightly LoRA fine-tune, transformers.Trainer + PEFT (rank {self.run_spec.rank}, "
                f"AdamW) for {self.run_spec.steps} steps, KvjCallback journaling every step (full state every 8, "
                f"XOR deltas between); SIGKILL after step {self.target}.")

    def run(self) -> None:
        self.proc = crashrun.start(self.argv)

    def crash(self) -> None:
        self.killed = crashrun.kill_when(self.proc, lambda e: e.get("event") == "step" and e["step"] >= self.target)

    def crash_rows(self, table: Table) -> None:
        steps = [e["step"] for e in self.killed.last("step")]
        table.add_row("HF Trainer", "LoRA fine-tune",
                      "finished" if self.killed.finished else f"killed after step {max(steps, default=0)}")

    def recover(self) -> None:
        self.cli_s = 0.0
        if not self.killed.finished:
            _, _, self.cli_s = operator_recover(self.d.c, self.journal)

    def resume(self) -> None:
        from kvj.demo.hf_training import uninterrupted

        import torch

        self.events = None if self.killed.finished else crashrun.finish(self.argv + ["--resume"])
        torch.set_num_threads(1)  # as the worker runs (bit-identical arithmetic)
        torch.use_deterministic_algorithms(True)
        self.expected = uninterrupted(self.run_spec, os.path.join(self.root, "reference-out"))

    def proof(self) -> bool:
        if self.events is None:
            self.d.say("Trainer: it finished before its kill point, so there was nothing to resume.")
            return True
        losses = lambda events: {e["step"]: e["loss"] for e in events if e.get("event") == "log"}  # noqa: E731
        want = losses(self.expected)
        back = next((e for e in self.events if e["event"] == "resumed"), None)
        resumed_at = back["step"] if back else 0
        got = {**{s: v for s, v in losses(self.killed.events).items() if s <= resumed_at}, **losses(self.events)}
        done, ref = self.events[-1], self.expected[-1]
        killed_at = max((e["step"] for e in self.killed.last("step")), default=0)
        table = Table(title="HF Trainer + PEFT + KvjCallback: against an uninterrupted fine-tune", title_justify="left")
        for col in ("what", "resumed run", "uninterrupted", "verdict"):
            table.add_column(col)
        ok = True
        for what, key in (("adapter sha256", "adapter_sha256"), ("optimizer sha256", "optimizer_sha256")):
            same = done[key] == ref[key]
            ok &= same
            table.add_row(what, done[key][:16] + "...", ref[key][:16] + "...",
                          "[green]bit-identical[/]" if same else "[red]DIFFERENT[/]")
        equal = sum(got.get(s) == v for s, v in want.items())
        ok &= equal == len(want) and done["step"] == ref["step"]
        table.add_row("loss at every step", f"{len(got)} steps", f"{len(want)} steps",
                      f"[green]equal ({equal}/{len(want)})[/]" if equal == len(want) else f"[red]{equal}/{len(want)}[/]")
        self.d.c.print(table)
        source = (f"the state of step {resumed_at} (checkpoint {back['base_step']}"
                  f"{'' if back['base_step'] == resumed_at else ' + XOR deltas'})" if back else "nothing yet: step 0")
        self.d.say(f"Trainer: killed after step {killed_at}; KvjCallback.resume(trainer) restored {source}; "
                   f"{killed_at - resumed_at} step(s) redone. `kvj fsck` + `kvj recover` took {self.cli_s:.1f} s.")
        return ok


class Stacks:
    """The default demo: each step runs every part's share of it, in parallel where it can."""

    def __init__(self, console: Console, out: str, seed: int, requests: int, max_new: int, steps: int):
        self.c, self.out, self.seed = console, out, seed
        self.rng = random.Random(seed)
        self.parts: List[Any] = []
        if vllm_available():
            self.parts.append(VllmPart(self, requests, max_new))
        else:
            self.c.print("[yellow]The vLLM part needs vLLM (`pip install -e '.[vllm]'`, see README \"vLLM\"); "
                         "running the fine-tuning part only.")
        self.parts.append(TrainerPart(self, steps))

    def say(self, text: str) -> None:
        self.c.print(text)

    def _each(self, method: str) -> None:
        """Call ``method`` of every part at once, in threads (the parts' work is in child processes)."""
        with ThreadPoolExecutor(len(self.parts)) as pool:
            futures: List[Future] = [pool.submit(getattr(p, method)) for p in self.parts]
            for f in futures:
                f.result()

    def start(self) -> None:
        for p in self.parts:
            self.say(p.intro())
        self.say(f"[dim]Kill seed {self.seed}: kvj demo --seed {self.seed} replays these kill points.")
        with self.c.status("starting (a vLLM engine takes 30-90 s to start here) and running until the kills..."):
            self._each("run")
            self._each("crash")

    def show_crash(self) -> None:
        table = Table(title="At the moment of the kill", title_justify="left")
        for col in ("stack", "work", "state (as the journal says)"):
            table.add_column(col)
        for p in self.parts:
            p.crash_rows(table)
        self.c.print(table)

    def recover(self) -> None:
        for p in self.parts:
            p.recover()

    def resume(self) -> None:
        t0 = time.perf_counter()
        with self.c.status("resuming both, and running the uninterrupted references..."):
            self._each("resume")
        self.say(f"Resumed and compared runs finished {time.perf_counter() - t0:.1f} s after the restart.")

    @property
    def steps(self) -> List[Tuple[str, Callable[[], Any]]]:
        """The demo's steps, in order (the handoff's engines run during the resume; its step shows it)."""
        return [("Serving and fine-tuning under kvj", self.start), ("Crash: SIGKILL mid-flight", self.show_crash),
                ("After the reboot: kvj fsck, kvj recover", self.recover),
                ("Resume from the journal", self.resume)] + (
                    [("Handoff of live requests to a second engine", self.parts[0].show_handoff)]
                    if isinstance(self.parts[0], VllmPart) else [])

    def run(self) -> bool:
        t0 = time.perf_counter()
        what = "a vLLM server and a Hugging Face fine-tune crash" if len(self.parts) > 1 else \
            "a Hugging Face fine-tune crashes"
        self.c.print(Panel.fit(f"[bold]kvj demo[/]: {what} mid-flight (SIGKILL);\nkvj brings "
                               "them back exactly where the disk says they were.", border_style="cyan"))
        for n, (title, step) in enumerate(self.steps, 1):
            self.c.print()
            self.c.rule(f"[bold]{n}. {title}", align="left")
            step()
            if n == 1 and any(p.missed for p in self.parts):
                self.say("[yellow]The engine finished before its kill point; run the demo again for another one.")
                return False
        self.c.print()
        self.c.rule(f"[bold]{len(self.steps) + 1}. The proof", align="left")
        ok = all([p.proof() for p in self.parts])
        print_verdict(self.c, ok)
        self.say(f"[dim]Journals and segments are in {os.path.relpath(self.out)}/. Demo took "
                 f"{time.perf_counter() - t0:.0f} s.")
        return ok

