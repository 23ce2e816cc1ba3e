"""``import bagua_hvd.tensorflow.keras as hvd``: Horovod's ``horovod.tensorflow.keras`` for
``tf.keras`` (Keras 3 on TF >= 2.16; tf_keras, i.e. Keras 2, when ``TF_USE_LEGACY_KERAS=1``).

``DistributedOptimizer`` works with Keras 3's ``model.fit`` (whose train step calls
``optimizer.apply_gradients``/``apply``: Horovod's hooks do not exist there, its issue #4290), with a
custom ``train_step`` and with a plain ``GradientTape`` loop that calls ``apply_gradients``; see
``bagua_hvd/_keras/optimizer.py``. ``hvd.elastic``: Horovod's
``horovod.tensorflow.keras.elastic``.
"""

from __future__ import annotations

from typing import Any

from tensorflow import keras

import bagua_hvd._keras as _impl
from bagua_hvd.common.frontend import *  # noqa: F403  (Horovod's basics)
from bagua_hvd.tensorflow.compression import Compression
from bagua_hvd.tensorflow.keras import callbacks, elastic  # noqa: F401  (hvd.callbacks/elastic)
from bagua_hvd.tensorflow.mpi_ops import (  # noqa: F401
    Average,
    ProcessSet,
    Sum,
    add_process_set,
    global_process_set,
    init,
    remove_process_set,
    shutdown,
)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
    algorithm: Any = None,
) -> Any:
    """Wraps a Keras optimizer so that it averages (``op``) the gradients across the process set
    before applying them (Horovod's ``hvd.DistributedOptimizer`` for tf.keras).

    The result is an instance of a subclass of ``optimizer``'s class (same name and config, fresh
    state). compression: ``Compression.none``/``fp16``/``bf16``. sparse_as_dense: densify
    ``tf.IndexedSlices`` gradients (else they are allgathered). gradient_predivide_factor: with
    Average, ``1/f`` before the sum and ``f/size`` after. backward_passes_per_step: accumulate the
    gradients locally for that many calls and reduce/apply on the last (divided by the number of
    passes if average_aggregated_gradients). groups: an int (that many fused requests) or lists of
    variables (one request each). op: Average or Sum. algorithm (bagua_hvd extension): a BAGUA
    algorithm of ``bagua_hvd.tensorflow.algorithms`` (or ``"auto"``: docs/algorithms.md,
    "Auto") instead of the allreduce (default: the
    ``BAGUA_HVD_ALGORITHM`` environment variable, else allreduce). ``device_dense`` and
    ``device_sparse`` are accepted for compatibility.
    """
    groups = _impl.check_optimizer_args(
        op, gradient_predivide_factor, num_groups, groups, average_aggregated_gradients
    )
    if op != Average and op != Sum:
        raise ValueError("op currently only supports Average and Sum")
    if backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step}"
        )
    return _impl.create_distributed_optimizer(
        keras=keras,
        optimizer=optimizer,
        name=name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
        algorithm=algorithm,
    )


(
    broadcast_global_variables,
    allreduce,
    allgather,
    broadcast,
    reducescatter,
) = _impl.collectives(keras, __name__, average_default=None)


def load_model(
    filepath: Any,
    custom_optimizers: Any = None,
    custom_objects: Any = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
) -> Any:
    """``keras.models.load_model`` with the model's optimizer wrapped in
    :func:`DistributedOptimizer` (with ``compression``). custom_optimizers: extra optimizer
    classes to wrap; custom_objects: passed to Keras."""

    def wrap_optimizer(opt: Any) -> Any:
        return DistributedOptimizer(opt, compression=compression)

    return _impl.load_model(
        keras, wrap_optimizer, filepath, custom_optimizers, custom_objects, legacy_opts
    )
