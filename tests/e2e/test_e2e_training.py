"""End to end: SIGKILL a fine-tuning process at a random step and inside a save, recover,
continue, and end with parameters and AdamW state bit-identical to an uninterrupted run
(SHA-256 compared)."""

from __future__ import annotations

import os

import pytest
import torch
from support.e2e import rng, workload_threads
from support.trainkill import check_died_inside_save, inside_save

import kvj
from kvj.demo import crashrun
from kvj.demo.training import TrainSpec, train
from kvj.demo.workload import ModelSpec
from kvj.integrations.training import StateJournal, recover_training, unxor, xor
from kvj.segments.store import SegmentStore

pytest.importorskip("transformers")

SPEC = TrainSpec(ModelSpec("llama", "tiny"), steps=24, full_every=8)


def reference(spec: TrainSpec):
    with workload_threads(deterministic=True):
        return crashrun.uninterrupted_training(spec)


def test_xor_delta_round_trips_every_bit_pattern():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=gen)
    cur = base + 1e-3 * torch.randn(4096, generator=gen)
    cur[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    bits = xor(cur, base)
    assert bits.dtype == torch.int32
    assert torch.equal(unxor(base, bits).view(torch.int32), cur.view(torch.int32))
    assert (bits.view(torch.uint8).view(-1, 4)[:, 3] == 0).float().mean() > 0.9  # sign/exponent barely move


def test_sigkill_at_random_step_and_inside_a_save_continues_bit_identical(tmp_path):
    """Two kills after durable saves: one from outside at a random step, one inside a save
    (its document durable, its record not written); each resume goes through kvj recover."""
    r = rng("training")
    expected = reference(SPEC)
    journal = str(tmp_path / "j")
    argv = crashrun.worker("train", "--journal", journal, *SPEC.argv())
    resume, killed_at, resumed_steps, kinds, held = [], [], [], [], 0
    for _ in range(8):  # an early kill (before the first save was durable) restarts from scratch: not counted
        kind = "save" if kinds else "step"
        n = r.randint(2, max(2, SPEC.steps - held - 4))  # of this process's steps (saves)
        if kind == "save":
            killed = crashrun.kill_when(crashrun.start(*inside_save(argv + resume, n)), crashrun.nth_event("dying", 1))
        else:
            killed = crashrun.kill_when(crashrun.start(argv + resume), crashrun.nth_step(n))
        steps = [e["step"] for e in killed.last("step")]
        resumed_steps += [e["step"] for e in killed.last("resumed")]
        if killed.finished:
            break
        if kind == "save":
            check_died_inside_save(journal, killed)
        killed_at.append(max(steps, default=0))
        doc = crashrun.recover(journal)
        training = doc["manifest"]["training"]
        resume = ["--resume", "--manifest", doc["manifest_path"]]
        held = training["step"] or 0
        if training["step"] is None:  # killed before the first save was durable: nothing to restore
            continue
        assert training["step"] <= killed_at[-1]
        assert training["checkpoint"]["step"] == 1 or training["checkpoint"]["step"] % SPEC.full_every == 0
        kinds.append(kind)
        if len(kinds) == 2:
            break
    events = crashrun.finish(argv + resume)
    resumed_steps += [e["step"] for e in events if e["event"] == "resumed"]
    done = events[-1]
    assert done["event"] == "done" and done["step"] == SPEC.steps
    assert (done["params_sha256"], done["state_sha256"]) == expected
    assert kinds == ["step", "save"], f"kills after durable saves: {kinds}"
    print(f"training: killed at steps {killed_at} ({kinds}), resumed from {resumed_steps}")


def test_damaged_newest_delta_falls_back_to_the_one_before(tmp_path):
    """A flipped byte in the newest delta: recovery uses the delta before it; training
    repeats one more step and still ends bit-identical."""
    spec = TrainSpec(ModelSpec("llama", "tiny"), steps=14, full_every=8)
    expected = reference(spec)
    with workload_threads(deterministic=True):
        with kvj.Journal.open(tmp_path / "j") as journal:
            train(TrainSpec(spec.model, steps=12, full_every=8), journal)
        state = kvj.replay(str(tmp_path / "j"))
        assert state.checkpoint["step"] == 8 and [d["step"] for d in state.deltas] == [9, 10, 11, 12]
        store = SegmentStore(str(tmp_path / "j" / "segments"))
        path = store.backend.path(state.deltas[-1]["keys"]["s:model.float32"])
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
        rec = recover_training(state, store)
        assert rec.step == 11 and "step 12" in rec.fallback
        with kvj.Journal.open(tmp_path / "j") as journal:
            trainer, _ = train(spec, journal, resume=rec)
    assert crashrun.state_digests(trainer.tensors()) == expected


def test_deltas_cost_less_than_full_checkpoints(tmp_path):
    """The reported bytes: every delta tensor is either an XOR or (when the XOR would not
    compress better, as for Adam's fast-moving first moment) the tensor itself, and the
    parameters' XOR deltas are well under their full checkpoints."""
    with workload_threads(deterministic=True), kvj.Journal.open(tmp_path / "j") as journal:
        _, stats = train(TrainSpec(ModelSpec("llama", "tiny"), steps=16, full_every=8), journal)
    assert stats.full.count == 3 and stats.delta.count == 13  # fulls at steps 1 (the first), 8 and 16
    per = stats.per_stream
    assert {"model.float32", "optimizer.exp_avg.float32", "optimizer.exp_avg_sq.float32"} <= set(per)
    full_avg = {n: per[n]["full_stored"] / stats.full.count for n in per}
    delta_avg = {n: per[n]["delta_stored"] / stats.delta.count for n in per}
    assert all(per[n]["xor"] + per[n]["whole"] == stats.delta.count for n in per)
    assert per["model.float32"]["xor"] == stats.delta.count
    assert delta_avg["model.float32"] < 0.9 * full_avg["model.float32"]
    print("training bytes per save:", {n: (round(full_avg[n]), round(delta_avg[n])) for n in per})


def test_state_journal_refuses_full_every_zero(tmp_path):
    with kvj.Journal.open(tmp_path / "j") as journal, pytest.raises(kvj.FormatError):
        StateJournal(journal, 0, model="m")


@pytest.mark.slow
def test_many_kills_training(tmp_path):
    spec = TrainSpec(ModelSpec("qwen2", "small"), steps=80, full_every=10)
    r = rng("training-many")
    expected = reference(spec)
    journal = str(tmp_path / "j")
    argv = crashrun.worker("train", "--journal", journal, *spec.argv())
    resume = []
    for _ in range(6):
        killed = crashrun.kill_when(crashrun.start(argv + resume), crashrun.nth_step(r.randint(1, 15)))
        if killed.finished:
            break
        doc = crashrun.recover(journal)
        resume = ["--resume", "--manifest", doc["manifest_path"]]
    done = crashrun.finish(argv + resume)[-1]
    assert (done["params_sha256"], done["state_sha256"]) == expected
