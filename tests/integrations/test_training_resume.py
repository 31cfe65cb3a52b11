"""Resuming into a model or optimizer the journaled state does not fit (issue 26, item 4):
every mismatch (shape, dtype, missing or extra parameter, optimizer state made for parameters
of other sizes) is a FormatError naming the parameter and both shapes, raised before anything
is copied; optimizer settings that differ from the journaled ones are named in one warning.

Before, ``load_trainable`` copied with ``p.copy_`` (a smaller tensor, or a scalar, broadcast
into the parameter without a word) and ``optimizer.load_state_dict`` checks only counts: after
a LoRA rank change, fused AdamW (Hugging Face Trainer's default optimizer on torch 2.8+) then
ran on moments of the old size and wrote past their end (heap corruption)."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvj.errors import FormatError
from kvj.integrations.training import (ResumeMismatch, capture, load_trainable, materialize, restore_training_state,
                                       training_state)


class Lora(torch.nn.Module):
    """A frozen base and a rank-``r`` adapter, as PEFT's LoRA makes them."""

    def __init__(self, r: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(64, 64).requires_grad_(False)
        self.lora_A = torch.nn.Linear(64, r, bias=False).to(dtype)
        self.lora_B = torch.nn.Linear(r, 64, bias=False).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))).float()


def _trained(r: int, **adamw):
    model = Lora(r)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, **adamw)
    for i in range(2):
        opt.zero_grad()
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        opt.step()
    return model, opt


def _journaled(model, opt, step: int = 2):
    """The state as recovery gives it back: through a capture and its document."""
    snap = capture(training_state(model, opt, step=step, rng=False))
    snap.wait()
    return materialize(snap.doc, snap.streams)


def _untouched(model, opt):
    """A check that nothing was copied into ``model`` or ``opt`` since this call."""
    params = [p.detach().clone() for p in model.parameters()]
    groups = [dict(g, params=None) for g in opt.param_groups]

    def check():
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters())), "a parameter was overwritten"
        assert not opt.state and [dict(g, params=None) for g in opt.param_groups] == groups, "optimizer state loaded"
    return check


@pytest.mark.parametrize("saved, shape", [(torch.arange(64.0).reshape(1, 64), "(1, 64)"),
                                          (torch.tensor(3.0), "()"),
                                          (torch.zeros(8, 64), "(8, 64)"),
                                          (torch.zeros(4, 64, dtype=torch.bfloat16), "(4, 64) bfloat16")],
                         ids=["broadcast-row", "scalar", "larger", "dtype"])
def test_load_trainable_refuses_a_tensor_of_another_shape_or_dtype_naming_both(saved, shape):
    model = torch.nn.Linear(64, 4, bias=False)
    before = model.weight.detach().clone()
    with pytest.raises(FormatError, match=rf"weight is journaled as {shape.replace('(', '[(]').replace(')', '[)]')}"
                                          r".*the model's is \(4, 64\) float32"):
        load_trainable(model, {"weight": saved})
    assert torch.equal(model.weight, before)


def test_load_trainable_names_missing_and_extra_parameters_and_copies_nothing():
    model = torch.nn.Linear(64, 4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FormatError, match=r"bias is missing.*lora_A.weight is journaled but is not a trainable"):
        load_trainable(model, {"weight": torch.zeros(4, 64), "lora_A.weight": torch.zeros(1, 64)})
    with pytest.raises(FormatError, match="bias is journaled as a list"):
        load_trainable(model, {"weight": torch.zeros(4, 64), "bias": [0.0] * 4})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("adamw", [dict(fused=True), dict(foreach=False)], ids=["fused", "single-tensor"])
def test_a_lora_rank_change_is_refused_before_anything_is_copied(adamw):
    """Journaled at r=1, resumed at r=4: both adapter matrices are named with both shapes,
    and neither the model nor the optimizer got anything."""
    state = _journaled(*_trained(1, **adamw))
    model, opt = Lora(4), None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, **adamw)
    untouched = _untouched(model, opt)
    with pytest.raises(FormatError) as err:
        restore_training_state(state, model, opt)
    assert "lora_A.weight is journaled as (1, 64) float32, the model's is (4, 64) float32" in str(err.value)
    assert "lora_B.weight is journaled as (64, 1) float32, the model's is (64, 4) float32" in str(err.value)
    untouched()


def test_optimizer_state_made_for_parameters_of_other_shapes_is_refused_naming_them():
    """The model fits but the optimizer lists its parameters in another order (a changed
    grouping): its journaled moments are for parameters of other shapes. torch's
    load_state_dict takes them (it checks counts only; fused AdamW would then write past
    their end): kvj refuses, naming the parameter, before anything is copied."""
    model, opt = _trained(1, fused=True)
    state = _journaled(model, opt)
    model2 = Lora(1)
    swapped = torch.optim.AdamW([model2.lora_B.weight, model2.lora_A.weight], lr=1e-2, fused=True)
    untouched = _untouched(model2, swapped)
    with pytest.raises(FormatError, match=r"lora_B.weight \(group 0\): the journaled state is for \(1, 64\), "
                                          r"the parameter is \(64, 1\) float32") as err:
        restore_training_state(state, model2, swapped)
    assert "lora_A.weight (group 0): the journaled state is for (64, 1)" in str(err.value)
    assert "nothing was copied" in str(err.value)
    untouched()

    model3 = Lora(2)
    grouped = torch.optim.AdamW([{"params": [model3.lora_A.weight]}, {"params": [model3.lora_B.weight]}], lr=1e-2)
    with pytest.raises(FormatError, match="1 parameter groups .*this optimizer 2"):
        restore_training_state({**state, "model": {n: p.detach() for n, p in model3.named_parameters()
                                                   if p.requires_grad}}, model3, grouped)
    with pytest.raises(FormatError, match="does not say which parameter shapes"):
        restore_training_state({k: v for k, v in state.items() if k != "optimizer_shapes"}, Lora(1),
                               torch.optim.AdamW([p for p in Lora(1).parameters() if p.requires_grad]))


def test_another_learning_rate_is_named_in_one_warning_and_the_journaled_one_kept():
    model, opt = _trained(1)
    state = _journaled(model, opt)
    same = Lora(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore_training_state(state, same, torch.optim.AdamW([p for p in same.parameters() if p.requires_grad],
                                                              lr=1e-2))
    assert [w for w in caught if issubclass(w.category, ResumeMismatch)] == []  # nothing differs: no warning

    model2 = Lora(1)
    opt2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.1)
    with pytest.warns(ResumeMismatch) as caught:
        restore_training_state(state, model2, opt2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "learning rate (lr, group 0): journaled 0.01, this run 0.005" in message
    assert "weight_decay (group 0): journaled 0.01, this run 0.1" in message
    assert opt2.param_groups[0]["lr"] == 1e-2  # the journaled value continues


def test_with_a_scheduler_the_initial_learning_rate_is_compared_not_the_scheduled_one():
    model, opt = _trained(1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    opt.step()  # with the last step's gradients
    sched.step()
    state = {**_journaled(model, opt), "scheduler": sched.state_dict()}
    model2 = Lora(1)
    opt2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LinearLR(opt2, start_factor=0.5, total_iters=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeMismatch)  # the schedule moved lr, the setting is the same
        restore_training_state(state, model2, opt2, scheduler=sched2)
    model3 = Lora(1)
    opt3 = torch.optim.AdamW([p for p in model3.parameters() if p.requires_grad], lr=3e-2)
    sched3 = torch.optim.lr_scheduler.LinearLR(opt3, start_factor=0.5, total_iters=4)
    with pytest.warns(ResumeMismatch, match=r"learning rate \(initial_lr, group 0\): journaled 0.01, this run 0.03"):
        restore_training_state(state, model3, opt3, scheduler=sched3)
