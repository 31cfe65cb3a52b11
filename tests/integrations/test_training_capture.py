"""Taking training state off the device (issue 9, item 21): on the CPU each tensor is copied
once, straight into host memory, on the caller's thread; the saver never reads live tensors;
restored optimizer state lands where the optimizer keeps it. CUDA variants run where a GPU is;
the GPU path under the strict CUDA stand-in is tests/integrations/test_training_device.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvj
from kvj.integrations.training import (StateJournal, capture, materialize, recover_training, restore_training_state,
                                       training_state)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(5, 8, generator=gen).to(next(model.parameters()).device)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


class _OpLog(TorchDispatchMode):
    """Every aten op run: its name, how many of ``watched``'s storages its inputs read (lists
    of tensors, as ``cat`` takes, included) and its destination (``out=``, else its first
    tensor argument)."""

    def __init__(self, watched):
        super().__init__()
        self.watched = {t.untyped_storage().data_ptr() for t in watched}
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [x for a in list(args) + list(kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else [a])]
        reads = sum(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.watched for a in flat)
        out = func(*args, **kwargs)
        dest = kwargs.get("out", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        self.ops.append((func.overloadpacket.__name__, reads, dest))
        return out


def test_capture_copies_each_tensor_once_into_host_memory_without_a_device_concatenation():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        _step(model, opt, i)
    params = list(model.parameters())
    live = params + [opt.state[p][n] for p in params for n in ("exp_avg", "exp_avg_sq")]
    with _OpLog(live) as log:
        snap = capture(training_state(model, opt, step=2, rng=False))
    reading = [(name, reads, dest) for name, reads, dest in log.ops if reads]
    allocating = {name for name, _, _ in reading} - {"copy_", "cat", "stack", "detach", "view", "_reshape_alias",
                                                     "alias", "unsqueeze"}
    assert not allocating, f"ops that made copies of the state outside the host streams: {allocating}"
    copies = [(reads, dest) for name, reads, dest in reading if name in ("copy_", "cat", "stack")]
    assert sum(reads for reads, _ in copies) == len(live)  # each tensor read by one copy
    streams = {t.untyped_storage().data_ptr() for t in snap.streams.values()}
    assert all(d.untyped_storage().data_ptr() in streams for _, d in copies)  # straight into a host stream
    back = materialize(snap.doc, snap.streams)
    for (name, p), i in zip(model.named_parameters(), range(len(params))):
        assert torch.equal(back["model"][name], p.detach())
        assert torch.equal(back["optimizer"]["state"][i]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_save_takes_its_copy_before_returning_so_the_next_step_cannot_change_it(tmp_path):
    """The saver thread is held until after the caller has updated the tensors in place;
    the journal must still hold the values they had at ``save``."""
    live = {"w": torch.arange(64, dtype=torch.float32), "m": {"a": torch.ones(8, dtype=torch.bfloat16)}}
    expected = {"w": live["w"].clone(), "m": {"a": live["m"]["a"].clone()}}
    gate = threading.Event()
    with kvj.Journal.open(tmp_path / "j") as journal:
        put = journal.store.put

        def held_put(*args, **kwargs):
            assert gate.wait(60)
            return put(*args, **kwargs)

        journal.store.put = held_put
        with StateJournal(journal, full_every=4, model="m") as saver:
            fut = saver.save(0, live)
            live["w"].mul_(-3.0)  # what the next optimizer step does to the live state
            live["m"]["a"].add_(1)
            gate.set()
            fut.result()
        journal.sync()
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
    assert torch.equal(rec.state["w"], expected["w"]) and torch.equal(rec.state["m"]["a"], expected["m"]["a"])


def test_durable_step_is_where_a_crash_now_would_resume(tmp_path):
    gate = threading.Event()
    with kvj.Journal.open(tmp_path / "j") as journal:
        put = journal.store.put

        def held_put(*args, **kwargs):
            assert gate.wait(60)
            return put(*args, **kwargs)

        with StateJournal(journal, full_every=4, model="m") as saver:
            assert saver.durable_step is None
            saver.save(1, {"w": torch.ones(4)}).result()
            journal.sync()
            assert saver.durable_step == 1
            journal.store.put = held_put
            fut = saver.save(2, {"w": torch.full((4,), 2.0)})
            assert saver.durable_step == 1  # its segments are not stored yet, so no record either
            gate.set()
            fut.result()
            journal.sync()
            assert saver.durable_step == 2
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
        with StateJournal(journal, full_every=4, model="m", resume=rec) as resumed:
            assert resumed.durable_step == 2


def test_small_streams_travel_in_the_document_and_round_trip_through_deltas(tmp_path):
    """A stream of at most INLINE_BYTES (step counters, RNG states) costs no segment (no file,
    no fsync) of its own: the save's document carries it, whole, in checkpoints and deltas."""
    from kvj.integrations.training import INLINE_BYTES, STREAM_PREFIX, TREE

    big = torch.randn(INLINE_BYTES // 4 + 1)
    states = [{"w": big + i, "m": torch.full((7,), float(i), dtype=torch.bfloat16), "n": torch.tensor(i)}
              for i in range(3)]
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=8, model="m") as saver:
            for i, state in enumerate(states):
                saver.save(i, state).result()
        replayed = kvj.replay(str(tmp_path / "j"))
        records = [replayed.checkpoint] + list(replayed.deltas)
        assert [r["step"] for r in records] == [0, 1, 2]
        assert all(set(r["keys"]) == {TREE, STREAM_PREFIX + "w.float32"} for r in records)
        rec = recover_training(replayed, journal.store)
    assert rec.step == 2 and rec.base_step == 0
    for name, want in states[2].items():
        assert rec.state[name].dtype == want.dtype and torch.equal(rec.state[name], want), name


def test_whether_a_streams_xor_pays_is_learnt_from_stored_sizes_at_the_1st_2nd_4th_8th_delta(tmp_path):
    """No trial compressions: the 1st, 2nd, 4th and 8th delta on a base store the XOR and
    compare its stored size with the stream's whole one; deltas between repeat the choice.
    A drifting stream's XOR pays (kept at every delta); a stream of fresh coin flips (0.0 or
    1.0, compressible whole, noise when XORed with its random base) is stored whole between
    the trials. Every delta round-trips."""
    gen = torch.Generator().manual_seed(1)
    w, c = torch.randn(40000, generator=gen), torch.randn(40001, generator=gen)
    # The base's "c" is random: XORed with it, a coin flip stream is noise.
    states = [{"w": w + i * 1e-6, "c": c if i == 0 else torch.randint(0, 2, (40001,), generator=gen).float()}
              for i in range(10)]
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=100, model="m") as saver:
            for step, state in enumerate(states):
                saver.save(step, state).result()
        replayed = kvj.replay(str(tmp_path / "j"))
        whole = {d["step"]: d["meta"]["whole"] for d in replayed.deltas}
        assert whole == {s: ["c.float32"] if s in (3, 5, 6, 7, 9) else [] for s in range(1, 10)}
        rec = recover_training(replayed, journal.store)
    assert rec.step == 9 and all(torch.equal(rec.state[k], states[9][k]) for k in "wc")


def _adamw_variants(device: str):
    out = [dict(foreach=False), dict(foreach=True), dict(fused=True)]
    if device == "cuda":
        out.append(dict(capturable=True))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_restored_adamw_state_sits_where_the_optimizer_keeps_it_and_continues_bit_identical(device):
    for variant in _adamw_variants(device):
        model = _model(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **variant)
        for i in range(3):
            _step(model, opt, i)
        snap = capture(training_state(model, opt, step=3))
        snap.wait()
        model2 = _model(device)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, **variant)
        assert restore_training_state(materialize(snap.doc, snap.streams), model2, opt2) == 3
        for p, p2 in zip(model.parameters(), model2.parameters()):
            for name, value in opt.state[p].items():
                restored = opt2.state[p2][name]
                assert (restored.device, restored.dtype) == (value.device, value.dtype), (variant, name)
                assert torch.equal(restored, value), (variant, name)
        for i in range(3, 5):
            _step(model, opt, i)
            _step(model2, opt2, i)
        for p, p2 in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, p2), variant
