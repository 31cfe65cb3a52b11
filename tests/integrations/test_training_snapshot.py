"""Taking training state off the device (issue 9, item 21; issue 22 section 2): on the CPU each
tensor is copied once, straight into host memory; on a GPU (the CPU stand-in of
tests/support/fakecuda.py) each stream is gathered into one device buffer and leaves with one
device-to-host copy into pinned buffers kept for the run, the host never waits for the GPU,
and only the optimizer's next step waits for the gather; the saver never reads live tensors;
restored optimizer state (fused and capturable AdamW included) lands where the optimizer keeps
it and continues bit-identically. CUDA variants run where a GPU is."""

from __future__ import annotations

import threading

import pytest
import torch
from support.fakecuda_legacy import POISON, FakeCuda
from torch.utils._python_dispatch import TorchDispatchMode

import kvj
from kvj.segments import device
from kvj.integrations.training import (StateBuffers, StateJournal, capture, materialize, recover_training,
                                       restore_training_state, training_state)

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


@pytest.fixture
def fake(monkeypatch):
    f = FakeCuda(devices=1)
    monkeypatch.setattr(device, "CUDA", f)
    return f


def _on_fake_device(fake, variant=None, steps: int = 2):
    """The test model and an AdamW (``variant``) after ``steps`` steps, every tensor of their
    state on the stand-in's cuda:0."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **(variant or {}))
    for i in range(steps):
        _step(model, opt, i)
    for t in list(model.parameters()) + [v for p in model.parameters() for v in opt.state[p].values()]:
        fake.adopt(t, 0)
    return model, opt


class _GpuWaits:
    """Records each ``gpu_wait`` (stream, event) and whether the parameters still held
    ``before``'s values at that moment."""

    def __init__(self, fake, model):
        self.calls = []
        real = fake.gpu_wait

        def spy(stream, event):
            unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), self.before))
            self.calls.append((stream, event, unchanged))
            real(stream, event)

        self.before = [p.detach().clone() for p in model.parameters()]
        fake.gpu_wait = spy


def test_device_state_leaves_in_one_copy_per_stream_and_is_read_only_after_it_lands(fake, tmp_path):
    """Each stream's device tensors are gathered into one device buffer and leave in one
    device-to-host copy into pinned memory (not one copy per tensor); the destination holds
    the stand-in's poison until the host waits on an event recorded after the copies; the
    saver stores the streams only after that, with the values they had at save."""
    model, opt = _on_fake_device(fake)
    params = list(model.parameters())
    live = params + [v for p in params for v in opt.state[p].values()]
    want_params = [p.detach().clone() for p in params]
    want_opt = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]

    snap = capture(training_state(model, opt, step=2, rng=False))
    assert set(snap.streams) == {"model.float32", "optimizer.step.float32", "optimizer.exp_avg.float32",
                                 "optimizer.exp_avg_sq.float32"}
    assert len(live) == 16 and len(fake.copies) == len(snap.streams)
    assert all(c.kind == "d2h" and fake.is_pinned(c.host) for c in fake.copies)
    assert all(bool((s.view(torch.uint8) == POISON).all()) for s in snap.streams.values())  # still in flight
    snap.wait()
    assert not any(fake.in_flight(c.host) for c in fake.copies)
    back = materialize(snap.doc, snap.streams)
    assert all(torch.equal(back["model"][n], w) for n, w in zip(dict(model.named_parameters()), want_params))

    fake.copies.clear()
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m") as saver:
            fut = saver.save(2, training_state(model, opt, step=2, rng=False))
            with torch.no_grad():
                for t in live:
                    t.add_(1)  # the next step, which the GPU runs after the gather
            fut.result()
        journal.sync()
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
    assert len(fake.copies) == 4 and not fake.violations
    assert fake.stream_waits == 0  # the host waited on the copies' events, never on a stream
    for name, want in zip(dict(model.named_parameters()), want_params):
        assert torch.equal(rec.state["model"][name], want), name
    for i, want in enumerate(want_opt):
        for k, v in want.items():
            assert torch.equal(rec.state["optimizer"]["state"][i][k], v), (i, k)


def test_buffers_are_allocated_once_for_the_run_not_per_save(fake, tmp_path, monkeypatch):
    """Twelve saves of a device state take turns in max_pending pinned host buffers and one
    device gather buffer, allocated at the first saves; before, every save pinned a fresh
    buffer per stream (torch's host cache never gives pinned memory back)."""
    model, opt = _on_fake_device(fake)
    device_allocs = []
    real_empty = fake.empty
    monkeypatch.setattr(fake, "empty", lambda *a, **k: device_allocs.append(a) or real_empty(*a, **k))
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m", optimizer=opt, max_pending=2) as saver:
            for step in range(3, 15):
                _step(model, opt, step)
                saver.save(step, training_state(model, opt, step=step, rng=False))
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
    state_bytes = sum(t.numel() * t.element_size() for t in rec.base.streams.values())
    assert fake.pinned_allocs <= 2, fake.pinned_allocs
    assert len(device_allocs) == 1 and device_allocs[0][0][0] >= state_bytes
    assert rec.step == 14 and all(torch.equal(rec.state["model"][n], p) for n, p in model.named_parameters())


def test_only_the_next_optimizer_step_waits_for_the_gather_and_not_for_the_copy(fake, tmp_path):
    """With an optimizer, a save makes no stream wait; the optimizer's next step (its
    pre-hook, before it changes any parameter) makes the caller's stream wait on the GPU for
    the gather, recorded before the device-to-host copies, which nothing on the caller's
    stream waits for. Without one, the caller's stream waits for the gather at once."""
    model, opt = _on_fake_device(fake)
    waits = _GpuWaits(fake, model)
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m", optimizer=opt) as saver:
            copies_before = len(fake.copies)
            saver.save(2, training_state(model, opt, step=2, rng=False)).result()
            assert waits.calls == []  # the forward and backward after a save run beside the copy
            gathered_upto = copies_before  # the gather's event is recorded before this save's copies
            _step(model, opt, 2)
            assert len(waits.calls) == 1
            stream, event, unchanged = waits.calls[0]
            assert stream is fake.current_stream(torch.device("cuda", 0)) and unchanged
            assert event.stream.name == "d2h" and event.upto == gathered_upto < len(fake.copies)
            _step(model, opt, 3)  # no save since: nothing to wait for
            assert len(waits.calls) == 1
        waits.calls.clear()
        with StateJournal(journal, full_every=4, model="m") as saver:
            saver.save(4, training_state(model, opt, step=4, rng=False)).result()
            assert len(waits.calls) == 1 and waits.calls[0][0] is fake.current_stream(torch.device("cuda", 0))
    assert not opt._optimizer_step_pre_hooks  # close() removed the hook


def test_taking_the_state_never_waits_for_the_gpu(fake, tmp_path):
    """No host synchronisation in a save: GradScaler.state_dict() reads its scale and growth
    tracker with .item() (a wait for the GPU every step); kvj journals clones of the
    tensors instead, and the resumed scaler gets their values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "item"):
                self.count += 1
            return func(*args, **(kwargs or {}))

    model, opt = _on_fake_device(fake)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    for i in range(5):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 8)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
    fake.adopt(scaler._scale, 0), fake.adopt(scaler._growth_tracker, 0)
    want = scaler.state_dict()
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m", optimizer=opt) as saver:
            with Syncs() as syncs:
                saver.save(5, training_state(model, opt, step=5, scaler=scaler, rng=False))
            saver.close()
        assert syncs.count == 0
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
    resumed = torch.amp.GradScaler("cpu")
    model2 = _model()
    restore_training_state(rec.state, model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), scaler=resumed)
    assert resumed.state_dict() == want and want["_growth_tracker"] == 2


def test_a_stream_of_cpu_and_device_tensors_and_a_changing_layout_round_trip(fake, tmp_path):
    """Members of one stream on the CPU and on the device (the CPU part is copied on the
    host, the device part gathered and downloaded) land where the document says; a save
    whose layout grows gets larger buffers, and every save round-trips."""
    gen = torch.Generator().manual_seed(5)
    states = [{"w": [torch.randn(3, 4, generator=gen), fake.adopt(torch.randn(5, generator=gen), 0),
                     torch.randn(7, generator=gen), fake.adopt(torch.randn(2, 2, generator=gen), 0)],
               "n": fake.adopt(torch.tensor(float(i)), 0)} for i in range(2)]
    states.append({**states[1], "extra": fake.adopt(torch.randn(20000, generator=gen), 0)})
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=8, model="m") as saver:
            for step, state in enumerate(states):
                saver.save(step, state).result()
                rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
                assert rec.step == step
                assert all(torch.equal(a, b) for a, b in zip(rec.state["w"], state["w"]))
                assert torch.equal(rec.state["n"], state["n"])
                if "extra" in state:
                    assert torch.equal(rec.state["extra"], state["extra"])


def test_a_failed_wait_drops_the_buffer_and_fails_every_later_save(fake, tmp_path):
    """If waiting for a save's copy fails, a copy may still write into its host buffer: that
    buffer is never handed to another capture; the save fails, and so does every later one
    and close() (before, a failed save was forgotten once a later one was queued, and close()
    returned as if all were durable)."""
    model, opt = _on_fake_device(fake)
    buffers = StateBuffers(2)
    snap = buffers.capture(training_state(model, opt, step=2, rng=False))
    fake.fail_next = "wait"
    with pytest.raises(RuntimeError, match="injected"):
        snap.wait()
    snap.release(landed=False)
    buffers.capture(training_state(model, opt, step=2, rng=False))
    assert fake.pinned_allocs == 2  # the first buffer was not reused
    with kvj.Journal.open(tmp_path / "j") as journal:
        saver = StateJournal(journal, full_every=4, model="m", optimizer=opt)
        saver.save(2, training_state(model, opt, step=2, rng=False)).result()
        fake.fail_next = "wait"
        with pytest.raises(RuntimeError, match="injected"):
            saver.save(3, training_state(model, opt, step=3, rng=False)).result()
        with pytest.raises(RuntimeError, match="injected"):
            saver.save(4, training_state(model, opt, step=4, rng=False))
        with pytest.raises(RuntimeError, match="injected"):
            saver.close()
        assert recover_training(kvj.replay(str(tmp_path / "j")), journal.store).step == 2


@pytest.mark.parametrize("variant", [dict(fused=True), dict(foreach=True)], ids=["fused", "foreach"])
def test_device_adamw_saved_recovered_onto_the_device_and_continued_is_bit_identical(fake, tmp_path, variant):
    """AdamW on the stand-in's device, journaled through the device path (fulls and deltas),
    recovered onto the device and continued: bit-identical to the run that never stopped.
    (Capturable AdamW needs a real CUDA device: the restore test below runs it there.)"""
    model, opt = _on_fake_device(fake, variant)
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=3, model="m", optimizer=opt) as saver:
            for step in range(3, 8):
                _step(model, opt, step)
                saver.save(step, training_state(model, opt, step=step))
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store, device="cuda:0")
    assert rec.step == 7 and rec.base_step == 6
    assert all(fake.is_device_tensor(t) for t in rec.state["model"].values())
    assert all(t.device.type == "cpu" and not fake.is_device_tensor(t) for t in rec.base.streams.values())
    model2 = _model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, **variant)
    assert restore_training_state(rec.state, model2, opt2) == 7
    for i in range(8, 11):
        _step(model, opt, i)
        _step(model2, opt2, i)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[p2][k], v), k


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
