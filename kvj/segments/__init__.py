"""The segment store: tensor bytes, compressed and checksummed, stored durably by content.

Data path: tensor → ``staging`` (bounded, pinned for CUDA) → ``flusher`` (background) →
``codecs`` → ``format`` (chunks, CRCs, digest) → ``store`` (dedup, verify) → ``backend``
(durable files); back through ``store.get`` (verify) → ``restore`` (onto a device, into
cache slots). ``check`` verifies many segments for recovery, fsck and compaction.
"""
