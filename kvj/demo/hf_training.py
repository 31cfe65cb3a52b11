"""The LoRA fine-tune the Hugging Face ``Trainer`` tests and benchmark run: a tiny random
Llama (``ModelSpec``), a PEFT LoRA adapter on the q and v projections, a synthetic dataset,
``KvjCallback`` journaling every step. Needs ``peft`` (the ``train`` extra)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from kvj.demo.workload import SIZES, ModelSpec


#: ``LoraRun.optim`` -> Trainer's ``optim``.
OPTIMIZERS = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused", "sgd": "sgd"}


@dataclass(frozen=True)
class LoraRun:
    """A deterministic LoRA fine-tune through ``transformers.Trainer``."""

    model: ModelSpec = ModelSpec("llama", "tiny")
    steps: int = 24
    samples: int = 64
    seq_len: int = 16
    batch: int = 4
    grad_accum: int = 1
    optim: str = "adamw"  #: adamw, adamw-fused (Trainer's default on torch 2.8+), or sgd (momentum 0.9)
    scheduler: str = "linear"
    warmup: int = 0
    lr: float = 2e-3
    rank: int = 4
    seed: int = 3

    def argv(self) -> List[str]:
        """Arguments of ``python -m kvj.demo.worker hf-train`` that run this fine-tune."""
        return self.model.argv() + [
            "--steps", str(self.steps), "--samples", str(self.samples), "--seq-len", str(self.seq_len),
            "--batch", str(self.batch), "--grad-accum", str(self.grad_accum), "--optim", self.optim,
            "--scheduler", self.scheduler, "--warmup", str(self.warmup), "--lr", repr(self.lr),
            "--rank", str(self.rank), "--run-seed", str(self.seed)]


class SyntheticLM(torch.utils.data.Dataset):
    """Token sequences following per-sample arithmetic patterns (learnable), fixed by a seed."""

    def __init__(self, count: int, seq_len: int, vocab: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (count, 1), generator=gen)
        stride = torch.randint(1, 8, (count, 1), generator=gen)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_trainer(run: LoraRun, output_dir: str, callbacks: List[Any], *, save_steps: Optional[int] = None) -> Any:
    """The PEFT model and its ``Trainer`` (``save_steps``: Trainer's own checkpointing, for the
    benchmark; off by default)."""
    from peft import LoraConfig, get_peft_model
    from transformers import PrinterCallback, Trainer, TrainingArguments

    torch.manual_seed(run.seed)
    base = run.model.build("cpu").train()
    model = get_peft_model(base, LoraConfig(r=run.rank, lora_alpha=2 * run.rank, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.1, task_type="CAUSAL_LM"))
    args = TrainingArguments(
        output_dir=output_dir, max_steps=run.steps, per_device_train_batch_size=run.batch,
        gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, lr_scheduler_type=run.scheduler,
        warmup_steps=run.warmup, logging_steps=1, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, report_to=[], use_cpu=True, seed=run.seed,
        dataloader_num_workers=0, disable_tqdm=True, optim=OPTIMIZERS[run.optim],
        optim_args="momentum=0.9" if run.optim == "sgd" else None, max_grad_norm=1.0)
    data = SyntheticLM(run.samples, run.seq_len, SIZES[run.model.size][0], run.seed)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # stdout carries the worker's JSON events only
    return trainer


def digests(trainer: Any) -> Dict[str, str]:
    """SHA-256 of the adapter weights and of the optimizer's state tensors (in order)."""
    from kvj.integrations.training import trainable_state_dict

    adapter = b"".join(t.detach().cpu().numpy().tobytes() for t in trainable_state_dict(trainer.model).values())
    opt = trainer.optimizer.state_dict()["state"]
    moments = b"".join(v.cpu().numpy().tobytes() for i in sorted(opt) for _, v in sorted(opt[i].items())
                       if isinstance(v, torch.Tensor))
    return {"adapter_sha256": hashlib.sha256(adapter).hexdigest(),
            "optimizer_sha256": hashlib.sha256(moments).hexdigest()}


def progress_callback(emit: Callable[..., None]) -> Any:
    """A ``TrainerCallback`` that reports steps, micro-batches and logged losses as events."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            emit(event="substep", step=state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            emit(event="step", step=state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                emit(event="log", step=state.global_step, loss=logs["loss"])

    return Progress()


def uninterrupted(run: LoraRun, output_dir: str) -> List[Dict[str, Any]]:
    """The events of the fine-tune without kvj and without a crash, in this process (set
    torch's threads and deterministic mode as the worker does first)."""
    events: List[Dict[str, Any]] = []
    trainer = build_trainer(run, output_dir, [progress_callback(lambda **e: events.append(e))])
    trainer.train()
    events.append({"event": "done", "step": trainer.state.global_step, **digests(trainer)})
    return events
