"""Shared implementation of Horovod's Keras callbacks (``horovod/_keras/callbacks.py``).

Each ``*Impl`` class has the public constructor and reads the Keras module it runs on
(``tf.keras`` or standalone ``keras``) from its ``_keras`` class attribute:
:func:`public_callbacks` mixes them with that module's ``Callback``/``ModelCheckpoint`` into the
public classes of ``bagua_hvd.tensorflow.keras.callbacks`` and ``bagua_hvd.keras.callbacks``.

Written for Keras 3 (TF 2.16+) and for tf_keras (``TF_USE_LEGACY_KERAS=1``):

- optimizer variables: ``optimizer.variables`` is a list in Keras 3 and a method in tf_keras;
- the learning rate is ``optimizer.learning_rate`` (a variable, ``assign``-ed) in Keras 3 and
  ``optimizer.lr``/``learning_rate`` (a hyperparameter set with ``backend.set_value``) in
  tf_keras;
- momentum correction: when ``optimizer.momentum`` is a variable/hyperparameter (tf_keras's
  legacy optimizers, Horovod's case) it is set to ``momentum * new_lr / old_lr`` for one batch
  and restored, exactly as Horovod does. Keras 3 (and tf_keras's new optimizers) keep
  ``momentum`` as a Python float that a compiled train step captures as a constant, so
  changing it would do nothing. There the momentum buffers (``optimizer.momentums`` /
  ``optimizer._momentums``) are multiplied by ``new_lr / old_lr`` instead before the batch:
  for SGD (``m <- momentum * m - lr * g``) and RMSprop with momentum this is the same update
  as one step with momentum ``momentum * new_lr / old_lr``. (For Nesterov SGD the look-ahead
  term still uses the plain momentum, a small difference.)
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from bagua_hvd.tensorflow.functions import (
    broadcast_global_variables,
    broadcast_variables,
    grouped_allreduce,
)
from bagua_hvd.tensorflow.mpi_ops import Average, _executing_eagerly, rank, size
from bagua_hvd.tensorflow.optimizer_state import build_optimizer, optimizer_variables
from bagua_hvd.tensorflow.tape import variable_key


def _is_variable(var: Any) -> bool:
    if isinstance(var, tf.Variable):
        return True
    try:
        import keras

        return isinstance(var, keras.Variable)
    except (ImportError, AttributeError):  # pragma: no cover - no standalone keras 3
        return False


def _value(x: Any) -> float:
    if hasattr(x, "numpy"):
        return float(np.asarray(x.numpy()))
    return float(np.asarray(x))


def _lr_attr(optimizer: Any) -> str:
    for attr in ("learning_rate", "lr"):
        if hasattr(optimizer, attr):
            return attr
    raise ValueError(
        f"{type(optimizer).__name__} has no `learning_rate` (or `lr`) attribute to adjust"
    )


def get_learning_rate(optimizer: Any) -> float:
    """The optimizer's current learning rate as a Python float."""
    return _value(getattr(optimizer, _lr_attr(optimizer)))


def set_learning_rate(keras: Any, optimizer: Any, value: float) -> None:
    """Sets the optimizer's learning rate (a variable in Keras 3; a hyperparameter in tf_keras).

    Raises TypeError when the optimizer's learning rate is a LearningRateSchedule (the
    schedule owns the value then)."""
    attr = _lr_attr(optimizer)
    lr = getattr(optimizer, attr)
    if hasattr(lr, "assign"):
        lr.assign(value)
        return
    try:
        keras.backend.set_value(lr, value)
    except (AttributeError, ValueError, TypeError):
        setattr(optimizer, attr, value)  # Keras 3 raises TypeError itself for schedules


def _momentum_buffers(optimizer: Any) -> List[Any]:
    for attr in ("momentums", "_momentums"):
        buffers = getattr(optimizer, attr, None)
        if buffers:
            return [b for b in buffers if b is not None]
    return []


class BroadcastGlobalVariablesCallbackImpl:
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` at the end of
    the first batch.

    What is broadcast: ``model.weights`` (trainable and non-trainable weights, e.g. batch norm
    moving statistics; Keras 3's ``model.variables`` also holds the random seed generators'
    states, which are left per-rank so that dropout masks stay independent) minus the
    registered local variables, then all of the optimizer's variables. Keras 3 creates the
    optimizer's slot variables (momentum, Adam moments) lazily at its first ``apply``: at the
    end of the first batch they exist; if the optimizer has still not been built (e.g. no
    update was applied on that batch) it is built here on every rank first, so that every
    rank broadcasts the same list of variables.
    """

    _keras: Any = None  # the Keras module (set by public_callbacks)

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.backend = self._keras.backend
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars: set = set()
        for var in local_variables_list(local_variables):
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Registers a variable as worker local: it is not broadcast."""
        self._local_vars.add(variable_key(var))

    def _model_variables(self) -> List[Any]:
        model = self.model
        weights = model.weights if hasattr(model, "weights") else model.variables
        return [v for v in weights if variable_key(v) not in self._local_vars]

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.broadcast_done:
            return
        with tf.device(self.device):
            if _executing_eagerly() and hasattr(self.model, "variables"):
                broadcast_variables(self._model_variables(), root_rank=self.root_rank)
                optimizer = getattr(self.model, "optimizer", None)
                if optimizer is not None:
                    build_optimizer(optimizer, self.model.trainable_variables)
                    opt_vars = [
                        v for v in optimizer_variables(optimizer)
                        if variable_key(v) not in self._local_vars
                    ]  # fmt: skip
                    broadcast_variables(opt_vars, root_rank=self.root_rank)
            else:  # TF1-style graph (tf_keras with eager execution disabled)
                bcast_op = broadcast_global_variables(self.root_rank)
                self.backend.get_session().run(bcast_op)
        self.broadcast_done = True


class MetricAverageCallbackImpl:
    """Replaces every entry of the epoch's ``logs`` (all keys, sorted by name: losses,
    metrics, ``val_*``, ``lr`` if an earlier callback logged it) by its average over the
    ranks, in place, so that callbacks after this one see the averages."""

    _keras: Any = None  # the Keras module (set by public_callbacks)

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.backend = self._keras.backend
        self.device = device

    def _average_metrics_in_place(self, logs: Optional[dict]) -> None:
        logs = logs if logs is not None else {}
        if not logs:
            return
        names = sorted(logs)
        floatx = self.backend.floatx() if hasattr(self.backend, "floatx") else "float32"
        with tf.device(self.device):
            values = [tf.constant(np.asarray(logs[m]), dtype=floatx) for m in names]
            # One fused request; named, so that ranks whose logs hold different keys fail
            # with a clear mismatch error instead of pairing unrelated values.
            reduced = grouped_allreduce(
                values, op=Average, name="MetricAverageCallback." + ",".join(names)
            )
        for metric, value in zip(names, reduced):
            logs[metric] = value.numpy()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._average_metrics_in_place(logs)


class LearningRateScheduleCallbackImpl:
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch``
    (inclusive) and ``end_epoch`` (exclusive): at the first batch of each epoch
    (``staircase=True``, integer epoch) or at every batch with the fractional epoch
    ``epoch + batch / steps_per_epoch`` (``staircase=False``). A constant ``multiplier`` means
    ``multiplier ** (epoch - start_epoch)``. With ``momentum_correction``, the step after each
    change uses momentum scaled by ``new_lr / old_lr`` (see the module docstring)."""

    _keras: Any = None  # the Keras module (set by public_callbacks)

    def __init__(
        self,
        initial_lr: float,
        multiplier: Any,
        start_epoch: int = 0,
        end_epoch: Optional[int] = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.backend = self._keras.backend
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.initial_lr = initial_lr
        self.restore_momentum: Any = None
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: Optional[int] = None
        if not callable(multiplier):
            self.multiplier: Callable[[float], float] = lambda epoch: (
                multiplier ** (epoch - start_epoch)
            )
        else:
            self.multiplier = multiplier
        if self.initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(
            "Could not autodetect the number of steps per epoch. Please specify the "
            f"steps_per_epoch parameter to the {self.__class__.__name__}() (Keras does not "
            "know it when the training data has no length, e.g. an unbounded tf.data.Dataset)."
        )

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = get_learning_rate(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        set_learning_rate(self._keras, optimizer, new_lr)
        if hasattr(optimizer, "momentum") and self.momentum_correction and old_lr != 0:
            ratio = new_lr / old_lr
            momentum = optimizer.momentum
            if isinstance(momentum, (int, float)):
                # Keras 3: scale the buffers (same update as momentum * ratio for one step).
                for buf in _momentum_buffers(optimizer):
                    buf.assign(buf * tf.cast(ratio, buf.dtype))
            else:
                self.restore_momentum = _value(momentum)
                self.backend.set_value(momentum, self.restore_momentum * ratio)

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum:
            self.backend.set_value(self.model.optimizer.momentum, self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = get_learning_rate(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        assert self.current_epoch is not None
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return  # outside of the adjustment range
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = get_learning_rate(self.model.optimizer)


class LearningRateWarmupCallbackImpl(LearningRateScheduleCallbackImpl):
    """Gradual warm-up from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``:
    at batch ``b`` of epoch ``e`` (``b`` counted from 0) the learning rate is
    ``initial_lr / size * (t * (size - 1) / warmup_epochs + 1)`` with
    ``t = e + (b + 1) / steps_per_epoch`` (Horovod shifts ``t`` by one batch so that the value
    reaches round numbers at the ends of epochs)."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr, multiplier, 0, warmup_epochs, False, momentum_correction, steps_per_epoch
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            new_lr = get_learning_rate(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {new_lr:g}.")


def _keras_major(keras: Any) -> int:
    try:
        return int(str(keras.__version__).split(".")[0])
    except (AttributeError, ValueError):  # pragma: no cover
        return 3


class BestModelCheckpointImpl:
    """Mixed in before ``keras.callbacks.ModelCheckpoint``: a ModelCheckpoint with
    ``save_best_only=True`` whose ``filepath`` starts as None and is set later
    (``checkpoint.filepath = ...``, as horovod.spark does), or given as ``filepath=``.

    Keras 3's ModelCheckpoint rejects ``filepath=None`` and checks the suffix in its
    constructor; here the constructor passes it a placeholder and the ``filepath`` setter
    does the suffix check instead: with Keras 3 the path must end in ``.keras`` (or ``.h5``)
    for a full model and in ``.weights.h5`` with ``save_weights_only=True``. Training with no
    filepath set raises ValueError at ``on_train_begin``."""

    _keras: Any = None  # the Keras module (set by public_callbacks)

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: Any = "epoch",
        *,
        filepath: Any = None,
    ) -> None:
        self._keras_major = _keras_major(self._keras)
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
            save_weights_only=save_weights_only, mode=mode, save_freq=save_freq,
        )  # fmt: skip
        self.filepath = filepath

    @property
    def filepath(self) -> Optional[str]:
        return self.__dict__.get("_bhvd_filepath")

    @filepath.setter
    def filepath(self, value: Any) -> None:
        if value is not None:
            value = os.fspath(value) if isinstance(value, os.PathLike) else value
            if not isinstance(value, str):
                raise TypeError(f"filepath must be a string or a path, got {type(value)}")
            weights_only = self.__dict__.get("save_weights_only")
            if self.__dict__.get("_keras_major", 3) >= 3 and weights_only is not None:
                if weights_only and not value.endswith(".weights.h5"):
                    raise ValueError(
                        "BestModelCheckpoint(save_weights_only=True): with Keras 3 the "
                        f"filepath must end in `.weights.h5`, got filepath={value!r}"
                    )
                if not weights_only and not value.endswith((".keras", ".h5")):
                    raise ValueError(
                        "BestModelCheckpoint: with Keras 3 the filepath must end in `.keras` "
                        f"(Keras model format), got filepath={value!r}"
                    )
        self.__dict__["_bhvd_filepath"] = value

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.filepath is None:
            raise ValueError(
                "BestModelCheckpoint.filepath is not set: assign `checkpoint.filepath = "
                "'best.keras'` (or pass filepath=) before training"
            )
        parent = getattr(super(), "on_train_begin", None)
        if parent is not None:
            parent(logs)


def local_variables_list(local_variables: Any) -> Iterable[Any]:
    """Horovod's check of BroadcastGlobalVariablesCallback's ``local_variables``: None, one
    variable or a collection of variables (tf.Variable or Keras 3 variables)."""
    if local_variables is None:
        return []
    if _is_variable(local_variables):
        return [local_variables]
    local_variables = list(local_variables)
    if not all(_is_variable(v) for v in local_variables):
        raise ValueError("All local variables must be of tf.Variable type.")
    return local_variables


def public_callbacks(keras: Any, module: str) -> Tuple[type, ...]:
    """Horovod's public callback classes on ``keras`` (``tf.keras`` or standalone ``keras``),
    the same in ``horovod.tensorflow.keras`` and ``horovod.keras``: returns
    ``(BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
    LearningRateWarmupCallback, BestModelCheckpoint)``, each ``*Impl`` class of this module
    mixed with ``keras``' ``Callback`` (``ModelCheckpoint``) and named as a member of ``module``.
    ``BestModelCheckpoint`` has ``horovod.tensorflow.keras``' argument order (``bagua_hvd.keras``
    subclasses it with ``horovod.keras``' order)."""
    cb = keras.callbacks
    mixes = [
        (BroadcastGlobalVariablesCallbackImpl, cb.Callback, _BROADCAST_DOC),
        (MetricAverageCallbackImpl, cb.Callback, _METRIC_AVERAGE_DOC),
        (LearningRateScheduleCallbackImpl, cb.Callback, _SCHEDULE_DOC),
        (LearningRateWarmupCallbackImpl, cb.Callback, _WARMUP_DOC),
        (BestModelCheckpointImpl, cb.ModelCheckpoint, _BEST_DOC),
    ]
    classes = []
    for impl, base, doc in mixes:
        name = impl.__name__[: -len("Impl")]
        members = {"_keras": keras, "__doc__": doc, "__module__": module, "__qualname__": name}
        classes.append(type(name, (impl, base), members))
    return tuple(classes)


_BROADCAST_DOC = """Broadcasts the model's and the optimizer's variables from ``root_rank`` to all
    other processes at the end of the first batch, so that every rank trains the same model
    whether it starts from random weights or from a checkpoint. ``device``: accepted for
    compatibility; ``local_variables``: a variable or a collection of variables that are not
    broadcast."""

_METRIC_AVERAGE_DOC = """Averages the epoch's metrics (every ``logs`` entry) across all processes at
    the end of each epoch. Put it before ReduceLROnPlateau, TensorBoard and other callbacks
    that read the metrics."""

_SCHEDULE_DOC = """Sets the learning rate to ``initial_lr * multiplier(epoch)`` in epochs
    ``[start_epoch, end_epoch)``; ``multiplier`` is a constant (exponential decay:
    ``multiplier ** (epoch - start_epoch)``) or a function of the epoch. ``staircase=True``:
    adjusted at the start of each epoch (integer epoch); ``False``: at every batch with
    ``epoch + batch / steps_per_epoch`` (steps_per_epoch autodetected from Keras' params when
    not given). ``momentum_correction``: scale momentum by ``new_lr / old_lr`` for the step
    after a change."""

_WARMUP_DOC = """Gradual learning-rate warm-up ``initial_lr / size -> initial_lr`` over
    ``warmup_epochs`` ("Accurate, Large Minibatch SGD", Goyal et al.):
    ``lr(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)``, set at every
    batch with ``epoch = full_epochs + (batch + 1) / steps_per_epoch``. ``verbose=1`` prints the
    final value on rank 0."""

_BEST_DOC = """A ModelCheckpoint that saves only when ``monitor`` improves
    (``save_best_only=True``); its ``filepath`` is None until set
    (``checkpoint.filepath = 'best.keras'``) or given as the extra keyword ``filepath=``. With
    Keras 3 the path must end in ``.keras`` (``.weights.h5`` with ``save_weights_only=True``)."""
