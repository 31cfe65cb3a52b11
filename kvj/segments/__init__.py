"""The segment store: tensor bytes, compressed and checksummed, stored durably by content.

Save: ``tensors`` → ``staging`` → ``flusher`` → ``codecs`` → ``segfile`` (+ ``chunks``) → ``puts``
(dedup, claims) → ``local`` (files; ``packs``, ``packfile``; ``tempfiles``). Load: ``store`` (verified
reads through ``source``) → ``load`` / ``kvblock`` (onto a device, into cache slots). ``check`` says
what is wrong with the segments records name.
"""
