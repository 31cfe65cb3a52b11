"""What training state is (``training_state``), and the checks a resume makes before installing
it (``restore_training_state``): every part is compared with the live model and optimizer
before anything is copied."""

from __future__ import annotations

import random
import warnings
from itertools import chain
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from kvj.errors import FormatError


def trainable_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The parameters that train (``requires_grad``), by name: a PEFT model's adapter, never its
    frozen base weights."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> Dict[str, Any]:
    """Python's, NumPy's and torch's (CPU and every initialised CUDA device) RNG states."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": list(cuda)}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Install an ``rng_state()``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    # A copy: torch.set_rng_state crashes (SIGSEGV, torch 2.13) on a tensor at a storage
    # offset, which a view of a capture's stream is.
    torch.set_rng_state(state["torch"].clone())
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def optimizer_shapes(optimizer: torch.optim.Optimizer) -> List[List[List[int]]]:
    """The shapes of the parameters ``optimizer`` holds, per group ``[ranks, dims]``
    (kvj-segment(5) TRAINING STATE): journaled beside its state, so a resume can refuse state
    made for other shapes, which ``load_state_dict`` takes and a fused kernel overruns."""
    return [[[p.dim() for p in group["params"]], list(chain.from_iterable(p.shape for p in group["params"]))]
            for group in optimizer.param_groups]


def _journaled_shapes(record: Any) -> List[List[Tuple[int, ...]]]:
    """``optimizer_shapes``' record back as one shape per parameter, group by group."""
    if not isinstance(record, list):
        raise FormatError("the journaled optimizer state does not say which parameter shapes it was made for "
                          "(optimizer_shapes, as training_state journals it)")
    groups = []
    for entry in record:
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, list) for x in entry)
                and sum(entry[0]) == len(entry[1])):
            raise FormatError(f"bad optimizer_shapes entry in the journaled state: {entry!r:.80}")
        ranks, dims = entry
        at, shapes = 0, []
        for rank in ranks:
            shapes.append(tuple(dims[at:at + rank]))
            at += rank
        groups.append(shapes)
    return groups


def scaler_state(scaler: Any) -> Optional[Dict[str, Any]]:
    """``scaler.state_dict()`` without its ``.item()`` host synchronisation at every save: the
    scale and growth tracker as the scaler's own tensors (``load_scaler`` installs it)."""
    if scaler is None:
        return None
    if not scaler.is_enabled() or scaler._scale is None:  # disabled, or before its first scale(): no tensors
        return scaler.state_dict()
    return {"scale": scaler._scale, "growth_factor": scaler._growth_factor, "backoff_factor": scaler._backoff_factor,
            "growth_interval": scaler._growth_interval, "_growth_tracker": scaler._growth_tracker}


def load_scaler(scaler: Any, state: Mapping[str, Any]) -> None:
    """Install a ``scaler_state()`` (or a ``state_dict()``) into ``scaler``."""
    scaler.load_state_dict({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in state.items()})


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                   scheduler: Any = None, scaler: Any = None, data: Any = None, rng: bool = True) -> Dict[str, Any]:
    """What training needs to continue after ``step``, for ``StateJournal.save``: trainable
    parameters, the optimizer's state (and its parameters' shapes), scheduler, scaler, RNG
    states and ``data`` (the caller's data position). Nothing here waits for the GPU."""
    return {"step": step, "model": trainable_state_dict(model), "optimizer": optimizer.state_dict(),
            "optimizer_shapes": optimizer_shapes(optimizer),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler_state(scaler), "rng": rng_state() if rng else None, "data": data}


def restore_training_state(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           scheduler: Any = None, scaler: Any = None, rng: bool = True,
                           differences: Sequence[str] = ()) -> int:
    """Install a recovered ``training_state``; returns its step. A parameter or optimizer state
    that does not fit is a ``FormatError`` naming it, before anything is copied; settings that
    differ from the journaled ones (and ``differences``, the caller's) are named in one
    ``ResumeMismatch`` warning, and the journaled ones continue."""
    check_trainable(model, state.get("model"))
    check_optimizer_state(optimizer, state.get("optimizer"), state.get("optimizer_shapes"), model)
    changed = changed_settings(optimizer, state["optimizer"]) + list(differences)
    if changed:
        warnings.warn(f"resuming a run configured differently from the journaled one; the journaled values are "
                      f"kept: {'; '.join(changed)}", ResumeMismatch, stacklevel=2)
    _copy_trainable(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])  # each value lands where this optimizer keeps it
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        load_scaler(scaler, state["scaler"])
    if rng and state.get("rng") is not None:
        set_rng_state(state["rng"])
    return int(state["step"])


def load_trainable(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy saved trainable parameters into ``model``, all of them or, if one does not fit
    (``check_trainable``), none."""
    check_trainable(model, tensors)
    _copy_trainable(model, tensors)


def _copy_trainable(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in trainable_state_dict(model).items():
            p.copy_(tensors[name])


def _described(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _refuse(what: str, problems: List[str]) -> None:
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise FormatError(f"{what}: {'; '.join(problems[:8])}{more}")


def check_trainable(model: torch.nn.Module, tensors: Any) -> None:
    """``FormatError`` unless ``tensors`` holds exactly ``model``'s trainable parameters, each of
    its shape and dtype (``copy_`` would broadcast or convert without a word)."""
    if not isinstance(tensors, Mapping):
        raise FormatError(f"the journaled trainable parameters are a {type(tensors).__name__}, not a mapping")
    params = trainable_state_dict(model)
    problems = [f"{name} is missing from the journal" for name in params if name not in tensors]
    problems += [f"{name} is journaled but is not a trainable parameter of this model" for name in tensors
                 if name not in params]
    for name, p in params.items():
        t = tensors.get(name)
        if name in tensors and not isinstance(t, torch.Tensor):
            problems.append(f"{name} is journaled as a {type(t).__name__}")
        elif t is not None and (t.shape != p.shape or t.dtype != p.dtype):
            problems.append(f"{name} is journaled as {_described(t)}, the model's is {_described(p)}")
    _refuse("the journaled trainable parameters do not fit this model (a changed LoRA rank, target modules "
            "or dtype?), nothing was copied", problems)


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, shapes: Any,
                          model: Optional[torch.nn.Module] = None) -> None:
    """``FormatError`` unless the journaled optimizer ``state_dict`` ``saved`` was made for
    parameters of the shapes ``optimizer`` holds, group by group (``shapes``: as
    ``optimizer_shapes`` journaled them); ``model`` names the parameters in the message."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), Mapping):
        raise FormatError("the journaled optimizer state is not an optimizer state_dict")
    journaled = _journaled_shapes(shapes)
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    groups, live = saved["param_groups"], optimizer.param_groups
    problems = []
    if not len(groups) == len(journaled) == len(live):
        problems.append(f"the journal holds {len(groups)} parameter groups ({len(journaled)} with shapes), "
                        f"this optimizer {len(live)}")
    for g, (group, was, here) in enumerate(zip(groups, journaled, live)):
        ids = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(ids, list) or not len(ids) == len(was) == len(here["params"]):
            count = len(ids) if isinstance(ids, list) else "no"
            problems.append(f"group {g} holds {count} parameters in the journal ({len(was)} with shapes), "
                            f"{len(here['params'])} in this optimizer")
            continue
        for i, (shape, p) in enumerate(zip(was, here["params"])):
            if shape != tuple(p.shape):
                name = names.get(id(p), f"parameter {i}")
                problems.append(f"{name} (group {g}): the journaled state is for {shape}, "
                                f"the parameter is {_described(p)}")
    known = {i for group in groups if isinstance(group, Mapping) for i in group.get("params") or []}
    problems += [f"the journal holds state for parameter {k}, which no group lists" for k in saved["state"]
                 if k not in known]
    _refuse("the journaled optimizer state does not fit this optimizer, nothing was copied", problems)


class ResumeMismatch(UserWarning):
    """A resumed run was configured differently from the journaled one; the journaled values continue."""


def changed_settings(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> List[str]:
    """The optimizer settings (learning rate, betas, weight decay, ``fused``...) in which
    ``optimizer`` differs from the journaled ``state_dict`` ``saved``, one line each. With a
    scheduler, ``lr`` is where it took the rate: ``initial_lr`` is compared instead."""
    out = []
    for g, (journaled, here) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        scheduled = "initial_lr" in journaled and "initial_lr" in here
        for key in sorted(set(journaled) | set(here), key=str):
            if key in ("params", "param_names") or (key == "lr" and scheduled):
                continue
            a, b = _plain(journaled.get(key)), _plain(here.get(key))
            if a != b:
                what = f"learning rate ({key}, group {g})" if key in ("lr", "initial_lr") else f"{key} (group {g})"
                out.append(f"{what}: journaled {a!r}, this run {b!r}")
    return out


def _plain(value: Any) -> Any:
    """A setting as a comparable value (a tensor learning rate as its number)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
