"""KerasEstimator's training function: runs on every rank that bagua_hvd.spark.run starts."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Optional

import numpy as np


def model_to_bytes(model: Any) -> bytes:
    """``model`` as the bytes of a ``.keras`` file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: Optional[Dict[str, Any]], compile: bool) -> Any:
    """The model of a ``.keras`` file's bytes. Compiled, its optimizer is the plain Keras class
    of the distributed optimizer it was saved with (the same name and config), with its state."""
    import keras

    from bagua_hvd._keras import _optimizer_classes

    objects: Dict[str, Any] = {cls.__name__: cls for cls in _optimizer_classes(keras.optimizers)}
    objects.update(custom_objects or {})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        with keras.utils.custom_object_scope(objects):
            return keras.models.load_model(path, compile=compile)


def input_shapes(model: Any) -> Optional[List[List[int]]]:
    """The model's input shapes (``-1`` for the batch and any free dimension), if it has
    inputs."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return [[-1 if d is None else int(d) for d in i.shape] for i in inputs]


def scaled_lr(optimizer: Any, factor: float) -> None:
    """Multiplies a float learning rate by ``factor`` (a schedule is left as it is)."""
    import keras

    if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        return
    lr = keras.ops.convert_to_numpy(optimizer._learning_rate)
    optimizer.learning_rate = float(lr) * factor


def _pin_gpu(local_rank: int) -> None:
    """This rank sees the GPU of its local rank only (Horovod's pinning), if there are GPUs."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        try:
            tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")
        except RuntimeError:  # the runtime is already initialized: keep what it has
            pass


def train(
    s: Dict[str, Any],
    model_bytes: bytes,
    optimizer_config: Dict[str, Any],
    checkpoint: Optional[bytes],
    loss: Any,
    loss_weights: Any,
    metrics: Any,
    custom_objects: Dict[str, Any],
    callbacks: List[Any],
) -> Any:
    """One rank of a KerasEstimator fit; rank 0 returns ``(history, model bytes, size)``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not s["use_gpu"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import keras

    import bagua_hvd.tensorflow.keras as hvd
    from bagua_hvd._keras import _copy_optimizer_state
    from bagua_hvd.spark.common import remote, util

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _pin_gpu(hvd.local_rank())
    if s["random_seed"] is not None:
        keras.utils.set_random_seed(s["random_seed"])

    # The optimizer of one process: the checkpoint's (with its state), else the estimator's;
    # its learning rate scaled by size while training, as Horovod.
    if checkpoint is not None:
        model = model_from_bytes(checkpoint, custom_objects, compile=True)
        base = model.optimizer
    else:
        model = model_from_bytes(model_bytes, custom_objects, compile=False)
        with keras.utils.custom_object_scope(custom_objects or {}):
            base = keras.optimizers.deserialize(optimizer_config)
    scaled_lr(base, size)
    kwargs: Dict[str, Any] = {"backward_passes_per_step": s["backward_passes_per_step"]}
    if s["gradient_compression"] is not None:
        kwargs["compression"] = s["gradient_compression"]
    if s["algorithm"] is not None:
        kwargs["algorithm"] = s["algorithm"]
    optimizer = hvd.DistributedOptimizer(base, **kwargs)  # same config, fresh state
    model.compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics)
    if checkpoint is not None:
        _copy_optimizer_state(base, optimizer, model)  # iterations, slots, the scaled rate

    train_data, val_data = remote.load_shards(s, rank, size)
    features, labels, sw_col = s["feature_cols"], s["label_cols"], s["sample_weight_col"]
    shapes = input_shapes(model)
    label_types = [util.label_dtype(train_data[c]) for c in labels]

    def generator(data: Dict[str, np.ndarray], train: bool) -> Any:
        for batch in remote.batches(s, data, rank, train):
            x = util.as_inputs(batch, features, shapes, np.float32)
            y = [batch[c].astype(t) for c, t in zip(labels, label_types)]
            if s["label_shapes"]:
                y = [a.reshape(list(shape)) for a, shape in zip(y, s["label_shapes"])]
            xs = x[0] if len(x) == 1 else tuple(x)
            ys = y[0] if len(y) == 1 else tuple(y)
            if sw_col:
                yield xs, ys, batch[sw_col].astype(np.float32)
            else:
                yield xs, ys

    progress = remote.Progress(s, rank)
    history = list(s["history"])

    def entry(epoch: int, logs: Dict[str, Any]) -> Dict[str, Any]:
        train = {k: float(v) for k, v in logs.items() if not k.startswith("val_")}
        val = {k[4:]: float(v) for k, v in logs.items() if k.startswith("val_")}
        out: Dict[str, Any] = {"epoch": epoch, "train": train}
        if val:
            out["validation"] = val
        return out

    def unscaled_bytes() -> bytes:
        """The model as a .keras file, its optimizer's learning rate that of one process."""
        lr = model.optimizer._learning_rate
        schedule = isinstance(lr, keras.optimizers.schedules.LearningRateSchedule)
        value = None if schedule else keras.ops.convert_to_numpy(lr)
        if value is not None:
            model.optimizer.learning_rate = float(value) / size
        try:
            return model_to_bytes(model)
        finally:
            if value is not None:
                lr.assign(value)  # exactly the scaled rate again

    class Run(keras.callbacks.Callback):
        """Rank 0's display and checkpoints (after MetricAverageCallback: averaged logs)."""

        epoch = 0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch = epoch
            progress.epoch_start()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if progress.steps:
                loss = float((logs or {}).get("loss", float("nan")))
                progress.step(self.epoch, batch, s["steps_per_epoch"], loss)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            history.append(entry(epoch, dict(logs or {})))
            progress.epoch_end(epoch, history[-1])
            if rank == 0:
                remote.save_run(s, unscaled_bytes(), history)

    first = s["initial_epoch"]
    val = generator(val_data, False) if val_data is not None and s["validation_steps"] else None
    model.fit(
        generator(train_data, True),
        steps_per_epoch=s["steps_per_epoch"],
        epochs=first + s["epochs"],
        initial_epoch=first,
        validation_data=val,
        validation_steps=s["validation_steps"] if val is not None else None,
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            Run(),
            *callbacks,
        ],
        shuffle=False,  # each rank's batches come shuffled (remote.batches)
        verbose=0,
    )
    if rank != 0:
        return None
    return history, unscaled_bytes(), size
