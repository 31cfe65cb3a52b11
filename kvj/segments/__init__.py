"""The segment store: tensor bytes, compressed and checksummed, stored durably by content.

Data path: tensor → ``tensors`` (dtypes, its bytes) → ``staging`` (bounded, pinned for CUDA)
→ ``flusher`` (background) → ``codecs`` (a filter, then a chunk codec) → ``segfile`` (the byte
format: chunks, CRCs, digest; no torch) → ``store`` (dedup, verify) → ``backend``
(durable files; ``packs`` of many segments in one file, ``packfile`` their format); back
through ``store.get`` (verify) → ``restore`` (onto a device, into cache slots). ``check`` verifies many segments for recovery, fsck and compaction.
"""
