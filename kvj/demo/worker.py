"""``python -m kvj.demo.worker generate|train``: the journaled workloads as processes.

The demo and the end-to-end tests run these, SIGKILL them mid-flight, recover, and run
them again with ``--resume``. Progress and results are JSON lines on stdout (one object per
line, flushed at once) so the parent can pick its moment to kill and read what was done:

* generate: ``{"event": "step", "id", "start", "computed", "tokens"}`` after every forward
  pass (positions ``start`` to ``computed`` went through the model),
  ``{"event": "finish", "id"}`` once a request's output is durably in ``--results``, and
  ``{"event": "done", "requests": {...}}`` with per-request resume figures.
* train: ``{"event": "step", "step", "loss"}`` and ``{"event": "done", "params_sha256", ...}``.
* hf-train: ``{"event": "substep"|"step", "step"}``, ``{"event": "log", "step", "loss"}`` and
  ``{"event": "done", "adapter_sha256", "optimizer_sha256"}``.

``--resume`` continues from ``--manifest`` (written by ``kvj recover``) or, without one,
from a replay of the journal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from kvj.demo.crashrun import state_digests
from kvj.demo.workload import SIZES, GenerationWorkload, ModelSpec
from kvj.fileio import atomic_write, makedirs_durable
from kvj.journal.journal import Journal
from kvj.journal.replay import replay


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


def _manifest(path: Optional[str]) -> Optional[Dict[str, Any]]:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def result_path(results: str, request_id: str) -> str:
    return os.path.join(results, f"{request_id}.json")


def read_results(results: str) -> Dict[str, List[int]]:
    """Generated tokens of every request whose output was delivered (``--results`` files)."""
    out: Dict[str, List[int]] = {}
    if os.path.isdir(results):
        for name in sorted(os.listdir(results)):
            if name.endswith(".json"):
                with open(os.path.join(results, name), encoding="utf-8") as f:
                    doc = json.load(f)
                out[doc["id"]] = doc["generated"]
    return out


def _time_prefill(backend: Any, tokens: List[int]) -> float:
    """Seconds to rebuild KV for ``tokens`` by one prefill pass (what a restart without kvj pays)."""
    scratch = "kvj-prefill-baseline"
    t0 = time.perf_counter()
    with torch.no_grad():
        backend.forward(scratch, tokens, 0)
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)
    elapsed = time.perf_counter() - t0
    backend.release(scratch)
    return elapsed


def generate(args: argparse.Namespace) -> None:
    from kvj.demo.generation import GenerationLoop, RequestRun
    from kvj.integrations.blocks import BlockJournal, resume_points
    from kvj.demo.backends import HFBackend, PagedBackend

    spec = ModelSpec(args.arch, args.size, args.seed, args.dtype)
    work = GenerationWorkload(spec, args.requests, args.block_size, args.max_new, args.stagger, args.prompt_seed,
                              args.shared_prefix)
    model = spec.build(args.device)
    makedirs_durable(args.results)
    done = read_results(args.results)
    with Journal.open(args.journal) as journal:
        state = replay(args.journal) if args.resume else None
        if args.backend == "paged":
            # A restarted server's free list is in another order: resumed requests land in new block ids.
            order_seed = args.order_seed if args.order_seed is not None else len(state.epochs) if state else 0
            backend: Any = PagedBackend(model, args.block_size, spec.model_id, num_blocks=args.num_blocks,
                                        order_seed=order_seed, journal=journal)
        else:
            backend = HFBackend(model, args.block_size, spec.model_id)
        blocks = BlockJournal(journal, backend.layout)

        def on_finish(run: RequestRun) -> None:
            doc = {"id": run.id, "generated": run.generated}
            atomic_write(result_path(args.results, run.id), json.dumps(doc).encode())
            emit(event="finish", id=run.id)

        loop = GenerationLoop(backend, blocks, on_finish=on_finish,
                              on_step=lambda r: emit(event="step", id=r.id, start=r.positions_run[-1],
                                                     computed=r.computed, tokens=len(r.tokens)))
        before: Dict[str, List[int]] = {}
        if state is not None:
            if args.backend == "paged":
                before = backend.cache.forget_previous(state)
            manifest = _manifest(args.manifest)
            for point in resume_points(manifest if manifest is not None else state, backend.layout):
                if point.request_id in done:  # delivered, but its end record was lost: record it now
                    journal.end(point.request_id)
                    continue
                run = loop.resume(point)
                emit(event="resumed", id=run.id, position=run.restored, restore_s=run.restore_s,
                     fallback=run.fallback)
        arrivals = [item for item in work.items() if item[0] not in done and item[0] not in loop.active]
        steps = 0
        while arrivals or loop.active:
            t0 = time.perf_counter()
            while arrivals and (args.resume or arrivals[0][3] <= steps):
                rid, prompt, max_new, _ = arrivals.pop(0)
                loop.submit(rid, prompt, max_new)
            loop.step()
            steps += 1
            time.sleep(max(0.0, args.pace_ms / 1e3 - (time.perf_counter() - t0)))
        summary: Dict[str, Dict[str, Any]] = {}
        for rid, run in loop.finished.items():
            entry = {"restored": run.restored, "first_position": min(run.positions_run, default=None),
                     "restore_s": run.restore_s, "forward_s": run.forward_s, "fallback": run.fallback}
            if run.restored:
                _time_prefill(backend, run.tokens[:run.restored])  # warm-up at this length
                entry["prefill_s"] = _time_prefill(backend, run.tokens[:run.restored])
            if rid in before:
                entry["blocks_before"] = before[rid]
            summary[rid] = entry
        if args.backend == "paged":
            for rid, table in backend.restored_tables.items():
                summary[rid]["blocks_after"] = table
    emit(event="done", requests=summary)


def train_main(args: argparse.Namespace) -> None:
    from kvj.demo.training import TrainSpec, train
    from kvj.integrations.training import recover_training

    torch.use_deterministic_algorithms(True)
    spec = TrainSpec(ModelSpec(args.arch, args.size, args.seed, args.dtype), steps=args.steps, batch=args.batch,
                     seq_len=args.seq_len, lr=args.lr, full_every=args.full_every, data_seed=args.data_seed)
    with Journal.open(args.journal) as journal:
        resume = None
        if args.resume:
            manifest = _manifest(args.manifest)
            source = manifest["training"] if manifest is not None else replay(args.journal)
            t0 = time.perf_counter()
            resume = recover_training(source, journal.store, args.device)
            if resume is not None:
                emit(event="resumed", step=resume.step, base_step=resume.base_step, fallback=resume.fallback,
                     restore_s=time.perf_counter() - t0)
        trainer, stats = train(spec, journal, device=args.device, resume=resume,
                               on_step=lambda step, loss: emit(event="step", step=step, loss=loss))
    params_sha256, state_sha256 = state_digests(trainer.tensors())
    emit(event="done", step=trainer.step, stats=stats.to_dict() if stats else None,
         params_sha256=params_sha256, state_sha256=state_sha256)


def hf_train_main(args: argparse.Namespace) -> None:
    from kvj.demo.hf_training import LoraRun, build_trainer, digests, progress_callback
    from kvj.integrations.hf_trainer import KvjCallback

    torch.use_deterministic_algorithms(True)
    run = LoraRun(ModelSpec(args.arch, args.size, args.seed, args.dtype), steps=args.steps, samples=args.samples,
                  seq_len=args.seq_len, batch=args.batch, grad_accum=args.grad_accum, optim=args.optim,
                  scheduler=args.scheduler, warmup=args.warmup, lr=args.lr, rank=args.rank, seed=args.run_seed)
    kvj_cb = KvjCallback(journal=args.journal, full_every=args.full_every, model_id=run.model.model_id)
    trainer = build_trainer(run, args.output_dir, [kvj_cb, progress_callback(emit)])
    checkpoint = kvj_cb.resume(trainer) if args.resume else None
    if checkpoint is not None:
        emit(event="resumed", step=kvj_cb.recovered.step, base_step=kvj_cb.recovered.base_step)
    trainer.train(resume_from_checkpoint=checkpoint)
    emit(event="done", step=trainer.state.global_step, **digests(trainer))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvj.demo.worker", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--journal", required=True)
    common.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    common.add_argument("--size", default="tiny", choices=sorted(SIZES))
    common.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    common.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    common.add_argument("--device", default="cpu")
    common.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (keep equal across runs that must agree bit for bit)")
    common.add_argument("--resume", action="store_true")
    common.add_argument("--manifest", help="recovery manifest from `kvj recover` (default: replay the journal)")
    g = sub.add_parser("generate", parents=[common], help="serve several requests, journaling KV blocks")
    g.add_argument("--results", required=True, help="directory for delivered outputs, one JSON file each")
    g.add_argument("--backend", default="hf", choices=["hf", "paged"])
    g.add_argument("--requests", type=int, default=4)
    g.add_argument("--max-new", type=int, default=40)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--stagger", type=int, default=4)
    g.add_argument("--prompt-seed", type=int, default=1)
    g.add_argument("--shared-prefix", type=int, default=32, help="tokens of system prompt every request shares")
    g.add_argument("--num-blocks", type=int, default=256, help="paged cache pool size")
    g.add_argument("--pace-ms", type=float, default=0.0,
                   help="make each loop step last at least this long, as a larger model's would (tests use it "
                        "so kills land across the journal's commit windows)")
    g.add_argument("--order-seed", type=int, help="paged cache free-list order (default: 0, or the "
                   "recovery epoch when resuming)")
    t = sub.add_parser("train", parents=[common], help="fine-tune with AdamW, journaling state")
    t.add_argument("--steps", type=int, default=40)
    t.add_argument("--full-every", type=int, default=10)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--seq-len", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--data-seed", type=int, default=7)
    h = sub.add_parser("hf-train", parents=[common], help="LoRA fine-tune with transformers.Trainer and KvjCallback")
    h.add_argument("--output-dir", required=True)
    h.add_argument("--steps", type=int, default=24)
    h.add_argument("--full-every", type=int, default=8)
    h.add_argument("--samples", type=int, default=64)
    h.add_argument("--seq-len", type=int, default=16)
    h.add_argument("--batch", type=int, default=4)
    h.add_argument("--grad-accum", type=int, default=1)
    h.add_argument("--optim", default="adamw", choices=["adamw", "adamw-fused", "sgd"])
    h.add_argument("--scheduler", default="linear")
    h.add_argument("--warmup", type=int, default=0)
    h.add_argument("--lr", type=float, default=2e-3)
    h.add_argument("--rank", type=int, default=4)
    h.add_argument("--run-seed", type=int, default=3)
    return p


def main(argv: Optional[List[str]] = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    # Deterministic cuBLAS (read when CUDA starts): a resumed process recomputes bit for bit.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.command == "generate":
        generate(args)
    elif args.command == "hf-train":
        hf_train_main(args)
    else:
        train_main(args)


if __name__ == "__main__":
    main()
