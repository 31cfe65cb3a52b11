"""Benchmarks: each module has ``run(...)`` and ``format_*`` functions; ``kvj bench`` runs them."""
