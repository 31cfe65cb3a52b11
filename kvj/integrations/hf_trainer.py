"""Hugging Face ``Trainer`` (and TRL on top of it) that survives a crash: ``KvjCallback``.

After every optimizer step (or every ``every``) the callback journals what the run needs to
continue (``kvj.integrations.training``), the ``TrainerState`` (without its ``log_history``)
as the data position; storing runs on a background thread. Resuming::

    cb = KvjCallback(journal="/var/lib/kvj/train", full_every=50)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume(trainer))   # None on a fresh start

``resume`` puts the newest journaled weights into the model and writes a directory for
Trainer's own resume path (step, epoch, dataloader position); the callback installs the
optimizer, scheduler and scaler state at train begin and the RNG streams where Trainer's
resume would. What does not fit is refused before it is copied; a run configured
differently resumes with the journaled values and one ``ResumeMismatch`` warning.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Dict, Optional, Union

from transformers import TrainerCallback

from kvj.errors import FormatError
from kvj.fileio import atomic_write
from kvj.integrations.training import (RecoveredState, StateJournal, load_trainable, optimizer_shapes,
                                       recover_training, restore_training_state, rng_state, scaler_state,
                                       set_rng_state, trainable_state_dict)
from kvj.journal.journal import Journal
from kvj.journal.replay import replay

#: Where ``resume`` writes Trainer's resume directory, under ``args.output_dir``.
RESUME_DIR = "kvj-resume"


class KvjCallback(TrainerCallback):
    """Journals a ``Trainer``'s state at every ``every``-th optimizer step (a full save every
    ``full_every`` steps, deltas between) and puts a killed run back exactly (``resume``).
    ``journal``: a directory (opened at train begin, closed at train end) or an open
    ``kvj.Journal``; ``model_id`` names the run in every segment's layout."""

    def __init__(self, journal: Union[str, "os.PathLike[str]", Journal], full_every: int = 50, *, every: int = 1,
                 model_id: str = "hf-trainer", max_pending: int = 2):
        if every < 1 or full_every < 1:
            raise FormatError("every and full_every must be at least 1")
        self.journal_arg = journal
        self.full_every = full_every
        self.every = every
        self.model_id = model_id
        self.max_pending = max_pending
        self.recovered: Optional[RecoveredState] = None  #: what ``resume`` found
        self._trainer: Any = None
        self._journal: Optional[Journal] = None
        self._saver: Optional[StateJournal] = None
        self._trainable: Optional[Dict[str, Any]] = None  # the model's trainable parameters, found once
        self._samples: Optional[int] = None  # the training dataset's size, journaled with the position
        self._rng_pending = False
        self._deferred = False

    @property
    def durable_step(self) -> Optional[int]:
        """The newest step whose save is durable: where a crash now would resume."""
        if self._saver is not None:
            return self._saver.durable_step
        return self.recovered.step if self.recovered is not None else None

    @property
    def journal_path(self) -> str:
        arg = self.journal_arg
        return arg.path if isinstance(arg, Journal) else os.path.abspath(os.fspath(arg))

    def resume(self, trainer: Any) -> Optional[str]:
        """The ``resume_from_checkpoint`` for ``trainer.train``: a directory rebuilt from the newest
        journaled state, None on a fresh start."""
        self._trainer = trainer
        path = self.journal_path
        if not os.path.isdir(path):
            return None
        journal = self.journal_arg if isinstance(self.journal_arg, Journal) else None
        if journal is not None:
            journal.sync()
            rec = recover_training(replay(path), journal.store)
        else:
            with Journal.open(path) as j:  # cuts a torn tail left by the crash, as recovery does
                rec = recover_training(replay(path), j.store)
        if rec is None:
            return None
        if "trainer_state" not in (rec.state.get("data") or {}):
            raise FormatError("the journal's training state was not written by KvjCallback")
        self.recovered = rec
        model = trainer.model
        load_trainable(model, rec.state["model"])
        out = os.path.join(trainer.args.output_dir, RESUME_DIR)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        # Trainer's resume path reads the weights back; for PEFT, save_pretrained writes the adapter only.
        model.save_pretrained(out, safe_serialization=True)
        atomic_write(os.path.join(out, "trainer_state.json"), rec.state["data"]["trainer_state"].encode())
        return out

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if isinstance(self.journal_arg, Journal):
            self._journal = self.journal_arg
        else:
            self._journal = Journal.open(self.journal_path)
        dataset = getattr(kwargs.get("train_dataloader"), "dataset", None)
        self._samples = len(dataset) if hasattr(dataset, "__len__") else None
        rec = self.recovered
        if rec is not None:
            if state.global_step != rec.step:
                raise FormatError(f"Trainer resumed at step {state.global_step}, the journal holds step {rec.step}: "
                                  "pass cb.resume(trainer) as resume_from_checkpoint")
            journaled = (rec.state["data"].get("dataset") or {}).get("samples")
            differences = []
            if journaled is not None and self._samples is not None and journaled != self._samples:
                differences.append(f"dataset size: journaled {journaled} samples, this run {self._samples} (the "
                                   f"journaled position, step {rec.step}, is kept: the batches after it are not the "
                                   "ones the journaled run would have seen)")
            restore_training_state(rec.state, model, optimizer, scheduler=lr_scheduler, scaler=self._scaler(),
                                   rng=False, differences=differences)  # RNG once Trainer has skipped batches
            self._rng_pending = True
        self._trainable = trainable_state_dict(model)
        # The optimizer's next step waits for each save's copy to have read the state (on the GPU).
        self._saver = StateJournal(self._journal, self.full_every, model=self.model_id, resume=rec,
                                   max_pending=self.max_pending, optimizer=optimizer)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Resumed at an epoch's end: Trainer would restore RNG before the new epoch's iterator.
        if self._rng_pending and state.epoch is not None and float(state.epoch).is_integer():
            self._restore_rng()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Resumed mid-epoch: after the skipped batches were fetched, as Trainer's own resume does.
        if self._rng_pending:
            self._restore_rng()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every:
            return
        if control.should_log:  # the step is logged next: save the state as the log leaves it
            self._deferred = True
        else:
            self._save(state, **kwargs)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._deferred:
            self._save(state, **kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every save, then close the journal if this callback opened it."""
        try:
            if self._saver is not None:
                self._saver.close()
        finally:
            self._saver = None
            if self._journal is not None and self._journal is not self.journal_arg:
                self._journal.close()
            self._journal = None

    def _scaler(self) -> Any:
        accelerator = getattr(self._trainer, "accelerator", None)
        return getattr(accelerator, "scaler", None)

    def _restore_rng(self) -> None:
        assert self.recovered is not None
        set_rng_state(self.recovered.state["rng"])
        self._rng_pending = False

    def _save(self, state: Any, model: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
              **kwargs: Any) -> None:
        self._deferred = False
        assert self._saver is not None, "on_train_begin did not run"
        self._saver.save(state.global_step, {
            "step": state.global_step, "model": self._trainable, "optimizer": optimizer.state_dict(),
            "optimizer_shapes": optimizer_shapes(optimizer),
            "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "scaler": scaler_state(self._scaler()), "rng": rng_state(),
            "data": {"trainer_state": _resume_fields(state), "dataset": {"samples": self._samples}}})


def _resume_fields(state: Any) -> str:
    """``trainer_state.json`` as Trainer's resume reads it, without ``log_history`` (which grows
    with every logged step)."""
    return json.dumps({f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "log_history"},
                      sort_keys=True)
