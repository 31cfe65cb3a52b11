"""Off-node durability: ship a journal to S3-compatible object storage, restore and verify it.

``remote`` is the bucket, ``lease`` one replicator per replica, ``manifest`` the replica's
table of contents, ``tail`` what is new in the journal, ``ship`` the replicator, ``pull``
(restore) and ``verify`` read a replica back. The writer never waits on any of it.
"""
