"""``kvj demo``: the crash-and-recover demo (``kvj.demo.stacks``; ``--quick``: ``kvj.demo.run``)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer


def demo(out: Annotated[str, typer.Option("--out", metavar="DIR", help="Directory for the demo's journals and "
                                          "segments (reused by a later demo, refused if something else is "
                                          "there).")] = "demo-out",
         seed: Annotated[Optional[int], typer.Option(metavar="N", help="Kill-point seed, to replay a run "
                                                     "[default: random, printed].")] = None,
         quick: Annotated[bool, typer.Option("--quick", help="kvj's own transformers serving loop and AdamW "
                                             "loop instead of vLLM and HF Trainer (about a minute).")] = False,
         requests: Annotated[int, typer.Option(metavar="N", help="Requests the vLLM engine serves (1 to 8).")] = 4,
         max_new: Annotated[int, typer.Option("--max-new", metavar="N", help="New tokens per request "
                                              "(at least 16).")] = 96,
         steps: Annotated[int, typer.Option(metavar="N", help="Steps of the LoRA fine-tune (at least 4).")] = 24,
         device: Annotated[str, typer.Option(metavar="DEVICE", help="cpu or cuda:N (--quick).")] = "cpu") -> None:
    """Pull the plug on a vLLM server and a Hugging Face fine-tune, then prove that kvj brings
    both back exactly.

    A vLLM engine with KvjConnector (a random-weight Qwen2) is SIGKILLed mid-generation and a
    transformers.Trainer + PEFT LoRA fine-tune with KvjCallback mid-run; kvj fsck and kvj
    recover run; a fresh engine resumes every request from the recovery manifest, then hands
    live requests off (drain) to a second engine, and the fine-tune resumes through
    KvjCallback.resume. Every request's tokens and logprobs must equal an uninterrupted
    engine's, the adapter and optimizer state must be bit-identical and every loss equal. A few minutes on 2 CPU cores; nothing is downloaded; without vLLM
    the serving part is left out. Exit status 1 when a proof fails.
    """
    from kvj.demo.run import demo as run_demo

    if not run_demo(out, seed, device, quick, requests, max_new, steps):
        raise typer.Exit(1)
