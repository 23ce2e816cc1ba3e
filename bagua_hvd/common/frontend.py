"""The part of Horovod's ``mpi_ops`` modules that every frontend exports unchanged: the basics
bound to the one core (rank, size, build flags, ...), the reduce-op constants and the average
backwards-compatibility helper. ``bagua_hvd.torch.mpi_ops`` and
``bagua_hvd.tensorflow.mpi_ops`` import these names from here (they add their own ``init`` and
``shutdown`` where they wrap them)."""

from __future__ import annotations

from bagua_hvd.common import ops as _ops
from bagua_hvd.common.basics import HorovodBasics
from bagua_hvd.common.util import get_average_backwards_compatibility_fun, num_rank_is_power_2

basics = HorovodBasics(__file__, "mpi_lib")

# The basics that every frontend module re-exports as they are (``horovod.torch``,
# ``horovod.tensorflow``, ``horovod.tensorflow.keras``, ``horovod.keras``): those modules bind
# them with ``from bagua_hvd.common.frontend import *`` and import ``init``/``shutdown`` (wrapped
# by the torch frontend), the op constants and the rest of their exports explicitly.
__all__ = [
    "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "communication_stats",
]  # fmt: skip

init = basics.init
shutdown = basics.shutdown
is_initialized = basics.is_initialized
start_timeline = basics.start_timeline
stop_timeline = basics.stop_timeline
size = basics.size
local_size = basics.local_size
cross_size = basics.cross_size
rank = basics.rank
local_rank = basics.local_rank
cross_rank = basics.cross_rank
is_homogeneous = basics.is_homogeneous
mpi_threads_supported = basics.mpi_threads_supported
mpi_enabled = basics.mpi_enabled
mpi_built = basics.mpi_built
gloo_enabled = basics.gloo_enabled
gloo_built = basics.gloo_built
nccl_built = basics.nccl_built
ddl_built = basics.ddl_built
ccl_built = basics.ccl_built
cuda_built = basics.cuda_built
rocm_built = basics.rocm_built
communication_stats = basics.communication_stats

Average = _ops.Average
Sum = _ops.Sum
Adasum = _ops.Adasum
Min = _ops.Min
Max = _ops.Max
Product = _ops.Product


class _ReduceOps:
    Average = Average
    Sum = Sum


handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_ReduceOps)
check_num_rank_power_of_2 = num_rank_is_power_2
