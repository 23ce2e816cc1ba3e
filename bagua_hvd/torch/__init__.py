"""``import bagua_hvd.torch as hvd``: Horovod's PyTorch API over the bagua_hvd core.

Exports the names of ``horovod.torch``: collectives, process sets, basics, Compression,
DistributedOptimizer (with BAGUA's algorithms, ``bagua_hvd.torch.algorithms``), the helpers
(broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object) and
SyncBatchNorm, and the elastic package (``hvd.elastic``: TorchState, ElasticSampler, run).
"""

from bagua_hvd.common import frontend as _frontend
from bagua_hvd.common.exceptions import HorovodInternalError
from bagua_hvd.common.frontend import *  # noqa: F403  (Horovod's basics)
from bagua_hvd.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from bagua_hvd.common.util import check_extension
from bagua_hvd.torch import compression, elastic, mpi_ops  # noqa: F401  (hvd.elastic)
from bagua_hvd.torch.compression import Compression
from bagua_hvd.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from bagua_hvd.torch.mpi_ops import (
    ProcessSet,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    global_process_set,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    shutdown,
    sparse_allreduce_async,
    synchronize,
)
from bagua_hvd.torch.optimizer import DistributedOptimizer
from bagua_hvd.torch.sync_batch_norm import SyncBatchNorm

check_extension("bagua_hvd.torch", "HOROVOD_WITH_PYTORCH", __file__, "mpi_lib_v2")

__all__ = [
    "Compression",
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "allreduce",
    "allreduce_async",
    "allreduce_",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_allreduce_",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_async",
    "broadcast_",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "barrier",
    "poll",
    "synchronize",
    "init",
    "shutdown",
    *_frontend.__all__,
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "DistributedOptimizer",
    "SyncBatchNorm",
    "check_extension",
    "compression",
    "mpi_ops",
]
