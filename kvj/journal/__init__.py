"""The write-ahead journal: framing and records, the commit loop and the log file it writes,
the reader and the copies it reads from, open-time recovery, replay into state, snapshots,
following a live log, and the ``Journal`` handle.

Data path: ``journal.Journal`` → ``records`` (schema) → ``writer`` (group commit) → ``logfile``
(write, fdatasync, rotate; ``mirrored`` for both copies) → log files framed by ``framing``;
back through ``reader.Scan`` (``source`` picks each group's copy, ``pinned`` holds the files a
pass reads) → ``replay`` → ``state``.
"""
