"""Collective operations on torch tensors (``horovod.torch.mpi_ops``).

Supported dtypes (CPU tensors; CUDA tensors too, see below):

* allreduce, grouped_allreduce, reducescatter, grouped_reducescatter: uint8, int8, int16, int32,
  int64, float16, bfloat16, float32, float64. Horovod itself supports only int32, int64,
  float16, float32 and float64; the others are bagua_hvd extensions. Scale factors (and
  Average's 1/size) are applied as Horovod does, bit for bit: float32 and float64 in their own
  precision (the factor rounded to it, one rounding of the product), float16 and bfloat16 in
  float32 then rounded back, integers in double then truncated toward zero.
* allreduce of bool tensors is a logical reduction: Sum and Max are "or", Min and Product are
  "and". Average, Adasum and scale factors other than 1.0 are rejected for bool (ValueError);
  reducescatter does not accept bool.
* allgather, grouped_allgather, broadcast, alltoall: every type above plus bool and uint16.

Anything else raises ``ValueError('Tensor type %s is not supported.')``; a non-contiguous
tensor raises ``ValueError('Tensor is required to be contiguous.')``.

CUDA tensors are staged through host memory (copied to the CPU, reduced there, copied back to
their device): correct, but slower than GPU collectives, which the core does not run yet.

Errors: bad arguments detected at enqueue raise ValueError (or NotImplementedError) at once on
the calling rank; mismatches between ranks, lost peers and shutdown raise HorovodInternalError
(a RuntimeError) from ``synchronize`` on every rank involved, and the job keeps working.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple, Union

import torch

from bagua_hvd.common import config
from bagua_hvd.common import frontend as _frontend
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.exceptions import HorovodInternalError
from bagua_hvd.common.process_sets import (
    ProcessSet,
    _id_to_process_sets,  # noqa: F401  (Horovod exposes the registry here as well)
    add_process_set,
    global_process_set,
    remove_process_set,
)
from bagua_hvd.common.util import (
    gpu_available,
    num_rank_is_power_2,  # noqa: F401 - horovod.torch.mpi_ops has it
)
from bagua_hvd.torch.compression import Compression, NoneCompressor

__all__ = [
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "init",
    "shutdown",
    "is_homogeneous",
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
    *_frontend.__all__,  # the basics
]

from bagua_hvd.common.frontend import *  # noqa: F403  (Horovod's basics, re-exported)
from bagua_hvd.common.frontend import basics as _basics  # noqa: E402
from bagua_hvd.common.frontend import (  # noqa: F401  (Horovod's mpi_ops exports)
    handle_average_backwards_compatibility,
    is_homogeneous,
    is_initialized,
    local_size,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from bagua_hvd.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401

# handle -> (finish(handle) -> result, keepalive, label, CUDA device or -1). The keepalive holds
# every tensor and C struct the core may touch until the handle is released.
_handle_map: Dict[int, Tuple[Callable[[int], Any], Any, str, int]] = {}
# Handles outstanding at shutdown(): Horovod's shutdown clears its C++ handle manager but not
# its Python handle map, so synchronize() on one raises the manager's ValueError.
_cleared_handles: Set[int] = set()
_lifecycle_lock = threading.Lock()


def init(*args: Any, **kwargs: Any) -> None:
    """Initializes bagua_hvd (Horovod's ``hvd.init``); a no-op when already initialized.

    Arguments are those of :meth:`bagua_hvd.common.basics.HorovodBasics.init`.
    """
    with _lifecycle_lock:
        if not _basics.is_initialized():
            _handle_map.clear()
            _cleared_handles.clear()  # the core numbers handles from 1 again
        _basics.init(*args, **kwargs)
        _refresh_core_facts()


def shutdown(*args: Any, **kwargs: Any) -> None:
    """Shuts bagua_hvd down. As in Horovod, the handles still outstanding are cleared:
    :func:`synchronize` on one raises ValueError ("Handle <n> was not created or has been
    cleared."), whether or not its operation had completed, instead of returning a result."""
    with _lifecycle_lock:
        _basics.shutdown(*args, **kwargs)
        # Their entries stay until synchronize() or init(): a device may still be writing
        # into the tensors they keep alive.
        _cleared_handles.update(_handle_map)


# ---- dtypes ------------------------------------------------------------------------------------
_DTYPES: Dict[torch.dtype, int] = {
    torch.uint8: _ops.UINT8,
    torch.int8: _ops.INT8,
    torch.int16: _ops.INT16,
    torch.int32: _ops.INT32,
    torch.int64: _ops.INT64,
    torch.float16: _ops.FLOAT16,
    torch.bfloat16: _ops.BFLOAT16,
    torch.float32: _ops.FLOAT32,
    torch.float64: _ops.FLOAT64,
    torch.bool: _ops.BOOL,
}
if hasattr(torch, "uint16"):
    _DTYPES[torch.uint16] = _ops.UINT16
_REDUCE_DTYPES = {dt: code for dt, code in _DTYPES.items() if code not in (_ops.BOOL, _ops.UINT16)}
_ALLREDUCE_DTYPES = {**_REDUCE_DTYPES, torch.bool: _ops.BOOL}
_MOVE_DTYPES = dict(_DTYPES)
_BOOL_OPS = (Sum, Min, Max, Product)


def _check(tensor: torch.Tensor, table: Dict[torch.dtype, int]) -> int:
    """Horovod's _check_function: the dtype must be supported and the tensor contiguous."""
    try:
        code = table[tensor.dtype]
    except (KeyError, AttributeError):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}") from None
        raise ValueError(f"Tensor type {tensor.type()} is not supported.") from None
    if tensor.layout is not torch.strided:
        raise ValueError(
            f"Tensor type {tensor.type()} is not supported. (layout {tensor.layout}; sparse "
            "tensors: use sparse_allreduce_async)"
        )
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return code


#: ``core_dtype(tensor)``: the core's dtype code of a tensor that allreduce accepts (contiguous,
#: a supported dtype); raises Horovod's ValueError otherwise.
core_dtype: Callable[[torch.Tensor], int] = functools.partial(_check, table=_ALLREDUCE_DTYPES)


def _check_bool_reduce(op: int, prescale: float, postscale: float) -> None:
    if op not in _BOOL_OPS or prescale != 1.0 or postscale != 1.0:
        raise ValueError(
            "Tensor type torch.BoolTensor is not supported. bool tensors are reduced as logical "
            "ops: Sum/Max (or) and Min/Product (and), without prescale/postscale factors; got "
            f"op {_ops.REDUCE_OP_NAMES.get(op, op)}, prescale_factor={prescale}, "
            f"postscale_factor={postscale}"
        )


# ---- devices ----------------------------------------------------------------------------------
# Whether CUDA tensors reach the core as device pointers: in a build with CUDA (nvcc at build
# time), unless BAGUA_HVD_CUDA_DEVICE_POINTERS=0. The core then runs them through NCCL (or its
# pinned host staging), ordered with torch's streams by events: nothing waits on the host here.
# Otherwise CUDA tensors are copied to host memory and back by this frontend.
_core_cuda = False


def _refresh_core_facts() -> None:
    global _core_cuda
    _core_cuda = config.cuda_device_pointers() and _ops.device_pointers_supported()


def _device_of(tensor: torch.Tensor) -> int:
    """The request's device: -1 for CPU and for host-staged CUDA tensors."""
    if tensor.device.type == "cpu" or not _core_cuda:
        return -1
    return tensor.device.index


def _device_of_all(tensors: Sequence[torch.Tensor]) -> int:
    """The request's device for a grouped op, whose tensors must share one device."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        # Horovod's: a std::logic_error of its C++ op, which its Python wrapper re-raises as
        # HorovodInternalError (a RuntimeError).
        raise HorovodInternalError("Tensors in list must be on same device.")
    return _device_of(tensors[0])


def _stream_of(device: int) -> int:
    """The stream that produces a device tensor now (torch's current stream), or 0."""
    return torch.cuda.current_stream(device).cuda_stream if device >= 0 else 0


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor the core reads: itself, or a host copy when CUDA tensors are staged."""
    if tensor.device.type == "cpu" or _core_cuda:
        return tensor
    return tensor.detach().to("cpu")


def _desc(t: torch.Tensor, code: int) -> Tuple[int, int, Tuple[int, ...]]:
    return (t.data_ptr(), code, tuple(t.shape))


_ps_id = _ops.process_set_id


def _register(
    handle: int, finish: Callable[[int], Any], keep: Any, label: str, device: int = -1
) -> int:
    _handle_map[handle] = (finish, keep, label, device)
    return handle


# ---- allreduce ---------------------------------------------------------------------------------
def _adasum_checks(tensor: torch.Tensor) -> None:
    # Horovod's refusals (a non-global set; the ranks, or with NCCL the hosts, not a power of 2;
    # uneven hosts) come from the core at enqueue, same types and messages (core/validate.cc).
    # Its warning for CUDA tensors without NCCL is Python's: the core then runs the CPU Adasum.
    if tensor.device.type != "cpu" and gpu_available("torch") and not nccl_built():
        warnings.warn(
            "Adasum reduction does not currently support GPU reduction using MPI. Tensors are "
            "copied to CPU memory instead. To use Adasum for GPU reduction, make NCCL available "
            "(the nvidia-nccl wheel, or BAGUA_HVD_NCCL_LIBRARY).",
            stacklevel=3,
        )


def _allreduce_async(
    tensor: torch.Tensor,
    output: torch.Tensor,
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    urgent: bool = False,
) -> int:
    if op == Adasum:
        _adasum_checks(tensor)
    code = _check(tensor, _ALLREDUCE_DTYPES)
    if code == _ops.BOOL:
        _check_bool_reduce(op, prescale_factor, postscale_factor)
    full_name = None if name is None else _ops.op_name("allreduce", name)
    if tensor.is_cpu:
        handle, keep = _ops.enqueue(
            _ops.OP_ALLREDUCE,
            ((tensor.data_ptr(), code, tuple(tensor.shape)),),
            ((output.data_ptr(), code, tuple(output.shape)),),
            name=full_name,
            process_set_id=_ps_id(process_set),
            reduce_op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            urgent=urgent,
        )
        return _register(handle, lambda h: output, (keep, tensor, output), full_name or "allreduce")
    return _grouped_allreduce_async(
        [tensor],
        [output],
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        urgent,
        prefix="allreduce",
        single=True,
    )


def host_allreduce_descs(
    tensors: Sequence[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float
) -> List[Tuple[int, int, Tuple[int, ...]]]:
    """The core's descriptions of host tensors for an in-place allreduce, checked as
    :func:`_grouped_allreduce_async` checks them: for a DistributedOptimizer's bucket, which
    calls ``ops.enqueue`` itself and hands the handle to :func:`track`."""
    codes = _allreduce_codes(tensors, op, prescale_factor, postscale_factor)
    return [_desc(t, c) for t, c in zip(tensors, codes)]


def _allreduce_codes(
    tensors: Sequence[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float
) -> List[int]:
    """The core's dtype codes of an allreduce's tensors, after Horovod's checks (dtype,
    contiguity, Adasum's GPU warning, bool's ops)."""
    codes = []
    for t in tensors:
        if op == Adasum:
            _adasum_checks(t)
        code = _check(t, _ALLREDUCE_DTYPES)
        if code == _ops.BOOL:
            _check_bool_reduce(op, prescale_factor, postscale_factor)
        codes.append(code)
    return codes


def _no_output(_handle: int) -> None:
    return None


def track(handle: int, keep: Any, label: str) -> int:
    """Makes a handle of an in-place request that the caller enqueued waitable with
    :func:`synchronize` (which returns None), keeping ``keep`` alive until then."""
    return _register(handle, _no_output, keep, label)


def bucket_allreduce_async(
    tensors: List[torch.Tensor],
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    urgent: bool = False,
) -> int:
    """The in-place allreduce of a DistributedOptimizer's bucket: one tensor, or several as one
    grouped request (``name`` without the ``"allreduce."`` prefix). Returns a handle for
    :func:`synchronize`."""
    if len(tensors) == 1:
        t = tensors[0]
        return _allreduce_async(
            t, t, name, op, prescale_factor, postscale_factor, process_set, urgent=urgent
        )
    return _grouped_allreduce_async(
        tensors, tensors, name, op, prescale_factor, postscale_factor, process_set, urgent=urgent
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an allreduce of ``tensor`` into a new tensor; returns a handle for synchronize().

    op: Average (default), Sum, Min, Max, Product or Adasum; ``average`` is the deprecated
    spelling. The result is ``postscale * reduce(prescale * tensor)`` (Average divides by the
    process set's size).
    """
    op = handle_average_backwards_compatibility(op, average)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _allreduce_async(
        tensor, output, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an in-place allreduce of ``tensor``; synchronize() returns ``tensor``."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(
        tensor, tensor, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place allreduce of ``tensor``; returns ``tensor``."""
    op = handle_average_backwards_compatibility(op, average)
    return synchronize(
        _allreduce_async(
            tensor, tensor, name, op, prescale_factor, postscale_factor, process_set, urgent=True
        )
    )


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce with a gradient: the backward pass allreduces the gradient the same way."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.average = average
        ctx.op = op
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        ctx.process_set = process_set
        op = handle_average_backwards_compatibility(op, average)
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return synchronize(
            _allreduce_async(
                tensor,
                output,
                name,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
                urgent=True,
            )
        )

    @staticmethod
    def backward(ctx, grad_output):
        return (
            allreduce(
                grad_output.contiguous(),
                average=ctx.average,
                op=ctx.op,
                prescale_factor=ctx.prescale_factor,
                postscale_factor=ctx.postscale_factor,
                process_set=ctx.process_set,
            ),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _needs_grad(tensors: Sequence[torch.Tensor]) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.requires_grad:
            return True
    return False


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Allreduces ``tensor`` across the process set and returns a new tensor (differentiable).

    ``compression`` (e.g. Compression.fp16) is applied around the communication.
    """
    if compression is NoneCompressor:  # the common case, without two no-op calls
        tensor_compressed, ctx = tensor, None
    else:
        tensor_compressed, ctx = compression.compress(tensor)
    if tensor_compressed.requires_grad and torch.is_grad_enabled():
        summed = HorovodAllreduce.apply(
            tensor_compressed, average, name, op, prescale_factor, postscale_factor, process_set
        )
    else:
        if average is not None or op is None:
            op = handle_average_backwards_compatibility(op, average)
        # A non-contiguous input is rejected before this output is used.
        output = torch.empty_like(tensor_compressed)
        summed = synchronize(
            _allreduce_async(
                tensor_compressed,
                output,
                name,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
                urgent=True,
            )
        )
    return summed if compression is NoneCompressor else compression.decompress(summed, ctx)


# ---- grouped allreduce -------------------------------------------------------------------------
def _as_tensor_list(tensors: Any, what: str) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise ValueError(f"{what} expects a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what} expects at least one tensor, got an empty list")
    return list(tensors)


def _grouped_allreduce_async(
    tensors: List[torch.Tensor],
    outputs: List[torch.Tensor],
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    urgent: bool = False,
    prefix: str = "grouped_allreduce",
    single: bool = False,
) -> int:
    codes = _allreduce_codes(tensors, op, prescale_factor, postscale_factor)
    device = _device_of_all(tensors)
    ins = [_host(t) for t in tensors]
    outs = [
        i if o is t else (_host(o) if o.device.type == "cpu" or _core_cuda else torch.empty_like(i))
        for t, o, i in zip(tensors, outputs, ins)
    ]
    full_name = _ops.op_name(prefix, name)
    handle, keep = _ops.enqueue(
        _ops.OP_ALLREDUCE,
        [_desc(t, c) for t, c in zip(ins, codes)],
        [_desc(t, c) for t, c in zip(outs, codes)],
        name=full_name,
        process_set_id=_ps_id(process_set),
        reduce_op=op,
        device=device,
        stream=_stream_of(device),
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        urgent=urgent,
    )

    def finish(h: int) -> Any:
        for o, staged in zip(outputs, outs):
            if staged is not o:
                o.copy_(staged)
        return outputs[0] if single else tuple(outputs)

    return _register(
        handle, finish, (keep, tensors, outputs, ins, outs), full_name or prefix, device
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts one fused allreduce of several tensors; synchronize() returns a tuple of outputs."""
    op = handle_average_backwards_compatibility(op, average)
    tensors = _as_tensor_list(tensors, "grouped_allreduce")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _grouped_allreduce_async(
        tensors, outputs, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts one fused in-place allreduce of several tensors."""
    op = handle_average_backwards_compatibility(op, average)
    tensors = _as_tensor_list(tensors, "grouped_allreduce_")
    return _grouped_allreduce_async(
        tensors, tensors, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Tuple[torch.Tensor, ...]:
    """Fused in-place allreduce of several tensors; returns them as a tuple."""
    op = handle_average_backwards_compatibility(op, average)
    tensors = _as_tensor_list(tensors, "grouped_allreduce_")
    return synchronize(
        _grouped_allreduce_async(
            tensors, tensors, name, op, prescale_factor, postscale_factor, process_set, urgent=True
        )
    )


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce with gradients (a grouped allreduce of the gradients)."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.average = average
        ctx.op = op
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        ctx.process_set = process_set
        op = handle_average_backwards_compatibility(op, average)
        tensors = list(tensors)
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        return synchronize(
            _grouped_allreduce_async(
                tensors,
                outputs,
                name,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
                urgent=True,
            )
        )

    @staticmethod
    def backward(ctx, *grad_output):
        grad_reduced = grouped_allreduce(
            [g.contiguous() for g in grad_output],
            average=ctx.average,
            op=ctx.op,
            prescale_factor=ctx.prescale_factor,
            postscale_factor=ctx.postscale_factor,
            process_set=ctx.process_set,
        )
        return (None, None, None, None, None, None, *grad_reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> List[torch.Tensor]:
    """Fused allreduce of several tensors; returns a list of new tensors (differentiable)."""
    tensors = _as_tensor_list(tensors, "grouped_allreduce")
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    if _needs_grad(compressed):
        summed = HorovodGroupedAllreduce.apply(
            average, name, op, prescale_factor, postscale_factor, process_set, *compressed
        )
    else:
        op = handle_average_backwards_compatibility(op, average)
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in compressed]
        summed = synchronize(
            _grouped_allreduce_async(
                list(compressed),
                outputs,
                name,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
                urgent=True,
            )
        )
    return [compression.decompress(t, c) for t, c in zip(summed, ctxs)]


# ---- sparse allreduce --------------------------------------------------------------------------
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Allreduces a sparse COO tensor via two allgathers ('<name>.indices', '<name>.values').

    Returns a callable that waits and returns the aggregated sparse tensor; Average divides the
    values by the process set's size. Only Sum and Average are meaningful for sparse tensors.
    """
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async expects a sparse COO tensor")
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"sparse_allreduce_async supports only Average and Sum, got "
            f"{_ops.REDUCE_OP_NAMES.get(op, op)}"
        )
    t = tensor
    # Allgather concatenates along dim 0: transpose the indices so rows are nonzeros.
    indices_handle = allgather_async(
        t._indices().transpose(0, 1).contiguous(),
        name=None if name is None else f"{name}.indices",
        process_set=process_set,
    )
    values_handle = allgather_async(
        t._values().contiguous(),
        name=None if name is None else f"{name}.values",
        process_set=process_set,
    )

    def handle() -> torch.Tensor:
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if op == Average:
            values = values / process_set.size()
        if indices.dim() == 0 or values.dim() == 0:
            return torch.zeros_like(t)
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size())

    return handle


# ---- allgather ---------------------------------------------------------------------------------
def _gather_like_async(
    op_type: int,
    prefix: str,
    tensors: List[torch.Tensor],
    name: str | None,
    process_set: ProcessSet,
    urgent: bool,
    single: bool,
    splits: List[int] | None = None,
    splits_like: torch.Tensor | None = None,
) -> int:
    """Allgather/alltoall: the core allocates the outputs; copy them out when done."""
    codes = [_check(t, _MOVE_DTYPES) for t in tensors]
    device = _device_of_all(tensors)
    ins = [_host(t) for t in tensors]
    full_name = _ops.op_name(prefix, name)
    ps_id = _ps_id(process_set)
    handle, keep = _ops.enqueue(
        op_type,
        [_desc(t, c) for t, c in zip(ins, codes)],
        None,
        name=full_name,
        process_set_id=ps_id,
        device=device,
        stream=_stream_of(device),
        splits=splits,
        urgent=urgent,
    )

    def finish(h: int) -> Any:
        outs = []
        for i, t in enumerate(tensors):
            shape = _ops.output_shape(h, i)
            on_device = t.device.type != "cpu" and _core_cuda
            out = torch.empty(shape, dtype=t.dtype, device=t.device if on_device else "cpu")
            if out.numel():
                _ops.output_copy(h, i, out.data_ptr(), _stream_of(device) if on_device else 0)
            if out.device != t.device:
                out = out.to(t.device)
            outs.append(out)
        if op_type == _ops.OP_ALLTOALL:
            rsplits = torch.tensor(_ops.received_splits(h), dtype=torch.int32)
            if splits_like is not None and splits_like.device != rsplits.device:
                rsplits = rsplits.to(splits_like.device)
            return outs[0], rsplits
        return outs[0] if single else tuple(outs)

    return _register(handle, finish, (keep, tensors, ins), full_name or prefix, device)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts an allgather (concatenation along dim 0 in process-set rank order)."""
    return _gather_like_async(
        _ops.OP_ALLGATHER, "allgather", [tensor], name, process_set, urgent=False, single=True
    )


def _dim0(t: torch.Tensor) -> int:
    return int(t.shape[0]) if t.dim() > 0 else 0


def _slice_offsets(dims: List[int], process_set: ProcessSet) -> List[int]:
    """This rank's row offset in each allgathered tensor, from every rank's dim-0 sizes."""
    gathered = allgather(torch.tensor([dims], dtype=torch.int64), process_set=process_set)
    r = process_set.rank()
    return [int(v) for v in gathered[:r].sum(dim=0).tolist()] if r else [0] * len(dims)


class HorovodAllgather(torch.autograd.Function):
    """Allgather with a gradient: average-allreduce the gradient and take this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = _dim0(tensor)
        ctx.process_set = process_set
        return synchronize(
            _gather_like_async(
                _ops.OP_ALLGATHER,
                "allgather",
                [tensor],
                name,
                process_set,
                urgent=True,
                single=True,
            )
        )

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        offset = _slice_offsets([ctx.dim], ctx.process_set)[0]
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenates every rank's tensor along dim 0 (other dims must match; differentiable)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return HorovodAllgather.apply(tensor, name, process_set)
    return synchronize(
        _gather_like_async(
            _ops.OP_ALLGATHER, "allgather", [tensor], name, process_set, urgent=True, single=True
        )
    )


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts one allgather of several tensors; synchronize() returns a tuple."""
    tensors = _as_tensor_list(tensors, "grouped_allgather")
    return _gather_like_async(
        _ops.OP_ALLGATHER,
        "grouped_allgather",
        tensors,
        name,
        process_set,
        urgent=False,
        single=False,
    )


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather with gradients."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [_dim0(t) for t in tensors]
        ctx.process_set = process_set
        return synchronize(
            _gather_like_async(
                _ops.OP_ALLGATHER,
                "grouped_allgather",
                list(tensors),
                name,
                process_set,
                urgent=True,
                single=False,
            )
        )

    @staticmethod
    def backward(ctx, *grad_output):
        grad_reduced = grouped_allreduce(
            [g.contiguous() for g in grad_output], op=Average, process_set=ctx.process_set
        )
        offsets = _slice_offsets(ctx.dims, ctx.process_set)
        grads = [g.narrow(0, off, d) for g, off, d in zip(grad_reduced, offsets, ctx.dims)]
        return (None, None, *grads)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> List[torch.Tensor]:
    """Allgathers several tensors in one operation; returns a list (differentiable)."""
    tensors = _as_tensor_list(tensors, "grouped_allgather")
    if _needs_grad(tensors):
        return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))
    return list(
        synchronize(
            _gather_like_async(
                _ops.OP_ALLGATHER,
                "grouped_allgather",
                tensors,
                name,
                process_set,
                urgent=True,
                single=False,
            )
        )
    )


# ---- broadcast ---------------------------------------------------------------------------------
def _broadcast_async(
    tensor: torch.Tensor,
    output: torch.Tensor,
    root_rank: int,
    name: str | None,
    process_set: ProcessSet,
    urgent: bool = False,
) -> int:
    code = _check(tensor, _MOVE_DTYPES)
    device = _device_of(tensor)
    src = _host(tensor)
    if output is tensor:
        dst = src
    elif output.device.type == "cpu" or _core_cuda:
        dst = output
    else:
        dst = torch.empty_like(src)
    full_name = _ops.op_name("broadcast", name)
    handle, keep = _ops.enqueue(
        _ops.OP_BROADCAST,
        ((src.data_ptr(), code, tuple(src.shape)),),
        ((dst.data_ptr(), code, tuple(dst.shape)),),
        name=full_name,
        process_set_id=_ps_id(process_set),
        root_rank=int(root_rank),
        device=device,
        stream=_stream_of(device),
        urgent=urgent,
    )
    if dst is output:
        finish = lambda h: output  # noqa: E731
    else:

        def finish(h: int) -> torch.Tensor:
            output.copy_(dst)
            return output

    return _register(
        handle, finish, (keep, tensor, output, src, dst), full_name or "broadcast", device
    )


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts a broadcast of ``root_rank``'s tensor into a new tensor (root_rank is global)."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _broadcast_async(tensor, output, root_rank, name, process_set)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an in-place broadcast of ``root_rank``'s tensor (root_rank is global)."""
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place broadcast from the global rank ``root_rank``; returns ``tensor``."""
    return synchronize(_broadcast_async(tensor, tensor, root_rank, name, process_set, urgent=True))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast with a gradient: average-allreduce, zero on every rank but the root."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return synchronize(
            _broadcast_async(tensor, output, root_rank, name, process_set, urgent=True)
        )

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad_reduced *= 0
        return grad_reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Returns ``root_rank``'s tensor on every rank of the set (differentiable)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return synchronize(_broadcast_async(tensor, output, root_rank, name, process_set, urgent=True))


# ---- alltoall ----------------------------------------------------------------------------------
def _splits_list(splits: Any) -> Tuple[List[int] | None, torch.Tensor | None]:
    if splits is None:
        return None, None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
        if splits.dim() != 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        return [int(v) for v in splits.cpu().tolist()], splits
    try:
        values = torch.tensor(list(splits), dtype=torch.int32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"alltoall splits must be a list of integers: {e}") from None
    if values.dim() != 1:
        raise ValueError("alltoall expects a 1D splits tensor")
    return [int(v) for v in values.tolist()], None


def _alltoall_async(tensor, splits, name, process_set, urgent=False) -> int:
    split_values, splits_like = _splits_list(splits)
    return _gather_like_async(
        _ops.OP_ALLTOALL,
        "alltoall",
        [tensor],
        name,
        process_set,
        urgent=urgent,
        single=True,
        splits=split_values,
        splits_like=splits_like,
    )


def alltoall_async(
    tensor: torch.Tensor,
    splits: Union[Sequence[int], torch.Tensor] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an alltoall; synchronize() returns ``(output, received_splits)``.

    splits: rows of dim 0 sent to each process-set rank (a list or a 1-D int32 tensor); None
    splits dim 0 evenly (it must be a multiple of the set's size).
    """
    return _alltoall_async(tensor, splits, name, process_set)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall with a gradient: an alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = synchronize(
            _alltoall_async(tensor, splits, name, process_set, urgent=True)
        )
        ctx.process_set = process_set
        ctx.recvsplits = received_splits
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, *dead_gradients):
        grad_wrt_tensor, _ = alltoall(
            grad_output.contiguous(), splits=ctx.recvsplits, process_set=ctx.process_set
        )
        return grad_wrt_tensor, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Union[Sequence[int], torch.Tensor] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Scatters slices of dim 0 to every rank and gathers theirs (differentiable).

    Returns the output, or ``(output, received_splits)`` when ``splits`` is given.
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        return HorovodAlltoall.apply(tensor, splits, name, process_set)
    output, received_splits = synchronize(
        _alltoall_async(tensor, splits, name, process_set, urgent=True)
    )
    return output if splits is None else (output, received_splits)


# ---- reducescatter -----------------------------------------------------------------------------
def _reducescatter_async(
    tensors: List[torch.Tensor],
    name: str | None,
    op: int,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
    urgent: bool,
    prefix: str,
    single: bool,
) -> int:
    codes = [_check(t, _REDUCE_DTYPES) for t in tensors]
    ps_id = _ps_id(process_set)
    set_size = _ops.process_set_size(ps_id)
    set_rank = _ops.process_set_rank(ps_id)
    device = _device_of_all(tensors)
    ins = [_host(t) for t in tensors]
    outs = []
    for t in ins:
        if t.dim() == 0:
            rows_shape: Tuple[int, ...] = ()
        else:
            rows = (
                _ops.reducescatter_rows(t.shape[0], set_size, set_rank)
                if set_size > 0 and set_rank >= 0
                else 0
            )
            rows_shape = (rows, *t.shape[1:])
        outs.append(torch.empty(rows_shape, dtype=t.dtype, device=t.device))
    full_name = _ops.op_name(prefix, name)
    handle, keep = _ops.enqueue(
        _ops.OP_REDUCESCATTER,
        [_desc(t, c) for t, c in zip(ins, codes)],
        [_desc(t, c) for t, c in zip(outs, codes)],
        name=full_name,
        process_set_id=ps_id,
        reduce_op=op,
        device=device,
        stream=_stream_of(device),
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        urgent=urgent,
    )

    def finish(h: int) -> Any:
        results = [o if o.device == t.device else o.to(t.device) for o, t in zip(outs, tensors)]
        return results[0] if single else tuple(results)

    return _register(handle, finish, (keep, tensors, ins, outs), full_name or prefix, device)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter: reduce across ranks, each rank keeps its slice of dim 0.

    Ranks ``0 .. dim0 % size - 1`` of the set receive one extra row. op: Average or Sum.
    """
    return _reducescatter_async(
        [tensor],
        name,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
        urgent=False,
        prefix="reducescatter",
        single=True,
    )


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter with a gradient: allgather the gradient (scaled as Horovod does)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op = op
        ctx.process_set = process_set
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        return synchronize(
            _reducescatter_async(
                [tensor],
                name,
                op,
                process_set,
                prescale_factor,
                postscale_factor,
                urgent=True,
                prefix="reducescatter",
                single=True,
            )
        )

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allgather(grad_output.contiguous(), process_set=ctx.process_set)
        return _scale_rs_grad(ctx, grad_reduced), None, None, None, None, None


def _scale_rs_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    if ctx.op == Sum:
        grad *= ctx.process_set.size()
    if ctx.prescale_factor != 1.0:
        grad *= ctx.prescale_factor
    if ctx.postscale_factor != 1.0:
        grad *= ctx.postscale_factor
    return grad


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduces ``tensor`` across the set and returns this rank's slice of dim 0
    (differentiable)."""
    tensor_compressed, ctx = compression.compress(tensor)
    if tensor_compressed.requires_grad and torch.is_grad_enabled():
        out = HorovodReducescatter.apply(
            tensor_compressed, name, op, process_set, prescale_factor, postscale_factor
        )
    else:
        out = synchronize(
            _reducescatter_async(
                [tensor_compressed],
                name,
                op,
                process_set,
                prescale_factor,
                postscale_factor,
                urgent=True,
                prefix="reducescatter",
                single=True,
            )
        )
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts one fused reducescatter of several tensors; synchronize() returns a tuple."""
    tensors = _as_tensor_list(tensors, "grouped_reducescatter")
    return _reducescatter_async(
        tensors,
        name,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
        urgent=False,
        prefix="grouped_reducescatter",
        single=False,
    )


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter with gradients (a grouped allgather of the gradients)."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op = op
        ctx.process_set = process_set
        ctx.prescale_factor = prescale_factor
        ctx.postscale_factor = postscale_factor
        return synchronize(
            _reducescatter_async(
                list(tensors),
                name,
                op,
                process_set,
                prescale_factor,
                postscale_factor,
                urgent=True,
                prefix="grouped_reducescatter",
                single=False,
            )
        )

    @staticmethod
    def backward(ctx, *grad_output):
        grads = grouped_allgather(
            [g.contiguous() for g in grad_output], process_set=ctx.process_set
        )
        return (None, None, None, None, None, *[_scale_rs_grad(ctx, g) for g in grads])


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[torch.Tensor]:
    """Fused reducescatter of several tensors; returns a list (differentiable)."""
    tensors = _as_tensor_list(tensors, "grouped_reducescatter")
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    if _needs_grad(compressed):
        outs = HorovodGroupedReducescatter.apply(
            name, op, process_set, prescale_factor, postscale_factor, *compressed
        )
    else:
        outs = synchronize(
            _reducescatter_async(
                list(compressed),
                name,
                op,
                process_set,
                prescale_factor,
                postscale_factor,
                urgent=True,
                prefix="grouped_reducescatter",
                single=False,
            )
        )
    return [compression.decompress(t, c) for t, c in zip(outs, ctxs)]


# ---- handles, join, barrier ----------------------------------------------------------------
def poll(handle: int) -> bool:
    """True when the asynchronous operation behind ``handle`` has finished."""
    return _ops.poll(handle)


def synchronize(handle: int) -> Any:
    """Waits for an asynchronous operation and returns its output.

    Returns a tensor; ``(output, received_splits)`` for alltoall; a tuple for grouped ops; and
    None for an unknown handle. Failures raise HorovodInternalError (cross-rank mismatch, lost
    peer, shutdown) or ValueError/NotImplementedError; a handle that shutdown() cleared raises
    Horovod's ValueError.
    """
    if handle in _cleared_handles:
        _cleared_handles.discard(handle)
        _handle_map.pop(handle, None)
        _ops.release(handle)
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    entry = _handle_map.get(handle)
    if entry is None:
        return None
    try:
        _ops.wait(handle, entry[2])
    except KeyboardInterrupt:
        raise  # still in flight: the entry keeps its memory alive; synchronize again later
    except RuntimeError as e:
        _handle_map.pop(handle, None)
        _ops.release(handle)
        if isinstance(e, HorovodInternalError):
            raise
        raise HorovodInternalError(e) from e
    except BaseException:
        _handle_map.pop(handle, None)
        _ops.release(handle)
        raise
    _handle_map.pop(handle, None)
    try:
        if entry[3] >= 0:
            # The results are written on the core's stream: torch's current stream waits there.
            _ops.stream_wait(handle, _stream_of(entry[3]))
        return entry[0](handle)
    finally:
        _ops.release(handle)


def join(device: int = -1) -> int:
    """Signals that this rank has no more data; blocks until every rank has joined.

    While joined, this rank contributes zeros to other ranks' allreduces. Returns the global
    rank that joined last. ``device`` is where temporary zero tensors live (-1: CPU).
    """
    handle, keep = _ops.enqueue(
        _ops.OP_JOIN, (), None, device=device if _core_cuda else -1, urgent=True
    )
    _register(handle, lambda h: _ops.join_result(h), keep, "join")
    return int(synchronize(handle))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every rank of the process set has reached the barrier."""
    handle, keep = _ops.enqueue(
        _ops.OP_BARRIER, (), None, process_set_id=_ps_id(process_set), urgent=True
    )
    _register(handle, lambda h: None, keep, "barrier")
    synchronize(handle)
