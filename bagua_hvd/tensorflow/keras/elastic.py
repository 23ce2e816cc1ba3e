"""Elastic training for ``tf.keras`` (``horovod.tensorflow.keras.elastic``): ``KerasState``,
the callbacks that keep it up to date in ``model.fit``, and the ``run`` decorator (the one of
``bagua_hvd.tensorflow.elastic``).

Typical use (Horovod's): build ``KerasState(model, batch=0, epoch=0)``,
and call ``model.fit(..., epochs=total - state.epoch, callbacks=[UpdateEpochStateCallback(state),
UpdateBatchStateCallback(state), CommitStateCallback(state)])`` inside a function decorated with
``@hvd.elastic.run``.
"""

from __future__ import annotations

from tensorflow import keras

from bagua_hvd._keras.elastic import public_classes
from bagua_hvd.tensorflow.elastic import run

__all__ = [
    "KerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]

(
    KerasState,
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
) = public_classes(keras, __name__)
