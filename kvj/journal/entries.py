"""Names of entries in a journal directory that one command writes and others read: here, so
that a reader (``kvj status``) needs none of the writer's modules (spec: kvj-journal(5), DIRECTORY LAYOUT)."""

#: Where ``kvj recover`` writes its manifests (``manifest-<epoch>.json``).
RECOVERY_DIR = "recovery"
#: A recovery (or handoff) manifest is at most this large (a plan for every request and block in flight).
MAX_MANIFEST_BYTES = 256 << 20
#: A salvage's report while it is not yet in a durable recovery-epoch record.
PENDING_NAME = "SALVAGE.json"
