"""The elastic Keras callbacks' logic, shared by ``bagua_hvd.keras.elastic`` and
``bagua_hvd.tensorflow.keras.elastic`` (Horovod's ``horovod/_keras/elastic.py``).

Each ``*Impl`` class is mixed with a Keras module's ``Callback`` by the public classes, which
pass that module's backend first, as Horovod's do. Keras calls the callbacks in list order:
put ``UpdateEpochStateCallback`` and ``UpdateBatchStateCallback`` before
``CommitStateCallback``, so that a commit saves the counters of the batch just finished.

Keras 3 reads the number of steps of an epoch once, when ``fit`` starts: the shorter first
epoch that ``UpdateBatchStateCallback`` writes into ``params['steps']`` after a reset is seen by
the callbacks after it, but the epoch still runs its full ``steps_per_epoch`` (the same held for
tf.keras 2, where Horovod wrote it).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple


class CommitStateCallbackImpl:
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of each epoch.

    The count of batches starts again at each ``fit`` (i.e. after each reset), so that every
    rank commits at the same batches. ``commit()`` is the hook a subclass may override.
    """

    def __init__(self, backend: Any, state: Any, batches_per_commit: int, *args: Any) -> None:
        super().__init__(*args)
        self.backend = backend
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        # Every rank counts from here after a reset, new workers too.
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.commit()

    def commit(self) -> None:
        """Commits the state (may raise HostsUpdatedInterrupt, on every rank at once)."""
        self.state.commit()


class UpdateBatchStateCallbackImpl:
    """Keeps ``state.batch`` at the index (from 0) of the last finished batch of the epoch, and
    0 at the end of each epoch; with ``steps_per_epoch``, writes the steps left in the first
    epoch after a reset (``steps_per_epoch - state.batch``) into ``params['steps']``."""

    def __init__(self, backend: Any, state: Any, *args: Any) -> None:
        super().__init__(*args)
        self.backend = backend
        self.state = state
        self.steps_per_epoch: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        # The full epoch's steps are read again at each fit (i.e. after each reset).
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallbackImpl:
    """Keeps ``state.epoch`` at the number of finished epochs, counted across resets: Keras
    numbers each ``fit``'s epochs from 0 (or ``initial_epoch``), so they are offset by the
    value of ``state.epoch`` when the fit began. Call ``fit(..., epochs=total - state.epoch)``.
    """

    def __init__(self, backend: Any, state: Any, *args: Any) -> None:
        super().__init__(*args)
        self.backend = backend
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        # +1: the epoch is finished, so a reset after state.batch went back to 0 does not run
        # it again.
        self.state.epoch = self.initial_epoch + epoch + 1


def public_classes(keras: Any, module: str) -> Tuple[type, type, type, type]:
    """``KerasState`` and the three callbacks for one Keras module (``keras`` or ``tf.keras``),
    as ``module``'s classes: the public part of ``horovod.keras.elastic`` and
    ``horovod.tensorflow.keras.elastic``, written once."""
    from bagua_hvd.tensorflow.elastic import TensorFlowKerasState

    class KerasState(TensorFlowKerasState):
        """State representation of a Keras model and optimizer.

        An optimizer that has not created its variables yet is built on the model's trainable
        variables. See ``bagua_hvd.tensorflow.elastic.TensorFlowKerasState``.

        Args:
            model: Keras model (built: ValueError otherwise).
            optimizer: Optional optimizer, can be compiled into model instead (default:
                ``model.optimizer``).
            kwargs: Additional properties to sync, will be exposed as attributes of the object.
        """

        def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
            super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)

    class CommitStateCallback(CommitStateCallbackImpl, keras.callbacks.Callback):
        """Keras Callback that will commit the ``state`` object every ``batches_per_commit``
        batches at the end of each batch, and at the end of each epoch.

        Args:
            state: ``bagua_hvd.common.elastic.State`` object to be committed.
            batches_per_commit: Number of batches to complete between each commit (default: 1).
        """

        def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
            super().__init__(keras.backend, state, batches_per_commit)

    class UpdateBatchStateCallback(UpdateBatchStateCallbackImpl, keras.callbacks.Callback):
        """Keras Callback that will update the value of ``state.batch`` with the current batch
        number at the end of each batch. Batch will reset to 0 at the end of each epoch.

        If ``steps_per_epoch`` is set, this callback also writes the number of steps of the
        first epoch following a reset, shortened by the batches already processed, into
        ``params['steps']`` (Keras 3 still runs the full epoch: see
        ``bagua_hvd._keras.elastic``).

        Args:
            state: ``bagua_hvd.common.elastic.State`` object to be updated (with a ``batch``
                property).
        """

        def __init__(self, state: Any) -> None:
            super().__init__(keras.backend, state)

    class UpdateEpochStateCallback(UpdateEpochStateCallbackImpl, keras.callbacks.Callback):
        """Keras Callback that will update the value of ``state.epoch`` with the current epoch
        number at the end of each epoch (counted across resets).

        Args:
            state: ``bagua_hvd.common.elastic.State`` object to be updated (with an ``epoch``
                property).
        """

        def __init__(self, state: Any) -> None:
            super().__init__(keras.backend, state)

    classes = (KerasState, CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback)
    for cls in classes:
        cls.__module__ = module
        cls.__qualname__ = cls.__name__
    return classes
