"""``kvj demo``: the crash-and-recover demo (``kvj.demo.run``)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer



def demo(out: Annotated[str, typer.Option("--out", metavar="DIR", help="Directory for the demo's journals and "
                                          "segments (reused by a later demo, refused if something else is "
                                          "there).")] = "demo-out",
         seed: Annotated[Optional[int], typer.Option(metavar="N", help="Kill-point seed, to replay a run "
                                                     "[default: random, printed].")] = None,
         device: Annotated[str, typer.Option(metavar="DEVICE", help="cpu or cuda:N.")] = "cpu") -> None:
    """Pull the plug on a model server and a fine-tuning run, then prove that kvj brings both
    back exactly.

    Two processes (a transformers Llama serving chats, a Qwen2 fine-tuned with AdamW) are
    SIGKILLed at random points; kvj fsck and kvj recover run; both restart from the recovery
    manifest and finish; every request's tokens must equal an uninterrupted run's and the
    weights and optimizer state must be bit-identical. About a minute on the CPU; nothing is
    downloaded. Exit status 1 when a proof fails.
    """
    from kvj.demo.run import demo as run_demo

    if not run_demo(out, seed, device):
        raise typer.Exit(1)
