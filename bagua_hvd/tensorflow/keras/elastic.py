"""Elastic training for ``tf.keras`` (``horovod.tensorflow.keras.elastic``): ``KerasState``,
the callbacks that keep it up to date in ``model.fit``, and the ``run`` decorator (the one of
``bagua_hvd.tensorflow.elastic``), and ``TensorFlowKerasState`` (also importable from here).

Typical use (Horovod's): build ``KerasState(model, batch=0, epoch=0)``,
and call ``model.fit(..., epochs=total - state.epoch, callbacks=[UpdateEpochStateCallback(state),
UpdateBatchStateCallback(state), CommitStateCallback(state)])`` inside a function decorated with
``@hvd.elastic.run``.
"""

from __future__ import annotations

from tensorflow import keras

from bagua_hvd._keras.elastic import public_classes
from bagua_hvd.tensorflow.elastic import TensorFlowKerasState, run  # noqa: F401

# TensorFlowKerasState is importable from here, as from Horovod's module (which imports it);
# __all__ stays Horovod's Keras names.
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
