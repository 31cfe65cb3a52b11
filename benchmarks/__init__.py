"""kvj's benchmarks (outside the wheel): each module has ``run(...)`` and ``format_*`` functions; ``kvj bench`` runs them."""
