"""``import bagua_hvd.tensorflow as hvd``: Horovod's TensorFlow API over the bagua_hvd core.

Exports the collectives, the in-graph queries, process sets, basics, Compression, the
object/variable helpers, DistributedGradientTape, PartialDistributedGradientTape,
DistributedOptimizer, LocalGradientAggregationHelper(Eager), the TF1
BroadcastGlobalVariablesHook and SyncBatchNormalization of ``horovod.tensorflow``. Keras:
``bagua_hvd.tensorflow.keras`` (and ``bagua_hvd.keras``); BAGUA's algorithms:
``bagua_hvd.tensorflow.algorithms`` (docs/tensorflow.md, docs/algorithms.md).

This module only imports and re-exports: each name is defined in a submodule (the ops in
``mpi_ops``, the reductions and helpers in ``functions``, the tapes in ``tape``, ...), and no
submodule imports this package back.
"""

from __future__ import annotations

import tensorflow as tf  # noqa: F401  (hvd.tf, as in Horovod's package)

from bagua_hvd.common.exceptions import HorovodInternalError  # noqa: F401
from bagua_hvd.common.frontend import *  # noqa: F403  (Horovod's basics)
from bagua_hvd.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from bagua_hvd.common.util import check_extension, gpu_available, split_list  # noqa: F401
from bagua_hvd.tensorflow import elastic, mpi_ops, util  # noqa: F401  (hvd.elastic, hvd.util)
from bagua_hvd.tensorflow.compression import Compression, NoneCompressor  # noqa: F401
from bagua_hvd.tensorflow.functions import (  # noqa: F401
    allgather_object,
    allreduce,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from bagua_hvd.tensorflow.gradient_aggregation_eager import (  # noqa: F401
    LocalGradientAggregationHelperEager,
)
from bagua_hvd.tensorflow.hooks import BroadcastGlobalVariablesHook  # noqa: F401
from bagua_hvd.tensorflow.mpi_ops import (  # noqa: F401
    ProcessSet,
    _executing_eagerly,
    add_process_set,
    allgather,
    allreduce_dense,
    alltoall,
    as_tensor,
    barrier,
    broadcast,
    broadcast_,
    check_num_rank_power_of_2,
    global_process_set,
    grouped_allgather,
    grouped_allreduce_dense,
    grouped_reducescatter_dense,
    handle_average_backwards_compatibility,
    init,
    is_homogeneous,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank,
    rank_op,
    reducescatter_dense,
    remove_process_set,
    shutdown,
    size,
    size_op,
)
from bagua_hvd.tensorflow.optimizer import (  # noqa: F401
    DistributedOptimizer,
    LocalGradientAggregationHelper,
)
from bagua_hvd.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from bagua_hvd.tensorflow.tape import (  # noqa: F401
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from bagua_hvd.tensorflow.util import (  # noqa: F401
    _cache,
    _make_subgraph,
    refs_to_vars,
    vars_to_refs,
)
