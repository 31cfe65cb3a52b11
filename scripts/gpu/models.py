"""The model checks: greedy generation journaled with CacheJournal, SIGKILLed, recovered and
resumed token-identically (hf-generation); a LoRA fine-tune through transformers.Trainer with
KvjCallback, SIGKILLed, recovered and resumed bit-identically (lora); and their child processes."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from gpu.common import (DELAY_MS, MODELS, RID, SCRIPT, SEED, TRAINING_DELAY_MS, CheckFailed, Ctx, Parts,
                        calibrate_sleep, deterministic, emit, expect, median, model_id, setup_process)

def build_model(name: str, device: Any, attention: str = "sdpa") -> Any:
    """A random-weight Llama from its config, made and initialised on ``device`` (seeded: the same
    weights in every process). Training uses eager attention: its backward is deterministic,
    which SDPA's fused kernels' need not be."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**MODELS[name], max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.to(torch.float32 if name == "tiny" else torch.bfloat16).eval()


def prompt_tokens(name: str, count: int) -> List[int]:
    import torch

    gen = torch.Generator().manual_seed(SEED + count)
    return torch.randint(0, MODELS[name]["vocab_size"], (count,), generator=gen).tolist()


def decode(model: Any, prompt: Sequence[int], new: int, block: int, *, cache: Any = None,
           tokens: Optional[Sequence[int]] = None, computed: int = 0, journal: Any = None,
           on_step: Optional[Callable[[int, List[int]], None]] = None) -> Tuple[List[int], Any]:
    """Greedy generation on one fixed schedule: the prompt in chunks that end on block boundaries,
    then one token at a time, so a run resumed at a block boundary computes what the uninterrupted
    run did. ``journal`` (a CacheJournal) observes the cache after every forward pass."""
    import torch
    from transformers import DynamicCache

    from kvj.integrations.hf import cache_kwarg

    cache = cache if cache is not None else DynamicCache(config=model.config)
    tokens = list(tokens if tokens is not None else prompt)
    kwarg, total, device = cache_kwarg(model), len(prompt) + new, model.device
    with torch.no_grad():
        while len(tokens) < total:
            end = min(len(prompt), (computed // block + 1) * block) if computed < len(prompt) else computed + 1
            ids = torch.tensor([tokens[computed:end]], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits[0, -1]
            computed = end
            if end >= len(prompt):
                if not bool(torch.isfinite(logits).all()):
                    raise CheckFailed(f"the model's logits at position {end} are not finite")
                tokens.append(int(torch.argmax(logits)))
            if journal is not None:
                journal.observe(RID, cache, tokens)
            if on_step is not None:
                on_step(computed, tokens)
    return tokens, cache


def check_hf_generation(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    details: Dict[str, Any] = {}
    for name, prompt_len, new, block in ctx.sizes.generation:
        details[name] = one_generation(ctx, parts, name, prompt_len, new, block)
    return details


def one_generation(ctx: Ctx, parts: Parts, name: str, prompt_len: int, new: int, block: int) -> Dict[str, Any]:
    import torch
    from transformers import DynamicCache

    from kvj.demo import crashrun
    from kvj.integrations.blocks import resume_points
    from kvj.integrations.hf import CacheJournal, cache_block, cache_kwarg
    from kvj.journal.journal import Journal
    from kvj.ops.recover import recover

    out: Dict[str, Any] = {"prompt": prompt_len, "new": new, "block": block}
    tag = f"{name}, {prompt_len}-token prompt"
    journal_dir = os.path.join(ctx.tmp, f"gen-{name}")
    with deterministic():
        model = build_model(name, ctx.device)
        prompt = prompt_tokens(name, prompt_len)
        want: List[int] = []
        with parts.part(f"{tag}: an uninterrupted run"):
            want, want_cache = decode(model, prompt, new, block)
            out["distinct_tokens"] = len(set(want[prompt_len:]))
        spec = json.dumps({"model": name, "prompt": prompt_len, "new": new, "block": block})
        argv = [sys.executable, SCRIPT, "--child", "generate", "--journal", journal_dir, "--spec", spec]
        whole = prompt_len // block + 1  # the prompt's whole blocks and the first block decoding completed
        with parts.part(f"{tag}: SIGKILLed mid-decode, recovered, resumed on {ctx.device}: tokens identical"):
            expect(bool(want), "no uninterrupted run to compare with")
            killed = crashrun.kill_when(crashrun.start(argv + (["--standin"] if ctx.standin else [])),
                                        lambda e: e.get("durable", 0) >= whole)
            expect(not killed.finished, "the child finished before the kill landed (raise the new tokens)")
            steps = killed.last("step")
            out["at_kill"] = max((e["computed"] for e in steps), default=0)
            manifest = recover(journal_dir).manifest
            with Journal.open(journal_dir) as journal:
                cj = CacheJournal(journal, model, block_size=block, model_id=model_id(name))
                points = [p for p in resume_points(manifest, cj.layout) if p.request_id == RID]
                expect(len(points) == 1, f"recovery found {len(points)} resume points for the request")
                point = points[0]
                expect(point.position >= whole * block, f"only {point.position} positions were durable at the kill")
                torch.cuda.synchronize(ctx.device)
                t0 = time.perf_counter()
                cache, tokens = cj.restore(point, ctx.device)
                torch.cuda.synchronize(ctx.device)
                out["restore_s"] = round(time.perf_counter() - t0, 4)
                expect(all(torch.equal(cache_block(cache, b, cj.layout), cache_block(want_cache, b, cj.layout))
                           for b in range(point.position // block)),
                       "the KV restored onto the device differs from the uninterrupted run's")
                got, _ = decode(model, prompt, new, block, cache=cache, tokens=tokens, computed=point.position,
                                journal=cj)
                cj.end(RID)
            out.update(restored=point.position, recomputed=out["at_kill"] - point.position)
            differ = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            expect(got == want, f"the resumed run's tokens differ from the uninterrupted run's from position {differ}")
        if "restored" in out:
            context = torch.tensor([want[:out["restored"]]], dtype=torch.long, device=ctx.device)
            with torch.no_grad():
                for _ in range(2):  # a warm-up, then the timed prefill
                    torch.cuda.synchronize(ctx.device)
                    t0 = time.perf_counter()
                    model(input_ids=context, use_cache=True, logits_to_keep=1,
                          **{cache_kwarg(model): DynamicCache(config=model.config)})
                    torch.cuda.synchronize(ctx.device)
                    out["prefill_s"] = round(time.perf_counter() - t0, 4)
            print(f"  {tag}: killed at position {out['at_kill']}, {out['restored']} restored, "
                  f"{out['recomputed']} recomputed; restore {out['restore_s'] * 1e3:.1f} ms (segments in the page "
                  f"cache) vs re-prefill of {out['restored']} tokens {out['prefill_s'] * 1e3:.1f} ms", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def child_generate(args: argparse.Namespace, spec: Dict[str, Any]) -> None:
    """The journaled generation the parent SIGKILLs: reports after each forward pass how many of
    its blocks are durable (their segment records are in the journal's durable part)."""
    import torch

    device = torch.device("cuda", 0)
    torch.use_deterministic_algorithms(True)
    with torch.cuda.stream(torch.cuda.Stream(device)):  # a non-default stream, as a server's
        run_generation(args, spec, device)
    emit(event="done")


def run_generation(args: argparse.Namespace, spec: Dict[str, Any], device: Any) -> None:
    """The child's generation, on the current stream (the model is made on it too, so reading
    its weights needs no wait)."""
    from kvj.integrations.hf import CacheJournal
    from kvj.journal.journal import Journal

    model = build_model(spec["model"], device)
    prompt = prompt_tokens(spec["model"], spec["prompt"])
    with Journal.open(args.journal) as journal:
        records: List[Any] = []
        flush = journal.flush

        def counted(*a: Any, **kw: Any) -> Any:
            records.append(flush(*a, **kw))
            return records[-1]

        journal.flush = counted  # type: ignore[method-assign]
        cj = CacheJournal(journal, model, block_size=spec["block"], model_id=model_id(spec["model"]))
        cj.start(RID, prompt, spec["new"])

        def on_step(computed: int, tokens: List[int]) -> None:
            durable = 0
            for r in records:
                if not r.done() or r.exception() is not None or r.result() > journal.writer.durable_lsn:
                    break
                durable += 1
            emit(event="step", computed=computed, tokens=len(tokens), durable=durable)

        decode(model, prompt, spec["new"], spec["block"], journal=cj, on_step=on_step)
        cj.end(RID)


def make_trainer(spec: Dict[str, Any], output_dir: str, callbacks: List[Any]) -> Any:
    """A PEFT LoRA fine-tune of ``spec``'s model through transformers.Trainer, fused AdamW, on cuda:0."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from kvj.demo.hf_training import SyntheticLM

    base = build_model(spec["model"], torch.device("cuda", 0), attention="eager").train()
    model = get_peft_model(base, LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"],
                                            target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                                            task_type="CAUSAL_LM"))
    args = TrainingArguments(output_dir=output_dir, max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
                             learning_rate=2e-3, lr_scheduler_type="linear", save_strategy="no",
                             logging_steps=spec["steps"],  # each log waits for the GPU, hiding a missing wait
                             report_to=[], seed=SEED % 10_000, dataloader_num_workers=0, disable_tqdm=True,
                             optim="adamw_torch_fused", max_grad_norm=1.0)
    data = SyntheticLM(spec["batch"] * spec["steps"], spec["seq"], MODELS[spec["model"]]["vocab_size"], SEED % 997)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    return trainer


def train(spec: Dict[str, Any], output_dir: str, journal: Optional[str] = None, resume: bool = False,
          on_step: Optional[Callable[[int, Optional[int]], None]] = None, cycles: Optional[int] = None
          ) -> Dict[str, Any]:
    """One fine-tune (with KvjCallback when ``journal`` is given; resumed from it with ``resume``):
    its digests, the median ms per step and what it ran with. With ``cycles`` (torch.cuda._sleep
    cycles per DELAY_MS) the races of kvj's saves are made deterministic: each optimizer step runs
    late (a save that does not wait for it reads the state from before it) and so does kvj's
    gather of the state after it (a next step that does not wait for that changes what is saved)."""
    import torch
    from transformers import TrainerCallback

    from kvj.demo.hf_training import digests
    from kvj.integrations.hf_trainer import KvjCallback
    from kvj.segments import device as kd

    times: List[float] = []
    cb = KvjCallback(journal=journal, full_every=max(2, spec["steps"] // 4), model_id=model_id(spec["model"])) \
        if journal else None

    class Late(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda._sleep(cycles)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            with torch.cuda.stream(kd.CUDA.side_stream(kd.CUDA.resolve("cuda"), "d2h")):
                torch.cuda._sleep(int(cycles * TRAINING_DELAY_MS / DELAY_MS))

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter())
            if on_step is not None:
                on_step(state.global_step, cb.durable_step if cb is not None else None)

    callbacks = [Late() if cycles is not None else None, cb, Steps()]
    trainer = make_trainer(spec, output_dir, [c for c in callbacks if c is not None])
    checkpoint = cb.resume(trainer) if cb is not None and resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    steps = [b - a for a, b in zip(times, times[1:])]
    return {**digests(trainer), "ms_per_step": round(median(steps) * 1e3, 2) if steps else None,
            "optimizer": type(inner).__name__, "fused": bool(inner.defaults.get("fused")),
            "resumed_from": cb.recovered.step if cb is not None and cb.recovered is not None else None,
            "step": trainer.state.global_step}


def check_lora(ctx: Ctx, parts: Parts) -> Dict[str, Any]:
    """Trainer runs on the device's default stream, as training loops do (under the stand-in,
    autograd's backward runs on its engine thread's current stream, the default one)."""
    import torch

    from kvj.demo import crashrun
    from kvj.ops.recover import recover

    name, steps, kill_at, batch, seq, rank = ctx.sizes.lora
    spec = {"model": name, "steps": steps, "batch": batch, "seq": seq, "rank": rank}
    out: Dict[str, Any] = {"spec": spec, "kill_once_durable": kill_at}
    journal_dir = os.path.join(ctx.tmp, "lora-journal")
    with deterministic(), torch.cuda.stream(torch.cuda.default_stream(ctx.device)):
        ref: Dict[str, Any] = {}
        with parts.part(f"{name}: an uninterrupted fine-tune without kvj (fused AdamW on the device)"):
            ref = train(spec, os.path.join(ctx.tmp, "lora-ref"))
            expect(ref["fused"] and ref["optimizer"] == "AdamW", f"Trainer ran {ref['optimizer']}, fused="
                   f"{ref['fused']}, not fused AdamW")
            out["without_kvj"] = ref
        with parts.part(f"{name}: SIGKILLed mid-run, recovered, resumed: adapter and optimizer state bit-identical"):
            expect(bool(ref), "no uninterrupted run to compare with")
            argv = [sys.executable, SCRIPT, "--child", "train", "--journal", journal_dir, "--spec", json.dumps(spec)]
            killed = crashrun.kill_when(crashrun.start(argv + (["--standin"] if ctx.standin else [])),
                                        lambda e: (e.get("durable") or 0) >= kill_at)
            expect(not killed.finished, "the child finished before the kill landed (raise the steps)")
            out["killed_at_step"] = max((e["step"] for e in killed.last("step")), default=0)
            out["recovery"] = recover(journal_dir).manifest.get("training")
            resumed = train(spec, os.path.join(ctx.tmp, "lora-resumed"), journal=journal_dir, resume=True)
            out["resumed"] = resumed
            expect(resumed["resumed_from"] is not None and resumed["resumed_from"] >= kill_at,
                   f"resumed from step {resumed['resumed_from']}, not from the journal's step {kill_at} or later")
            expect(resumed["step"] == steps, f"the resumed run stopped at step {resumed['step']} of {steps}")
            expect(resumed["adapter_sha256"] == ref["adapter_sha256"], "the adapter after the resume differs from "
                   "the uninterrupted run's")
            expect(resumed["optimizer_sha256"] == ref["optimizer_sha256"], "the optimizer state after the resume "
                   "differs from the uninterrupted run's")
    resumed = out.get("resumed", {})
    print(f"  {name}: killed at step {out.get('killed_at_step')}, resumed from {resumed.get('resumed_from')}; ms "
          f"per step without kvj {ref.get('ms_per_step')}, with kvj {resumed.get('ms_per_step')} (the resumed run, "
          f"steps {resumed.get('resumed_from')} to {steps})", flush=True)
    return out


def child_train(args: argparse.Namespace, spec: Dict[str, Any]) -> None:
    """The journaled fine-tune the parent SIGKILLs, its races made deterministic (its saves are
    what the resume starts from): reports each step and the newest durable one."""
    import torch

    torch.use_deterministic_algorithms(True)
    train(spec, os.path.join(os.path.dirname(args.journal), "lora-killed"), journal=args.journal,
          on_step=lambda step, durable: emit(event="step", step=step, durable=durable),
          cycles=calibrate_sleep(torch.device("cuda", 0)))
    emit(event="done")


def child_main(args: argparse.Namespace) -> int:
    setup_process(args.standin)
    spec = json.loads(args.spec)
    (child_generate if args.child == "generate" else child_train)(args, spec)
    return 0
