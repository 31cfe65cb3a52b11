"""The tiny model kvj serve's tests serve (``benchmarks.serve.make_model``: a random-weight Llama and a
BPE tokenizer with a chat template, made offline), as ``python -m support.serve_model DIR`` too."""

from __future__ import annotations

from benchmarks.serve import make_model

__all__ = ["make_model"]

if __name__ == "__main__":
    import sys

    print(make_model(sys.argv[1]))
