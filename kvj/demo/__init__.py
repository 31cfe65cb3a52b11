"""The crash-and-recover demo and its harness: deterministic workloads, the journaled
generation and training processes (``worker``), and the kill-recover-resume driver
(``crashrun``). Used by the quick start, the end-to-end tests and ``scripts/``; nothing in
the runtime (journal, segments, ops, integrations, CLI) imports it.
"""
