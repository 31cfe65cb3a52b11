"""The demo's deterministic fine-tuning run, journaled through ``StateJournal``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from kvj.demo.workload import ModelSpec, training_batch
from kvj.integrations.training import (RecoveredState, SaveStats, StateJournal, restore_training_state,
                                       training_state)

if TYPE_CHECKING:
    from kvj.journal.journal import Journal


@dataclass(frozen=True)
class TrainSpec:
    """A deterministic fine-tuning run."""

    model: ModelSpec = ModelSpec()
    steps: int = 40
    batch: int = 4
    seq_len: int = 32
    lr: float = 1e-3
    full_every: int = 10
    data_seed: int = 7

    def argv(self) -> List[str]:
        """Arguments of ``python -m kvj.demo.worker train`` that run this fine-tuning."""
        return self.model.argv() + ["--steps", str(self.steps), "--batch", str(self.batch), "--seq-len",
                                    str(self.seq_len), "--lr", repr(self.lr), "--full-every", str(self.full_every),
                                    "--data-seed", str(self.data_seed)]


class Trainer:
    """AdamW fine-tuning of a ``ModelSpec`` model on ``training_batch`` data."""

    def __init__(self, spec: TrainSpec, device: Union[str, torch.device] = "cpu"):
        self.spec = spec
        self.device = torch.device(device)
        self.model = spec.model.build(str(self.device)).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, foreach=False)
        self.step = 0
        self.vocab = self.model.config.vocab_size

    def train_step(self) -> float:
        """One optimizer step on the batch of step ``self.step + 1``; returns the loss."""
        batch = training_batch(self.step + 1, seed=self.spec.data_seed, batch=self.spec.batch,
                               seq_len=self.spec.seq_len, vocab=self.vocab).to(self.device)
        loss = self.model(input_ids=batch, labels=batch).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.detach().item()

    def state(self) -> Dict[str, Any]:
        """What ``StateJournal`` saves after each step (the data is a function of the step)."""
        return training_state(self.model, self.optimizer, step=self.step, data={"step": self.step})

    def load(self, state: Mapping[str, Any]) -> None:
        self.step = restore_training_state(state, self.model, self.optimizer)

    def tensors(self) -> Dict[str, List[torch.Tensor]]:
        """The parameters, and the optimizer's state tensors in parameter order (for digests)."""
        params = list(self.model.parameters())
        moments = [t for p in params for _, t in sorted(self.optimizer.state.get(p, {}).items())
                   if isinstance(t, torch.Tensor)]
        return {"params": [p.detach() for p in params], "optimizer": moments}


def train(spec: TrainSpec, journal: Optional["Journal"] = None, *, device: Union[str, torch.device] = "cpu",
          resume: Optional[RecoveredState] = None,
          on_step: Optional[Callable[[int, float], None]] = None) -> Tuple[Trainer, Optional[SaveStats]]:
    """Run (or, given ``resume``, continue) the fine-tuning to ``spec.steps``, journaling the
    state after every step when ``journal`` is given. Returns the trainer and save stats."""
    trainer = Trainer(spec, device)
    saver = None
    if resume is not None:
        trainer.load(resume.state)
    if journal is not None:
        saver = StateJournal(journal, spec.full_every, model=spec.model.model_id, resume=resume,
                             optimizer=trainer.optimizer)
    try:
        while trainer.step < spec.steps:
            loss = trainer.train_step()
            if saver is not None:
                saver.save(trainer.step, trainer.state())
            if on_step is not None:
                on_step(trainer.step, loss)
    finally:
        if saver is not None:
            saver.close()
    return trainer, saver.stats if saver is not None else None
