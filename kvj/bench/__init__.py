"""Benchmarks: each module has ``run(...) -> rows`` and ``main(argv)``; ``kvj bench`` exposes them."""
