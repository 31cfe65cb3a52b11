"""Crash-safe training: what a run needs to continue, journaled every step, small.

* ``state``: what training state is (``training_state``) and the checks a resume makes
  before installing it (``restore_training_state``);
* ``host``: capture off the device into host streams and one document (``StateBuffers``,
  ``Capture``), and back (``materialize``);
* ``delta``: the XOR of a stream against its base;
* ``journal``: ``StateJournal``, checkpoints every ``full_every`` steps and deltas between,
  stored on a background thread;
* ``recover``: ``recover_training``, the newest state the journal can rebuild.

``kvj.integrations.hf_trainer`` (Hugging Face ``Trainer``) and the demo's trainer use it.
The names below are the public interface; import them from here.
"""

from kvj.integrations.training.delta import unxor, xor
from kvj.integrations.training.host import FORMAT, Capture, StateBuffers, capture, materialize
from kvj.integrations.training.journal import (DELTA_FORMAT, FULL_FORMAT, INLINE_BYTES, STREAM_PREFIX, TREE,
                                               SaveStats, StateJournal)
from kvj.integrations.training.recover import RecoveredState, recover_training
from kvj.integrations.training.state import (ResumeMismatch, changed_settings, check_optimizer_state,
                                             check_trainable, load_scaler, load_trainable, optimizer_shapes,
                                             restore_training_state, rng_state, scaler_state, set_rng_state,
                                             trainable_state_dict, training_state, warn_changed_settings)

__all__ = ["FORMAT", "FULL_FORMAT", "DELTA_FORMAT", "TREE", "STREAM_PREFIX", "INLINE_BYTES", "Capture",
           "StateBuffers", "capture", "materialize", "xor", "unxor", "SaveStats", "StateJournal", "RecoveredState",
           "recover_training", "ResumeMismatch", "changed_settings", "check_optimizer_state", "check_trainable",
           "load_scaler", "load_trainable", "optimizer_shapes", "restore_training_state", "rng_state",
           "scaler_state", "set_rng_state", "trainable_state_dict", "training_state", "warn_changed_settings"]
