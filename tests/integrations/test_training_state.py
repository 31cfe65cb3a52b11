"""The state training needs, journaled and rebuilt: any torch.optim optimizer's whole
state_dict, LR scheduler, grad scaler, RNG streams, data position, mixed dtypes; only the
trainable parameters; fulls every K steps and deltas between. A run resumed from the journal
at any step continues bit for bit like one that never stopped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import kvj
from kvj.errors import FormatError
from kvj.integrations.training import (StateJournal, capture, recover_training, restore_training_state,
                                       trainable_state_dict, training_state)

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-amsgrad-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
}


class Net(torch.nn.Module):
    """A frozen "base" (float32), a trainable float32 head and a trainable bfloat16 adapter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(16, 16)
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(16, 4)
        self.adapter = torch.nn.Linear(16, 16, bias=False).to(torch.bfloat16)

    def forward(self, x):
        h = self.base(x) + self.adapter(x.to(torch.bfloat16)).float()
        h = torch.nn.functional.dropout(h, 0.2, training=True)  # draws from torch's RNG
        return self.head(h)


class Run:
    def __init__(self, opt: str):
        self.model = Net()
        self.opt = OPTIMIZERS[opt]([p for p in self.model.parameters() if p.requires_grad])
        warm = torch.optim.lr_scheduler.LinearLR(self.opt, start_factor=0.1, total_iters=3)
        self.sched = torch.optim.lr_scheduler.SequentialLR(
            self.opt, [warm, torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=10)], milestones=[3])
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        self.seen = 0

    def step(self) -> float:
        # The batch depends on Python's and NumPy's RNG, as a shuffling sampler's would.
        n = random.randint(2, 6) + int(np.random.randint(0, 3))
        x = torch.randn(n, 16)
        loss = self.model(x).square().mean()
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.seen += n
        return loss.item()

    def state(self, step: int):
        return training_state(self.model, self.opt, step=step, scheduler=self.sched, scaler=self.scaler,
                              data={"samples_seen": self.seen})

    def restore(self, state) -> int:
        step = restore_training_state(state, self.model, self.opt, scheduler=self.sched, scaler=self.scaler)
        self.seen = state["data"]["samples_seen"]
        return step


def _seed(s: int) -> None:
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def _fingerprint(run: Run):
    opt = run.opt.state_dict()
    return ([p.detach().clone() for p in run.model.parameters()],
            [(k, v.clone() if isinstance(v, torch.Tensor) else v) for s in opt["state"].values() for k, v in sorted(s.items())],
            run.sched.state_dict()["_last_lr"], run.scaler.state_dict(), run.seen)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_resumed_at_every_step_continues_bit_identical(tmp_path, opt):
    steps = 9
    _seed(1)
    ref = Run(opt)
    losses = [ref.step() for _ in range(steps)]
    expected = _fingerprint(ref)
    for stop in (1, 4, 5, 8):  # a full save (1, 4, 8) and a delta (5)
        _seed(1)
        run = Run(opt)
        path = tmp_path / f"{opt}-{stop}"
        with kvj.Journal.open(path) as journal, StateJournal(journal, full_every=4, model="net") as saver:
            for step in range(1, stop + 1):
                assert run.step() == losses[step - 1]
                saver.save(step, run.state(step))
        del run
        random.seed(99), np.random.seed(99), torch.manual_seed(99)  # a new process's RNG
        with kvj.Journal.open(path) as journal:
            rec = recover_training(kvj.replay(str(path)), journal.store)
            assert rec.step == stop and rec.base_step == (stop if stop in (1, 4, 8) else 4)
            resumed = Run(opt)
            assert resumed.restore(rec.state) == stop
            with StateJournal(journal, full_every=4, model="net", resume=rec) as saver:
                for step in range(stop + 1, steps + 1):
                    assert resumed.step() == losses[step - 1], f"loss of step {step} after resuming at {stop}"
                    saver.save(step, resumed.state(step))
        assert _same(_fingerprint(resumed), expected), f"resumed at {stop}"


def test_only_trainable_parameters_are_journaled(tmp_path):
    run = Run("adamw")
    run.step()
    names = set(trainable_state_dict(run.model))
    assert names == {"head.weight", "head.bias", "adapter.weight"}
    snap = capture(run.state(1))
    base = run.model.base.weight.detach().numpy().tobytes()
    assert all(base not in t.numpy().tobytes() for t in snap.streams.values() if t.numel() * t.element_size() >= len(base))
    assert set(snap.streams) >= {"model.float32", "model.bfloat16", "optimizer.exp_avg.float32",
                                 "optimizer.exp_avg.bfloat16"}
    assert snap.streams["model.float32"].numel() == 16 * 4 + 4


def test_an_unjournalable_value_is_refused_at_save(tmp_path):
    with kvj.Journal.open(tmp_path / "j") as journal, StateJournal(journal, 2, model="m") as saver:
        with pytest.raises(FormatError, match="object at data"):
            saver.save(1, {"data": object()})
