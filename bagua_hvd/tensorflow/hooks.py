"""Horovod's TF1 ``hvd.BroadcastGlobalVariablesHook`` (a ``tf.compat.v1.train.SessionRunHook``)
for ``tf.compat.v1.train.MonitoredTrainingSession`` and other hook-driven TF1 loops."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.tensorflow.functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesHook"]

# A TensorFlow without TF1's hooks still imports bagua_hvd.tensorflow; the hook then refuses.
_SessionRunHook = getattr(getattr(tf.compat.v1, "train", None), "SessionRunHook", None)


class BroadcastGlobalVariablesHook(_SessionRunHook or object):  # type: ignore[misc]
    """SessionRunHook that broadcasts every global variable from ``root_rank`` to the other
    ranks once the session is created, so that all workers start from the same values
    (random initialization or a checkpoint restored on the root). TF1 graphs only, as in
    Horovod (deprecated in TensorFlow 2).

    Args:
        root_rank: rank whose values the others receive.
        device: device the broadcast ops are placed on (default ``''``: TensorFlow's choice).
        process_set: the set to broadcast within (default: global; a bagua_hvd extension,
            as ``broadcast_variables``' argument).
    """

    def __init__(
        self, root_rank: int, device: str = "", process_set: ProcessSet = global_process_set
    ) -> None:
        if _SessionRunHook is None:
            raise RuntimeError(
                "BroadcastGlobalVariablesHook needs tf.compat.v1.train.SessionRunHook, which this "
                f"TensorFlow ({tf.__version__}) does not have"
            )
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device
        self.process_set = process_set

    def begin(self) -> None:
        """Builds the broadcast op in the session's graph (again if the graph changed)."""
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            if tf.executing_eagerly():
                raise RuntimeError(
                    "BroadcastGlobalVariablesHook needs a TF1 graph (tf.compat.v1 session); in "
                    "eager mode use hvd.broadcast_variables(<variables>, root_rank) instead."
                )
            with tf.device(self.device):
                self.bcast_op = broadcast_variables(
                    tf.compat.v1.global_variables(), self.root_rank, process_set=self.process_set
                )

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Runs the broadcast once the variables are initialized (or restored)."""
        session.run(self.bcast_op)
