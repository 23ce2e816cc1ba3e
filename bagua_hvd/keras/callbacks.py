"""``bagua_hvd.keras.callbacks``: Horovod's callbacks on standalone ``keras`` (Keras 3). See
bagua_hvd/_keras/callbacks.py for the behaviour and its Keras 3 notes."""

from __future__ import annotations

from typing import Any

import keras

from bagua_hvd._keras import callbacks as _impl

(
    BroadcastGlobalVariablesCallback,
    MetricAverageCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    _BestModelCheckpoint,
) = _impl.public_callbacks(keras, __name__)


class BestModelCheckpoint(_BestModelCheckpoint):
    """A ModelCheckpoint that saves only when ``monitor`` improves (``save_best_only=True``);
    its ``filepath`` is None until set (``checkpoint.filepath = 'best.keras'``) or given as the
    extra keyword ``filepath=``. Horovod's ``horovod.keras`` version has no
    ``save_weights_only`` (always False); here it is an extra keyword. With Keras 3 the path
    must end in ``.keras`` (``.weights.h5`` with ``save_weights_only=True``)."""

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        mode: str = "auto",
        save_freq: Any = "epoch",
        *,
        save_weights_only: bool = False,
        filepath: Any = None,
    ) -> None:
        super().__init__(monitor, verbose, save_weights_only, mode, save_freq, filepath=filepath)
