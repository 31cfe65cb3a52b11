"""End to end: a PEFT LoRA fine-tune through Hugging Face ``Trainer`` with ``KvjCallback``,
SIGKILLed at a random optimizer step (or between micro-batches) while saves are in flight,
recovered with ``kvj fsck`` + ``kvj recover`` and resumed with ``cb.resume(trainer)``: every
loss logged after the resume, the adapter weights and the optimizer state equal an
uninterrupted run's bit for bit, and the journal holds no frozen base weight."""

from __future__ import annotations

import pytest
from support.e2e import rng, workload_threads

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


def kill_and_resume(run: LoraRun, tmp_path, kills: int, seed_name: str, event: str = "step",
                    operator: bool = False):
    """Kill ``kills`` times, resume, compare with the uninterrupted run. ``operator``: run
    ``kvj fsck`` and ``kvj recover`` before each resume, as the shipped unit does."""
    r = rng(seed_name)
    with workload_threads(deterministic=True):
        ref_events = uninterrupted(run, str(tmp_path / "ref-out"))
    expected_losses, expected = _losses(ref_events), ref_events[-1]
    argv = _argv(run, tmp_path, "run")
    journal = argv[argv.index("--journal") + 1]
    resume, history = ["--resume"], []
    total = run.steps * (run.grad_accum - 1 if event == "substep" else 1)  # substep: a micro-batch before the last
    for _ in range(kills + 4):  # a kill before the first save was durable restarts from scratch: not counted
        killed = crashrun.kill_when(crashrun.start(argv + resume), crashrun.nth_event(event, r.randint(3, total - 3)))
        if killed.finished:
            break
        steps = [e["step"] for e in killed.last("step")]
        if operator:
            crashrun.recover(journal)  # kvj fsck, then kvj recover: cuts a torn tail, verifies every segment
        if kvj.replay(journal).checkpoint is not None:
            history.append((max(steps, default=0), _losses(killed.events)))
        if len(history) == kills:
            break
    events = crashrun.finish(argv + resume)
    done = events[-1]
    assert done["event"] == "done" and done["step"] == run.steps
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(history) == kills and resumed, "the kills did not land after durable saves"
    assert resumed[0]["step"] <= history[-1][0] + 1
    after = _losses(events)
    assert set(after) == {s for s in expected_losses if s > resumed[0]["step"]}
    assert after == {s: expected_losses[s] for s in after}, "a loss logged after the resume differs"
    for _, before in history:  # what the killed processes logged matches too
        assert before == {s: expected_losses[s] for s in before}
    assert (done["adapter_sha256"], done["optimizer_sha256"]) == (expected["adapter_sha256"],
                                                                  expected["optimizer_sha256"])
    print(f"{seed_name}: killed at steps {[h[0] for h in history]}, resumed from {[e['step'] for e in resumed]}")
    return journal


def _assert_no_base_weights(run: LoraRun, journal: str) -> None:
    """Every byte the journal stored, decoded: no frozen base weight is in it, and the model
    streams hold exactly the adapter's values."""
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
    assert seen
    store.close()


def test_lora_trainer_killed_twice_resumes_bit_identical_and_journals_no_base_weights(tmp_path):
    run = RUNS["lora-adamw"]
    journal = kill_and_resume(run, tmp_path, 2, "hf-lora", operator=True)
    _assert_no_base_weights(run, journal)


@pytest.mark.parametrize("name", ["sgd-momentum", "cosine-warmup"])
def test_trainer_variant_killed_resumes_bit_identical(tmp_path, name):
    kill_and_resume(RUNS[name], tmp_path, 1, f"hf-{name}")


def test_gradient_accumulation_killed_between_micro_batches_resumes_bit_identical(tmp_path):
    kill_and_resume(RUNS["grad-accum"], tmp_path, 1, "hf-grad-accum", event="substep")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_many_kills_trainer(tmp_path, name):
    run = RUNS[name]
    kill_and_resume(LoraRun(**{**run.__dict__, "steps": 40}), tmp_path, 5, f"hf-many-{name}",
                    event="substep" if run.grad_accum > 1 else "step")
