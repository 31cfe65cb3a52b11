"""Crash-safe training: what a run needs to continue, journaled every step, small.

``state`` says what training state is and checks it on resume, ``host`` captures it off the
device and back, ``delta`` XORs a stream against its base, ``journal`` (``StateJournal``)
stores checkpoints and deltas, ``recover`` (``recover_training``) rebuilds the newest state.
The names below are the public interface.
"""

from kvj.integrations.training.delta import unxor, xor
from kvj.integrations.training.host import FORMAT, Capture, StateBuffers, capture, materialize
from kvj.integrations.training.journal import (DELTA_FORMAT, FULL_FORMAT, INLINE_BYTES, STREAM_PREFIX, TREE,
                                               SaveStats, StateJournal)
from kvj.integrations.training.recover import RecoveredState, recover_training
from kvj.integrations.training.state import (ResumeMismatch, changed_settings, check_optimizer_state,
                                             check_trainable, load_scaler, load_trainable, optimizer_shapes,
                                             restore_training_state, rng_state, scaler_state, set_rng_state,
                                             trainable_state_dict, training_state)

__all__ = ["FORMAT", "FULL_FORMAT", "DELTA_FORMAT", "TREE", "STREAM_PREFIX", "INLINE_BYTES", "Capture",
           "StateBuffers", "capture", "materialize", "xor", "unxor", "SaveStats", "StateJournal", "RecoveredState",
           "recover_training", "ResumeMismatch", "changed_settings", "check_optimizer_state", "check_trainable",
           "load_scaler", "load_trainable", "optimizer_shapes", "restore_training_state", "rng_state",
           "scaler_state", "set_rng_state", "trainable_state_dict", "training_state"]
