"""Off-node durability: ship a journal to S3-compatible object storage, restore and verify it.

``remote`` talks to the bucket (obstore), ``lease`` keeps one replicator per replica,
``manifest`` is the replica's table of contents (compare-and-swap), ``ship`` is the
replicator, ``restore`` and ``verify`` read a replica back. The serving loop never waits
on any of it: the replicator only reads the journal's files.
"""
