"""``bagua_hvd.tensorflow.keras.callbacks``: Horovod's callbacks on ``tf.keras`` (Keras 3 on
TF 2.16+, tf_keras when ``TF_USE_LEGACY_KERAS=1``). See bagua_hvd/_keras/callbacks.py for the
behaviour and its Keras 3 notes."""

from __future__ import annotations

import tensorflow as tf

from bagua_hvd._keras import callbacks as _impl

(
    BroadcastGlobalVariablesCallback,
    MetricAverageCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    BestModelCheckpoint,
) = _impl.public_callbacks(tf.keras, __name__)
