"""The training capture's GPU path (issue 22, section 2) under the strict CUDA stand-in
(tests/support/fakecuda.py: ops run late on their stream, a download's pinned destination
holds poison until the host waits, a stream touching memory another stream uses without a
wait between them raises ``Hazard``, host synchronizations are counted).

What it shows: each stream of the state leaves in one device-to-host copy (not one per
tensor), through buffers allocated once for the run; a save never makes the host wait for
the GPU (no ``GradScaler.state_dict()`` and its ``.item()``); with an optimizer only its next
step waits for the gather (a step pre-hook), never for the copy; without one the caller's
stream waits for the gather at once; fused, capturable and foreach AdamW state saved from the
device, recovered onto it and continued is bit-identical; recovery puts on the device what was
there (the RNG states stay on the CPU); a failed wait drops its buffer.

The stand-in runs no autograd on its tensors, so the steps here take gradients made by hand;
it runs fused AdamW's kernel at once (it has no meta kernel), which synchronizes the host, so
the tests that show a wait is needed use capturable AdamW. tests/support/mutants.py lists every
wait and event of the training capture; tests/segments/test_mutations.py deletes each in turn
and shows one of these tests fails. (The capture makes no ``record_stream`` call: its gather
buffer is allocated on the side stream that alone uses it, and a capture keeps the tensors its
gather reads referenced until its copies are done.)
"""

from __future__ import annotations

import pytest
import torch
from support.fakecuda import POISON, Hazard, gpu  # noqa: F401 (gpu: the fixture)

import kvj
from kvj.integrations.training import (StateBuffers, StateJournal, capture, materialize, recover_training,
                                       restore_training_state, training_state)
from kvj.segments import device

CUDA0 = torch.device("cuda", 0)


class Net(torch.nn.Module):
    """Parameters of three shapes on the device, and a frozen one."""

    def __init__(self, where: str = "cuda"):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 8, generator=gen).to(where))
        self.v = torch.nn.Parameter(torch.randn(8, 16, generator=gen).to(where))
        self.b = torch.nn.Parameter(torch.randn(16, generator=gen).to(where))
        self.frozen = torch.nn.Parameter(torch.randn(4, generator=gen).to(where), requires_grad=False)


def _opt(net: Net, **variant) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2, **variant)


def _step(net: Net, opt: torch.optim.Optimizer, i: int) -> None:
    """One optimizer step on gradients that are a function of ``i`` (uploaded, as a backward's)."""
    gen = torch.Generator().manual_seed(100 + i)
    for p in net.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def _poisoned(t: torch.Tensor) -> bool:
    return bool((t.view(torch.uint8) == POISON).all())


def test_each_stream_leaves_in_one_copy_and_is_read_only_after_it_lands(gpu, tmp_path):
    net = Net()
    opt = _opt(net, capturable=True, foreach=False)
    for i in range(2):
        _step(net, opt, i)
    live = [p for p in net.parameters() if p.requires_grad]
    gpu.copies.clear()
    syncs = sum(gpu.syncs.values())
    snap = capture(training_state(net, opt, step=2, rng=False))  # right after the step's kernels
    assert sum(gpu.syncs.values()) == syncs  # the host did not wait for the GPU
    want = {n: _host(p) for n, p in net.named_parameters() if p.requires_grad}
    want_opt = [{k: _host(v) for k, v in opt.state[p].items()} for p in live]
    assert set(snap.streams) == {"model.float32", "optimizer.step.float32", "optimizer.exp_avg.float32",
                                 "optimizer.exp_avg_sq.float32"}
    # 12 tensors, 4 copies: one per stream, each late (asynchronous) into pinned memory.
    assert [(c.kind, c.asynchronous, c.host.is_pinned()) for c in gpu.copies[:4]] == [("d2h", True, True)] * 4
    assert all(c.kind == "d2h" and not c.asynchronous for c in gpu.copies[4:])  # the test's own reads
    assert all(_poisoned(s) for s in snap.streams.values())
    snap.wait()
    back = materialize(snap.doc, snap.streams)
    assert all(torch.equal(back["model"][n], w) for n, w in want.items())
    assert all(torch.equal(back["optimizer"]["state"][i][k], v) for i, s in enumerate(want_opt) for k, v in s.items())

    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m") as saver:
            fut = saver.save(2, training_state(net, opt, step=2, rng=False))
            for p in live:
                p.data.add_(1.0)  # the caller's stream changes the state at once: it waited for the gather
            fut.result()
        journal.sync()
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
    assert all(torch.equal(rec.state["model"][n], w) for n, w in want.items())


def test_buffers_are_allocated_once_for_the_run_not_per_save(gpu, tmp_path, monkeypatch):
    """Twelve saves take turns in max_pending pinned host buffers and one device gather
    buffer; before, every save pinned a fresh buffer per stream."""
    net = Net()
    opt = _opt(net, capturable=True, foreach=False)
    _step(net, opt, 0)
    made = []
    real_empty = device.CUDA.empty
    monkeypatch.setattr(device.CUDA, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    pinned = gpu.pinned_allocs
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m", optimizer=opt, max_pending=2) as saver:
            for step in range(1, 13):
                _step(net, opt, step)
                saver.save(step, training_state(net, opt, step=step, rng=False))
        assert gpu.pinned_allocs - pinned <= 2
        assert len(made) == 1
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
    state_bytes = sum(t.numel() * t.element_size() for t in rec.base.streams.values())
    assert made[0][0][0] >= state_bytes and made[0][2] == CUDA0
    assert rec.step == 12 and all(torch.equal(rec.state["model"][n], _host(p)) for n, p in net.named_parameters()
                                  if p.requires_grad)


def test_only_the_next_optimizer_step_waits_for_the_gather_and_never_for_the_copy(gpu, tmp_path, monkeypatch):
    """With an optimizer, the caller's stream is not made to wait at the save: reading the
    parameters (a forward) runs beside the gather, and changing one outside the optimizer
    would race it (the stand-in raises). The optimizer's next step waits, on the GPU, for the
    gather (recorded before the copies), not for the copies. Without an optimizer, the
    caller's stream waits for the gather at once."""
    net = Net()
    opt = _opt(net, capturable=True, foreach=False)
    _step(net, opt, 0)
    events, waits = [], []
    real_record, real_gpu_wait = device.CUDA.record, device.CUDA.gpu_wait
    monkeypatch.setattr(device.CUDA, "record", lambda stream: events.append(real_record(stream)) or events[-1])
    monkeypatch.setattr(device.CUDA, "gpu_wait", lambda stream, ev: waits.append((stream, ev)) or real_gpu_wait(stream, ev))
    current = torch.cuda.current_stream(CUDA0)
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m", optimizer=opt) as saver:
            fut = saver.save(1, training_state(net, opt, step=1, rng=False))
            gathered, landed = events[-2:]
            assert waits == [] and not gpu.waited(current, gathered)
            (net.w * 2).sum()  # the next forward reads the parameters beside the gather
            with pytest.raises(Hazard):
                net.b.data.mul_(2)  # only the optimizer's step is ordered after the gather
            gpu.violations.clear()
            _step(net, opt, 1)  # its pre-hook waits; then it updates every parameter in place
            assert waits == [(current, gathered)] and gpu.waited(current, gathered)
            assert not gpu.waited(current, landed)  # the compute stream never waits for the copy
            fut.result()
            _step(net, opt, 2)  # no save since: nothing more to wait for
            assert len(waits) == 1
        assert not opt._optimizer_step_pre_hooks  # close() removed it
        waits.clear()
        with StateJournal(journal, full_every=4, model="m") as saver:
            saver.save(3, training_state(net, opt, step=3, rng=False)).result()
            assert waits == [(current, events[-2])]
            net.b.data.mul_(2)  # ordered after the gather: no race


def test_a_save_never_waits_for_the_gpu_and_the_scalers_state_is_read_before_it_changes(gpu, tmp_path):
    """GradScaler.state_dict() reads the scale and growth tracker with .item(), a host
    synchronization per save; kvj journals the tensors, gathered before the caller's stream
    goes on, so the scaler's next update (which a skipped step does without the optimizer's
    step) cannot race the gather. The resumed scaler gets the values."""
    net = Net()
    opt = _opt(net, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 8, growth_interval=3)
    scaler.scale(torch.ones((), device="cuda"))  # makes the scale tensor, as scaling a loss does
    for i in range(5):
        gen = torch.Generator().manual_seed(i)
        for p in opt.param_groups[0]["params"]:
            p.grad = (torch.randn(p.shape, generator=gen) * scaler.get_scale()).to("cuda")
        scaler.step(opt)  # fused AdamW unscales and skips on the GPU: no host sync in the step either
        scaler.update()
    want = scaler.state_dict()
    buffers = StateBuffers(2, opt)
    syncs = sum(gpu.syncs.values())
    snap = buffers.capture(training_state(net, opt, step=5, scaler=scaler, rng=False))  # what save() does here
    assert sum(gpu.syncs.values()) == syncs, gpu.syncs
    scaler._scale.mul_(0.5)  # an update after a skipped step: ordered after the gather
    snap.wait()
    buffers.close()
    assert materialize(snap.doc, snap.streams)["scaler"]["scale"].item() == want["scale"]
    scaler._scale.mul_(2.0)
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=4, model="m", optimizer=opt) as saver:
            saver.save(5, training_state(net, opt, step=5, scaler=scaler, rng=False)).result()
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store)
    resumed = torch.amp.GradScaler("cuda")
    net2 = Net()
    restore_training_state(rec.state, net2, _opt(net2, fused=True), scaler=resumed)
    assert resumed.state_dict() == want and want["_growth_tracker"] == 2 and want["scale"] == 2.0 ** 9


@pytest.mark.parametrize("variant", [dict(fused=True), dict(capturable=True), dict(foreach=False)],
                         ids=["fused", "capturable", "single-tensor"])
def test_device_adamw_recovered_onto_the_device_continues_bit_identical(gpu, tmp_path, variant):
    """AdamW on the device, journaled through the device path (a full save and deltas),
    recovered onto the device and continued: bit-identical to the run that never stopped.
    What was on the device comes back there (fused and capturable keep ``step`` there too);
    the RNG states stay on the CPU, where torch takes them; the base stays on the CPU."""
    net = Net()
    opt = _opt(net, **variant)
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=3, model="m", optimizer=opt) as saver:
            for step in range(1, 6):
                _step(net, opt, step)
                saver.save(step, training_state(net, opt, step=step))
        rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store, device="cuda:0")
    assert rec.step == 5 and rec.base_step == 3
    assert all(t.device == CUDA0 for t in rec.state["model"].values())
    steps = [s["step"] for s in rec.state["optimizer"]["state"].values()]
    assert all(t.device == (CUDA0 if variant.get("fused") or variant.get("capturable") else torch.device("cpu"))
               for t in steps)
    assert rec.state["rng"]["torch"].device.type == "cpu" and all(t.device.type == "cpu"
                                                                 for t in rec.base.streams.values())
    net2 = Net()
    opt2 = _opt(net2, **variant)
    assert restore_training_state(rec.state, net2, opt2) == 5
    for i in range(6, 9):
        _step(net, opt, i)
        _step(net2, opt2, i)
    for (name, p), p2 in zip(net.named_parameters(), net2.parameters()):
        assert torch.equal(_host(p), _host(p2)), name
        for k, v in opt.state.get(p, {}).items():
            assert opt2.state[p2][k].device == v.device and torch.equal(_host(opt2.state[p2][k]), _host(v)), k


def test_a_stream_of_cpu_and_device_tensors_and_a_growing_layout_round_trip(gpu, tmp_path):
    """Members of one stream on the CPU and on the device land where the document says (the
    CPU part copied on the host, the device part gathered and downloaded); a state that grows
    gets larger buffers; recovered onto the device, each leaf is where it was."""
    gen = torch.Generator().manual_seed(5)
    states = [{"w": [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen).to("cuda"),
                     torch.randn(7, generator=gen), torch.randn(2, 2, generator=gen).to("cuda")],
               "n": torch.tensor(float(i)).to("cuda")} for i in range(2)]
    states.append({**states[1], "extra": torch.randn(20000, generator=gen).to("cuda")})
    with kvj.Journal.open(tmp_path / "j") as journal:
        with StateJournal(journal, full_every=8, model="m") as saver:
            for step, state in enumerate(states):
                saver.save(step, state).result()
                rec = recover_training(kvj.replay(str(tmp_path / "j")), journal.store, device="cuda")
                assert rec.step == step
                for got, sent in zip(rec.state["w"], state["w"]):
                    assert got.device == sent.device and torch.equal(_host(got), _host(sent))
                assert torch.equal(_host(rec.state["n"]), _host(state["n"]))
                if "extra" in state:
                    assert torch.equal(_host(rec.state["extra"]), _host(state["extra"]))


def test_a_failed_wait_drops_the_buffer_and_fails_every_later_save(gpu, tmp_path):
    """If waiting for a save's copy fails, a copy may still write into its host buffer: that
    buffer is never handed to another capture; the save fails, and so do every later save and
    close() (before, a failed save was forgotten once a later one was queued)."""
    net = Net()
    opt = _opt(net, fused=True)
    _step(net, opt, 0)
    buffers = StateBuffers(2)
    snap = buffers.capture(training_state(net, opt, step=1, rng=False))
    gpu.fail_next = "synchronize"
    with pytest.raises(RuntimeError, match="injected"):
        snap.wait()
    snap.release(landed=False)
    pinned = gpu.pinned_allocs
    buffers.capture(training_state(net, opt, step=1, rng=False)).wait()
    assert gpu.pinned_allocs == pinned + 1  # the dropped buffer was not reused
    with kvj.Journal.open(tmp_path / "j") as journal:
        saver = StateJournal(journal, full_every=4, model="m", optimizer=opt)
        saver.save(1, training_state(net, opt, step=1, rng=False)).result()
        gpu.fail_next = "synchronize"
        with pytest.raises(RuntimeError, match="injected"):
            saver.save(2, training_state(net, opt, step=2, rng=False)).result()
        with pytest.raises(RuntimeError, match="injected"):
            saver.save(3, training_state(net, opt, step=3, rng=False))
        with pytest.raises(RuntimeError, match="injected"):
            saver.close()
        assert recover_training(kvj.replay(str(tmp_path / "j")), journal.store).step == 1

