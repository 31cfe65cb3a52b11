"""The write-ahead journal. Writing: ``journal.Journal`` → ``records`` (schema) → ``writer`` (group
commit, log files framed by ``framing``). Reading: ``reader.Scan`` (``source``: which copy, ``tail``:
torn or damaged) → ``replay`` → ``state``; ``recovery`` is what ``Journal.open`` repairs first.
"""
