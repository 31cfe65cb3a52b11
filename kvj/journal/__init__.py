"""The write-ahead journal: framing and records, the group-committing writer, the reader,
replay into state, snapshots, following a live log, and the ``Journal`` handle.

Data path: ``journal.Journal`` → ``records`` (schema) → ``writer`` (group commit, fdatasync)
→ log files framed by ``framing``; back through ``reader.Scan`` → ``replay`` → ``state``.
"""
