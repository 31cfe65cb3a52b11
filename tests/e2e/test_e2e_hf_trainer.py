"""End to end: a PEFT LoRA fine-tune through Hugging Face ``Trainer`` with ``KvjCallback``,
SIGKILLed at a random optimizer step (or between micro-batches) while saves are in flight,
or inside a save (after some of its segments are durable, before its record), recovered with
``kvj fsck`` + ``kvj recover`` and resumed with ``cb.resume(trainer)``: every loss logged
after the resume, the adapter weights and the optimizer state equal an uninterrupted run's
bit for bit, and the journal holds no frozen base weight."""

from __future__ import annotations

import json
from typing import Sequence

import pytest
from support.e2e import rng, workload_threads
from support.trainkill import check_died_inside_save, inside_save

pytest.importorskip("peft")
pytest.importorskip("transformers")

import kvj  # noqa: E402
from kvj.demo import crashrun  # noqa: E402
from kvj.demo.hf_training import LoraRun, uninterrupted  # noqa: E402
from kvj.demo.workload import SIZES  # noqa: E402
from kvj.segments.store import SegmentStore  # noqa: E402

RUNS = {
    "lora-adamw": LoraRun(),
    "sgd-momentum": LoraRun(optim="sgd", lr=2e-2),
    "cosine-warmup": LoraRun(scheduler="cosine", warmup=6),
    "grad-accum": LoraRun(grad_accum=2, steps=14),
}


def _argv(run: LoraRun, tmp_path, name: str):
    return crashrun.worker("hf-train", "--journal", str(tmp_path / f"{name}-j"), "--output-dir",
                           str(tmp_path / f"{name}-out"), *run.argv())


def _losses(events):
    return {e["step"]: e["loss"] for e in events if e.get("event") == "log"}


def kill_and_resume(run: LoraRun, tmp_path, kills: Sequence[str], seed_name: str, operator: bool = False):
    """Kill once per entry of ``kills``, resume, compare with the uninterrupted run.

    ``"step"`` (``"substep"``): SIGKILL from outside after a random optimizer step (a
    micro-batch before a step's last), while saves are in flight. ``"save"``: the worker
    SIGKILLs itself inside a random save, once its state document is durable and before its
    record (``support.trainkill``), which is checked: the document is stored, no record names
    it. ``operator``: run ``kvj fsck`` and ``kvj recover`` before each resume, as the
    shipped unit does."""
    r = rng(seed_name)
    with workload_threads(deterministic=True):
        ref_events = uninterrupted(run, str(tmp_path / "ref-out"))
    expected_losses, expected = _losses(ref_events), ref_events[-1]
    argv = _argv(run, tmp_path, "run")
    journal = argv[argv.index("--journal") + 1]
    resume, history, reached = ["--resume"], [], 0
    for _ in range(len(kills) + 4):  # a kill before the first save was durable restarts from scratch: not counted
        kind = kills[len(history)]
        # The n-th event (or save) of this process, n leaving a few of the steps it has left.
        last = max(1, (run.steps - reached) * (run.grad_accum - 1 if kind == "substep" else 1) - 3)
        n = r.randint(min(3, last), last)
        if kind == "save":
            cmd, env = inside_save(argv + resume, n)
            now = crashrun.nth_event("dying", 1)
        else:
            cmd, env, now = argv + resume, None, crashrun.nth_event(kind, n)
        killed = crashrun.kill_when(crashrun.start(cmd, env), now)
        if killed.finished:
            break
        if kind == "save":
            check_died_inside_save(journal, killed)
        steps = [e["step"] for e in killed.last("step")]
        if operator:
            crashrun.recover(journal)  # kvj fsck, then kvj recover: cuts a torn tail, verifies every segment
        reached = 0
        if kvj.replay(journal).checkpoint is not None:
            # A process killed before its first step (a micro-batch in) reached where it resumed.
            began = [e["step"] for e in killed.events if e["event"] == "resumed"]
            reached = max(steps, default=began[-1] if began else 0)
            history.append((kind, reached, _losses(killed.events)))
        if len(history) == len(kills):
            break
    events = crashrun.finish(argv + resume)
    done = events[-1]
    assert done["event"] == "done" and done["step"] == run.steps
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(history) == len(kills) and resumed, "the kills did not land after durable saves"
    assert resumed[0]["step"] <= history[-1][1] + 1
    after = _losses(events)
    assert set(after) == {s for s in expected_losses if s > resumed[0]["step"]}
    assert after == {s: expected_losses[s] for s in after}, "a loss logged after the resume differs"
    for _, _, before in history:  # what the killed processes logged matches too
        assert before == {s: expected_losses[s] for s in before}
    assert (done["adapter_sha256"], done["optimizer_sha256"]) == (expected["adapter_sha256"],
                                                                  expected["optimizer_sha256"])
    print(f"{seed_name}: killed {[(h[0], h[1]) for h in history]}, resumed from {[e['step'] for e in resumed]}")
    return journal


def _assert_no_base_weights(run: LoraRun, journal: str) -> None:
    """Every byte the journal stored, decoded: no frozen base weight is in it, and the model
    streams (segments, or inside a save's document when small) hold exactly the adapter's values."""
    import msgpack
    import torch

    base = run.model.build("cpu")
    needles = [p.detach().numpy().tobytes()[:4096] for p in base.parameters()]
    store = SegmentStore(f"{journal}/segments")
    _, hidden, _, layers, heads, kv_heads = SIZES[run.model.size]
    q = run.rank * hidden * 2  # lora_A: r x hidden, lora_B: hidden x r
    v = run.rank * hidden + kv_heads * (hidden // heads) * run.rank
    adapter_values = layers * (q + v)
    seen = 0
    for key in store.keys():
        info = store.info(key)
        raw = store.get(key).contiguous().view(torch.uint8).numpy().tobytes()
        assert not any(n in raw for n in needles), f"segment {key} ({info.layout}) holds base weights"
        layout = info.layout or {}
        if str(layout.get("name", "")).startswith("model.") and layout.get("format") == "kvj-train-full/1":
            assert layout["numel"] == adapter_values
            seen += 1
        if layout.get("name") == "tree":
            inline = msgpack.unpackb(raw, raw=False, strict_map_key=False).get("inline") or {}
            for name, (dtype, data) in inline.items():
                if name.startswith("model."):
                    assert (dtype, len(data)) == ("float32", 4 * adapter_values)
                    seen += 1
    assert seen
    store.close()


def test_lora_trainer_killed_twice_resumes_bit_identical_and_journals_no_base_weights(tmp_path):
    run = RUNS["lora-adamw"]
    journal = kill_and_resume(run, tmp_path, ["save", "step"], "hf-lora", operator=True)
    _assert_no_base_weights(run, journal)


# one variant in the fast suite, the other in -m slow (CI time)
@pytest.mark.parametrize("name", ["sgd-momentum", pytest.param("cosine-warmup", marks=pytest.mark.slow)])
def test_trainer_variant_killed_resumes_bit_identical(tmp_path, name):
    kill_and_resume(RUNS[name], tmp_path, ["step"], f"hf-{name}")


def test_gradient_accumulation_killed_between_micro_batches_resumes_bit_identical(tmp_path):
    kill_and_resume(RUNS["grad-accum"], tmp_path, ["substep"], "hf-grad-accum")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_many_kills_trainer(tmp_path, name):
    run = RUNS[name]
    kind = "substep" if run.grad_accum > 1 else "step"
    kill_and_resume(LoraRun(**{**run.__dict__, "steps": 40}), tmp_path, [kind, "save", kind, "save", kind],
                    f"hf-many-{name}")


def test_the_benchmark_runs_and_measures_crash_loss_as_it_says(tmp_path):
    """kvj bench training, shrunk: every method ran, DCP loads are bit-exact both ways, and
    the crash-loss column means what it says (no checkpoints loses every step done, Trainer
    saving every step loses none). Its timings are not asserted: they are the benchmark's."""
    from benchmarks.training import METHODS, run

    with workload_threads():
        result = run(str(tmp_path), steps=4, rounds=1, mib=1, tensors=16)
    rows = {r["method"]: r for r in result["trainer"]}
    assert list(rows) == list(METHODS)
    assert rows["no checkpoints"]["crash loses (max, mean steps)"] == "3, 1.5"  # before steps 1..4: 0, 1, 2, 3
    assert rows["Trainer save_steps=1"]["crash loses (max, mean steps)"] == "0, 0.0"
    assert rows["kvj every step"]["KiB written/step"] > 0 and rows["no checkpoints"]["KiB written/step"] == 0
    assert [(r["method"], r["tensors"]) for r in result["snapshot"]] == [("kvj StateBuffers.capture", 64),
                                                                         ("clone every tensor", 64)]
    assert [(r["method"], r["bit-exact"]) for r in result["dcp"]] == [
        ("kvj JournalWriter", "yes"), ("kvj JournalWriter codec=raw", "yes"), ("DCP FileSystemWriter", "yes")]


def _killed_after_a_durable_save(argv, journal: str) -> None:
    """Run ``argv`` and SIGKILL it once a save is durable (a kill before the first durable
    save is retried later in the run)."""
    for n in (3, 6, 9):
        killed = crashrun.kill_when(crashrun.start(argv), crashrun.nth_event("step", n))
        assert not killed.finished
        if kvj.replay(journal).checkpoint is not None:
            return
    raise AssertionError("no save was durable when the run was killed")


def test_resuming_after_a_lora_rank_change_is_refused_and_changed_settings_are_named(tmp_path):
    """Issue 26, item 4, as reported: a LoRA fine-tune at r=1 through Trainer's default fused
    AdamW, SIGKILLed, resumed with r=4. Before, the resume went through (the adapter's saved
    values broadcast into the larger one, the old moments loaded into the new parameters) and
    the process died of heap corruption (SIGSEGV or SIGABRT) once fused AdamW had written past
    the moments' end. Now it exits 1 with a FormatError naming the adapter matrices and both
    shapes, and touches nothing: the journal is as the kill left it, no resume directory is
    written. Resuming with r=1 but another learning rate and dataset size works and says, in
    one warning, what differs and that the journaled values continue."""
    import subprocess

    r1 = LoraRun(rank=1, optim="adamw-fused", steps=12)
    argv = _argv(r1, tmp_path, "rank")
    journal = argv[argv.index("--journal") + 1]
    _killed_after_a_durable_save(argv, journal)
    before = kvj.replay(journal)

    r4 = _argv(LoraRun(rank=4, optim="adamw-fused", steps=12), tmp_path, "rank") + ["--resume"]
    proc = subprocess.run(r4, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, f"exited {proc.returncode}: {proc.stderr[-3000:]}"
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("kvj.errors.FormatError: the journaled trainable parameters do not fit this model")
    for matrix, saved, model in (("lora_A", "(1, 64)", "(4, 64)"), ("lora_B", "(64, 1)", "(64, 4)")):
        assert (f"base_model.model.model.layers.0.self_attn.q_proj.{matrix}.default.weight is journaled as "
                f"{saved} float32, the model's is {model} float32") in error
    after = kvj.replay(journal)
    assert (after.counts, after.checkpoint, after.deltas) == (before.counts, before.checkpoint, before.deltas)
    assert not (tmp_path / "rank-out" / "kvj-resume").exists()

    changed = _argv(LoraRun(rank=1, optim="adamw-fused", steps=12, lr=1e-3, samples=96), tmp_path, "rank")
    proc = subprocess.run(changed + ["--resume"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "ResumeMismatch" in line]
    assert len(warned) == 1, proc.stderr[-3000:]
    assert "learning rate (initial_lr, group 0): journaled 0.002, this run 0.001" in warned[0]
    assert "dataset size: journaled 64 samples, this run 96" in warned[0]
    assert "learning rate (initial_lr, group 1)" in warned[0]  # Trainer's no-decay group
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert events[0]["event"] == "resumed" and events[-1] == {**events[-1], "event": "done", "step": 12}
