"""``import bagua_hvd.keras as hvd``: Horovod's ``horovod.keras`` for standalone ``import keras``
(Keras 3 with the TensorFlow backend; Keras 2 where that is what ``keras`` is).

Same optimizer as :mod:`bagua_hvd.tensorflow.keras` (``bagua_hvd/_keras/optimizer.py``), with
Horovod's ``horovod.keras`` signatures: ``DistributedOptimizer`` has no backward_passes_per_step
and no process_set; ``PartialDistributedOptimizer`` exists only here; ``allreduce`` averages by
default (``average=True``). ``hvd.elastic``: Horovod's ``horovod.keras.elastic``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

import bagua_hvd._keras as _impl
from bagua_hvd.common.frontend import *  # noqa: F403  (Horovod's basics)
from bagua_hvd.keras import callbacks, elastic  # noqa: F401  (hvd.callbacks, hvd.elastic)
from bagua_hvd.tensorflow.compression import Compression
from bagua_hvd.tensorflow.mpi_ops import (  # noqa: F401
    Adasum,
    Average,
    Sum,
    global_process_set,
    init,
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
    num_groups: int = 0,
    groups: Any = None,
    algorithm: Any = None,
) -> Any:
    """Wraps a Keras optimizer so that it averages (``op``: Average, Sum or Adasum) the
    gradients across all ranks before applying them (Horovod's ``horovod.keras``).

    Arguments as in :func:`bagua_hvd.tensorflow.keras.DistributedOptimizer`; ``algorithm`` is
    the bagua_hvd extension (default: ``BAGUA_HVD_ALGORITHM``, else allreduce).
    """
    groups = _impl.check_optimizer_args(op, gradient_predivide_factor, num_groups, groups)
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
        groups=groups,
        algorithm=algorithm,
    )


def PartialDistributedOptimizer(
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
    groups: Any = None,
    process_set: Any = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
    algorithm: Any = None,
) -> Any:
    """A :func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of them)
    keep their gradients local: not reduced, divided by the set size when
    ``scale_local_gradients``. The other arguments are those of
    ``bagua_hvd.tensorflow.keras.DistributedOptimizer``."""
    # Horovod checks tf.keras' Layer: with TF_USE_LEGACY_KERAS=1 that is tf_keras', not keras'.
    layer_types = (keras.layers.Layer, tf.keras.layers.Layer)
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, layer_types):
        local_layers = [local_layers]
    elif not all(isinstance(layer, layer_types) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    groups = _impl.check_optimizer_args(
        op, gradient_predivide_factor, 0, groups, average_aggregated_gradients
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
        local_layers=list(local_layers),
    )


(
    broadcast_global_variables,
    allreduce,
    allgather,
    broadcast,
    reducescatter,
) = _impl.collectives(keras, __name__, average_default=True)


def load_model(
    filepath: Any,
    custom_optimizers: Any = None,
    custom_objects: Any = None,
    compression: Any = Compression.none,
) -> Any:
    """``keras.models.load_model`` with the model's optimizer wrapped in
    :func:`DistributedOptimizer` (with ``compression``)."""

    def wrap_optimizer(opt: Any) -> Any:
        return DistributedOptimizer(opt, compression=compression)

    return _impl.load_model(keras, wrap_optimizer, filepath, custom_optimizers, custom_objects)
