"""Collective operations on TensorFlow tensors (``horovod.tensorflow.mpi_ops``).

TensorFlow tensors reach the framework-free core in two ways (docs/tensorflow.md). Inside
``tf.function`` the collectives are asynchronous kernels (kernels.py) that hand the tensors'
buffers to the core and complete from its callback. Eagerly, the tensor's host buffer
(``np.asarray``) is handed to the core and the result is wrapped into a new tensor; where the
kernels cannot be built, graph mode runs the same code in a ``tf.numpy_function``. Graph-mode
collectives are stateful ops, so ``tf.function``'s automatic control dependencies keep them in
program order on every rank. Every op is complete when its result can be read.

Names: an op given ``name=`` is ``"<op>.<name>"`` in the core (inside a graph the name is
made unique and prefixed by the name scope unless ``ignore_name_scope``). Unnamed eager ops are
numbered per op type and process set (``"allreduce.HorovodAllreduce.eager.<n>"``): Horovod's
eager kernels all carry their op type's name, so they match in call order within a set, also
where a rank skips the ops of a set it is not in; unnamed graph ops are named at trace time
``HorovodAllreduce``, ``HorovodAllreduce_1``, ... (unique in the graph, in trace order), so
every rank that traced the same function uses the same names. (Horovod appends the input
tensor's name, but tensors that a tf.function captures have process-dependent names.)

Supported dtypes (CPU tensors): allreduce/reducescatter: uint8, int8, int16, int32, int64,
float16, bfloat16, float32, float64; allgather/broadcast/alltoall: also bool and uint16.

Errors: invalid arguments raise ``tf.errors.InvalidArgumentError``; mismatches between ranks
(shape, dtype, op, root) raise ``tf.errors.FailedPreconditionError`` on every rank, with
Horovod's message, eagerly and inside ``tf.function`` (where the kernels fail with the core's
status, or BaguaHvdRaise fails with the status a numpy_function callback returned). Without the
kernels, graph-mode cross-rank errors surface as ``tf.errors.UnknownError`` whose message
contains ``FailedPreconditionError: <Horovod's message>`` (see docs/tensorflow.md).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record as _record

import bagua_hvd.tensorflow.kernels as _kernels
from bagua_hvd.common import config
from bagua_hvd.common import frontend as _frontend
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.basics import after_init as _after_init
from bagua_hvd.common.exceptions import HorovodInternalError
from bagua_hvd.common.primitives import Errors
from bagua_hvd.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from bagua_hvd.common.util import num_rank_is_power_2

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "HorovodInternalError", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "init", "shutdown",
    "is_homogeneous",
    "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op",
    "allreduce_dense", "grouped_allreduce_dense", "allgather", "grouped_allgather",
    "broadcast", "broadcast_", "alltoall", "reducescatter_dense", "grouped_reducescatter_dense",
    "join", "barrier",
    *_frontend.__all__,  # the basics
]  # fmt: skip

from bagua_hvd.common.frontend import *  # noqa: F403  (Horovod's basics, re-exported)
from bagua_hvd.common.frontend import basics as _basics  # noqa: F401  (Horovod's tests read it)
from bagua_hvd.common.frontend import (  # noqa: F401  (Horovod's mpi_ops exports)
    check_num_rank_power_of_2,
    handle_average_backwards_compatibility,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    rocm_built,
    shutdown,
    size,
)
from bagua_hvd.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401

# ---- dtypes ------------------------------------------------------------------------------------
_TF_CODES: Dict[tf.DType, int] = {
    tf.uint8: _ops.UINT8,
    tf.int8: _ops.INT8,
    tf.uint16: _ops.UINT16,
    tf.int16: _ops.INT16,
    tf.int32: _ops.INT32,
    tf.int64: _ops.INT64,
    tf.float16: _ops.FLOAT16,
    tf.bfloat16: _ops.BFLOAT16,
    tf.float32: _ops.FLOAT32,
    tf.float64: _ops.FLOAT64,
    tf.bool: _ops.BOOL,
}
_NP_CODES: Dict[np.dtype, int] = {np.dtype(d.as_numpy_dtype): c for d, c in _TF_CODES.items()}
_REDUCE_CODES = frozenset(c for c in _TF_CODES.values() if c not in (_ops.BOOL, _ops.UINT16))
_MOVE_CODES = frozenset(_TF_CODES.values())

# Core status -> TensorFlow error class (Horovod's ToTFStatus).
_STATUS_ERRORS = {
    _ops.INVALID_ARGUMENT: tf.errors.InvalidArgumentError,
    _ops.PRECONDITION_ERROR: tf.errors.FailedPreconditionError,
    _ops.ABORTED: tf.errors.AbortedError,
    _ops.NOT_IMPLEMENTED: tf.errors.UnimplementedError,
    _ops.TIMED_OUT: tf.errors.DeadlineExceededError,
    _ops.NOT_INITIALIZED: tf.errors.FailedPreconditionError,  # Horovod's class for it
}
# At submission (Horovod's enqueue path): a refusal by the core that is not a bad argument or a
# missing feature fails a precondition.
_ENQUEUE_ERRORS = {
    _ops.INVALID_ARGUMENT: tf.errors.InvalidArgumentError,
    _ops.NOT_IMPLEMENTED: tf.errors.UnimplementedError,
}

# Arrays the core may still touch after an interrupted wait: never freed.
_abandoned: List[Any] = []


def _executing_eagerly() -> bool:
    """Horovod's helper: whether TensorFlow runs eagerly here."""
    return tf.executing_eagerly()


def _tf_error(status: int, message: str) -> tf.errors.OpError:
    return _STATUS_ERRORS.get(status, tf.errors.UnknownError)(None, None, message)


def _check_dtype(dtype: tf.DType, allowed: frozenset) -> None:
    code = _TF_CODES.get(dtype)
    if code is None or code not in allowed:
        raise tf.errors.InvalidArgumentError(
            None, None, f"Tensor type {dtype.name} is not supported."
        )


_ps_id = _ops.process_set_id


def process_set_size(process_set: ProcessSet) -> int:
    """The number of ranks in ``process_set`` (0 for an unknown set)."""
    return size() if process_set.process_set_id == 0 else int(process_set.size() or 0)


def traced_set_size(process_set: ProcessSet) -> Any:
    """The set's size for a computation that may be traced: under ``HOROVOD_ELASTIC=1`` in a
    graph, :func:`size_op` (read when the graph runs: a reset may change it after the trace,
    Horovod's rule), else the int."""
    if config.elastic() and not tf.executing_eagerly():
        return size_op(_ps_id(process_set))
    return process_set_size(process_set)


def numpy_dtype_code(a: np.ndarray) -> int:
    """The core's dtype code of a numpy array; InvalidArgumentError for an unsupported type."""
    code = _NP_CODES.get(a.dtype)
    if code is None:
        raise tf.errors.InvalidArgumentError(None, None, f"Tensor type {a.dtype} is not supported.")
    return code


class TFErrors(Errors):
    """Core failures as TensorFlow errors (Horovod's ToTFStatus)."""

    def enqueue(self, error: ValueError) -> Exception:
        return tf.errors.InvalidArgumentError(None, None, str(error))

    def enqueue_status(self, status: int, message: str) -> Exception:
        return _ENQUEUE_ERRORS.get(status, tf.errors.FailedPreconditionError)(None, None, message)

    def status(self, status: int, message: str) -> Exception:
        return _tf_error(status, message)

    def timeout(self, error: HorovodInternalError) -> Exception:
        return tf.errors.DeadlineExceededError(None, None, str(error))

    def failed(self, what: str, status: int) -> str:
        return f"{what} failed"


#: how the TensorFlow frontend raises the core's failures
TF_ERRORS = TFErrors()


# ---- the numpy-level collective ----------------------------------------------------------------
# TensorFlow wraps a numpy array returned by a numpy_function (and converts one eagerly) without
# a copy only when its data is aligned to Eigen's maximum alignment (at most 64 bytes); numpy's
# own allocations are 16-byte aligned, which cost a full copy of every output (8 ms per 100 MB
# here). Outputs are therefore carved out of a slightly larger buffer at a 64-byte boundary.
_ALIGN = 64
# Inside tf.function the callback runs on TensorFlow's inter-op threads, whose glibc arenas give
# large freed blocks back to the system: every step's fresh outputs were page-faulted and zeroed
# anew (~2,000-3,000 faults and tens of ms per 100 MB step on 2 cores). Outputs of at least
# _POOL_MIN_BYTES therefore come from a pool of buffers that return to it, by exact size, when
# the last array or TF tensor using them is gone; at most _POOL_MAX_BYTES stay idle there.
_POOL_MIN_BYTES = 64 << 10
_POOL_MAX_BYTES = 1 << 30
_pool: Dict[int, List[np.ndarray]] = {}
_pool_bytes = [0]  # idle bytes in _pool


class _PooledBlock:
    """The owner (numpy ``base``) of a pooled output: an ``__array_interface__`` over part of a
    pooled buffer; when it is collected the buffer goes back to the pool."""

    __slots__ = ("__array_interface__", "raw", "__weakref__")

    def __init__(self, raw: np.ndarray, offset: int, shape: Tuple[int, ...], dtype: np.dtype):
        self.raw = raw
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "descr": dtype.descr,
            "data": (raw.ctypes.data + offset, False),
            "strides": None,
            "version": 3,
        }


def _give_back(raw: np.ndarray) -> None:
    if _pool_bytes[0] + raw.nbytes > _POOL_MAX_BYTES:
        return  # freed
    _pool.setdefault(raw.nbytes, []).append(raw)
    _pool_bytes[0] += raw.nbytes


def _empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data is _ALIGN-byte aligned (pooled if large)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _POOL_MIN_BYTES or dtype.hasobject:
        buf = np.empty(nbytes + _ALIGN, np.uint8)
        offset = -buf.ctypes.data % _ALIGN
        return buf[offset : offset + nbytes].view(dtype).reshape(shape)
    free = _pool.get(nbytes + _ALIGN)
    try:
        raw = free.pop()  # type: ignore[union-attr]
        _pool_bytes[0] -= raw.nbytes
    except (AttributeError, IndexError):  # no list, or an empty one
        raw = np.empty(nbytes + _ALIGN, np.uint8)
    block = _PooledBlock(raw, -raw.ctypes.data % _ALIGN, shape, dtype)
    weakref.finalize(block, _give_back, raw).atexit = False  # nothing to pool at exit
    return np.asarray(block)


def _enqueue(op_type: int, descs: list, outs: list | None, **kw: Any) -> Tuple[int, Any]:
    try:
        return _ops.enqueue(op_type, descs, outs, status_error=TF_ERRORS.enqueue_status, **kw)
    except ValueError as e:  # the checks made before the core
        raise TF_ERRORS.enqueue(e) from None


def _wait(handle: int, what: str) -> None:
    try:
        status = _ops.wait_status(handle, what)
    except HorovodInternalError as e:  # BAGUA_HVD_OP_TIMEOUT_SECONDS ran out
        raise TF_ERRORS.timeout(e) from None
    if status != _ops.OK:
        raise _tf_error(status, _ops.failure_message(handle, TF_ERRORS.failed(what, status)))


def _collective(
    op_type: int,
    arrays: Sequence[np.ndarray],
    *,
    what: str,
    name: str | None,
    ps_id: int,
    reduce_op: int = Sum,
    root_rank: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    splits: List[int] | None = None,
) -> Tuple[List[np.ndarray], List[int] | None]:
    """Runs one (possibly grouped) collective on host arrays; returns (outputs, rsplits)."""
    # (np.ascontiguousarray would turn 0-d arrays into 1-d ones; a numpy_function hands 0-d
    # tensors over as numpy scalars, which np.asarray makes 0-d arrays again)
    ins = [np.asarray(a) for a in arrays]
    ins = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in ins]
    codes = [numpy_dtype_code(a) for a in ins]
    outs: List[np.ndarray] | None
    if op_type in (_ops.OP_ALLREDUCE, _ops.OP_BROADCAST):
        outs = [_empty(a.shape, a.dtype) for a in ins]
    elif op_type == _ops.OP_REDUCESCATTER:
        set_size = _ops.process_set_size(ps_id)
        set_rank = _ops.process_set_rank(ps_id)
        outs = []
        for a in ins:
            if a.ndim == 0:
                outs.append(_empty((), a.dtype))
                continue
            ok = set_size > 0 and set_rank >= 0
            rows = _ops.reducescatter_rows(a.shape[0], set_size, set_rank) if ok else 0
            outs.append(_empty((rows, *a.shape[1:]), a.dtype))
    else:
        outs = None
    descs = [(a.ctypes.data if a.size else 0, c, a.shape) for a, c in zip(ins, codes)]
    odescs = (
        None
        if outs is None
        else [(o.ctypes.data if o.size else 0, c, o.shape) for o, c in zip(outs, codes)]
    )
    handle, keep = _enqueue(
        op_type,
        descs,
        odescs,
        name=name,
        process_set_id=ps_id,
        reduce_op=reduce_op,
        root_rank=root_rank,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        splits=splits,
        urgent=True,
    )
    rsplits = None
    try:
        _wait(handle, name or what)
        if outs is None:
            outs = []
            for i, a in enumerate(ins):
                out = _empty(_ops.output_shape(handle, i), a.dtype)
                if out.size:
                    _ops.output_copy(handle, i, out.ctypes.data)
                outs.append(out)
        if op_type == _ops.OP_ALLTOALL:
            rsplits = _ops.received_splits(handle)
    except KeyboardInterrupt:
        _abandoned.append((keep, ins, outs))  # still in flight: keep its memory alive
        raise
    _ops.release(handle)
    return outs, rsplits


# ---- eager / graph dispatch --------------------------------------------------------------------
def _graph_callback(fn: Callable[..., List[np.ndarray]]) -> Callable[..., List[np.ndarray]]:
    """Wraps ``fn`` for tf.numpy_function. TensorFlow maps a Python ValueError raised by the
    callback to InvalidArgumentError and NotImplementedError to UnimplementedError; other
    errors become UnknownError carrying the original class name and message."""

    @tf.autograph.experimental.do_not_convert
    def run(*arrays: np.ndarray) -> List[np.ndarray]:
        try:
            return fn(*arrays)
        except tf.errors.InvalidArgumentError as e:
            raise ValueError(e.message) from None
        except tf.errors.UnimplementedError as e:
            raise NotImplementedError(e.message) from None

    return run


def _status_callback(
    fn: Callable[..., List[np.ndarray]], out_dtypes: Sequence[tf.DType]
) -> Callable[..., List[Any]]:
    """Wraps ``fn`` for tf.numpy_function with two more outputs: the status code and message
    of a ``tf.errors.OpError`` it raised (0 and b"" on success; empty outputs then)."""

    @tf.autograph.experimental.do_not_convert
    def run(*arrays: np.ndarray) -> List[Any]:
        try:
            outs = list(fn(*arrays))
        except tf.errors.OpError as e:
            empty = [np.zeros((0,), d.as_numpy_dtype) for d in out_dtypes]
            return empty + [np.int32(e.error_code), e.message.encode()]
        return outs + [np.int32(0), b""]

    return run


# Whether the collectives in a graph use the kernels when built
# (tests and bench/train.py switch it off to run the numpy_function path beside it).
_collective_kernel = [True]


def execute(
    fn: Callable[..., List[np.ndarray]],
    inputs: Sequence[tf.Tensor],
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[Any],
    kernel: Callable[[Any, List[tf.Tensor]], Sequence[tf.Tensor]] | None = None,
) -> List[tf.Tensor]:
    """Runs ``fn`` (numpy arrays in, numpy arrays out) on the inputs' values: eagerly, or in a
    graph as ``kernel(ops, inputs)`` (one of the library's asynchronous kernels) where given
    and built, else as a stateful numpy_function whose TensorFlow errors fail the step."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(o) for o in fn(*[np.asarray(t) for t in inputs])]
    ops = _kernels.load()
    if ops is None:
        outs = tf.numpy_function(_graph_callback(fn), list(inputs), list(out_dtypes), stateful=True)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    elif kernel is not None and _collective_kernel[0]:
        outs = list(kernel(ops, list(inputs)))
    else:
        # The callback returns its status (code, message) beside the outputs; BaguaHvdRaise
        # fails the step with it, before anything can read the outputs.
        outs = tf.numpy_function(
            _status_callback(fn, out_dtypes),
            list(inputs),
            list(out_dtypes) + [tf.int32, tf.string],
            stateful=True,
        )
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        raised = ops.bagua_hvd_raise(outs[-2], outs[-1])
        with tf.control_dependencies([raised]):
            outs = [tf.identity(o) for o in outs[:-2]]
    for o, shape in zip(outs, out_shapes):
        if shape is not None:
            o.set_shape(shape)
    return outs


def _graph_paths(
    op_type: int, what: str, core_name: str | None, ps_id: int, **params: Any
) -> Tuple[Callable[..., List[np.ndarray]], Callable[[Any, List[tf.Tensor]], Sequence[tf.Tensor]]]:
    """Both ways of running one (grouped) allreduce, broadcast, allgather or reducescatter, from
    one description: the numpy-level function (eager, numpy_function) and the kernel call.
    ``params``: reduce_op, root_rank, prescale_factor, postscale_factor (the core's and the
    kernels' names alike)."""
    # Horovod's TF ops take the factors as float attributes: every path rounds them to float32
    # as the kernel's attributes do, so a float64 tensor is scaled as in Horovod.
    if "prescale_factor" in params:
        _ops.check_scale_factors(params["prescale_factor"], params["postscale_factor"])
    for key in ("prescale_factor", "postscale_factor"):
        if key in params:
            params[key] = float(np.float32(params[key]))

    def fn(*arrays: np.ndarray) -> List[np.ndarray]:
        return _collective(op_type, arrays, what=what, name=core_name, ps_id=ps_id, **params)[0]

    def kernel(ops: Any, ins: List[tf.Tensor]) -> Sequence[tf.Tensor]:
        attrs = dict(core_name=core_name or "", process_set_id=ps_id, **params)
        if op_type == _ops.OP_ALLGATHER:
            return ops.bagua_hvd_allgather(ins, **attrs)
        if op_type == _ops.OP_REDUCESCATTER:
            return ops.bagua_hvd_reducescatter(ins, **attrs)
        return ops.bagua_hvd_collective(ins, op_type=op_type, **attrs)

    return fn, kernel


# Unnamed eager ops per (process set's ranks, op label), counted from hvd.init() (an elastic
# reset starts every rank's count again).
_eager_counts: Dict[Tuple[Tuple[int, ...], str], int] = {}
_after_init(_eager_counts.clear)


def _core_name(
    prefix: str,
    name: str | None,
    tensor: Any,
    op_label: str,
    ignore_name_scope: bool,
    process_set: ProcessSet,
) -> str | None:
    """The core's name for an op (see the module docstring)."""
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be a str, got {type(name).__name__}")
    if tf.executing_eagerly():
        if name is not None:
            return f"{prefix}.{name}"
        # Horovod's eager kernels are all named after their op type (TensorFlow names an eager
        # node after its op), so unnamed eager ops match in call order per op type and process
        # set: a rank that skips an op of a set it is not in stays in step with the others.
        # Keyed by the set's ranks, not its id: Horovod reuses a removed set's id.
        key = (tuple(process_set.ranks or ()), op_label)
        n = _eager_counts.get(key, 0)
        _eager_counts[key] = n + 1
        return f"{prefix}.{op_label}.eager.{n}"
    # Not Horovod's "<label>_<tensor name>": names of tensors captured by a tf.function
    # differ between processes; the trace order, and so graph.unique_name, does not.
    base = name if name is not None else op_label
    graph = tf.compat.v1.get_default_graph()
    if ignore_name_scope:
        with graph.name_scope(None):
            unique = graph.unique_name(base)
    else:
        unique = graph.unique_name(base)
    return f"{prefix}.{unique}"


def _needs_tape(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether a gradient must be recorded (always inside a graph: tracing is a one-off)."""
    if not tf.executing_eagerly():
        return True
    return any(t.dtype.is_floating for t in tensors) and _record.should_record_backprop(tensors)


def as_tensor(t: Any) -> tf.Tensor:
    if isinstance(t, tf.Variable):
        return t.read_value() if tf.executing_eagerly() else tf.identity(t)
    return tf.convert_to_tensor(t)


def _as_list(tensors: Any, what: str) -> List[tf.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(f"{what} expects a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what} expects at least one tensor, got an empty list")
    return [as_tensor(t) for t in tensors]


def _differentiable(
    forward: Callable[[List[tf.Tensor]], Tuple[List[tf.Tensor], Callable[..., Any]]],
    tensors: List[tf.Tensor],
) -> List[tf.Tensor]:
    """Runs ``forward(tensors) -> (outputs, grad_fn)`` under tf.custom_gradient when a
    gradient may be needed; ``grad_fn(*upstream) -> list of input gradients``."""
    if not _needs_tape(tensors):
        return forward(tensors)[0]

    @tf.custom_gradient
    def op(*xs: tf.Tensor) -> Any:
        outs, grad_fn = forward(list(xs))
        return outs, grad_fn

    result = op(*tensors)
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _zeros_if_none(dys: Sequence[Any], like: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    return [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, like)]


# ---- allreduce ---------------------------------------------------------------------------------
def _adasum_checks(process_set: ProcessSet) -> None:
    if _ps_id(process_set) != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if not num_rank_is_power_2(size()):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")


def grouped_allreduce_dense(
    tensors: Sequence[tf.Tensor],
    op: int = Sum,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prefix: str = "grouped_allreduce",
) -> List[tf.Tensor]:
    """Allreduce of dense tensors in one core request; the gradient is the same allreduce of
    the upstream gradients (Horovod's _allreduce_grad)."""
    tensors = [as_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype, _REDUCE_CODES)
    if op == Adasum:
        _adasum_checks(process_set)
    label = "HorovodAllreduce" if prefix == "allreduce" else "HorovodGroupedAllreduce"

    def forward(xs: List[tf.Tensor]) -> Tuple[List[tf.Tensor], Callable[..., Any]]:
        ps_id = _ps_id(process_set)
        core_name = _core_name(prefix, name, xs[0], label, ignore_name_scope, process_set)

        fn, kernel = _graph_paths(
            _ops.OP_ALLREDUCE, prefix, core_name, ps_id, reduce_op=op,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        )  # fmt: skip
        outs = execute(fn, xs, [x.dtype for x in xs], [x.shape for x in xs], kernel)

        def grad(*dys: Any) -> List[tf.Tensor]:
            return grouped_allreduce_dense(
                _zeros_if_none(dys, outs),
                op=op,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                process_set=process_set,
                ignore_name_scope=ignore_name_scope,
                prefix=prefix,
            )

        return outs, grad

    return _differentiable(forward, tensors)


def allreduce_kernel(
    tensors: Sequence[tf.Tensor],
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    ignore_name_scope: bool,
) -> Tuple[Any, Dict[str, Any]] | None:
    """For a caller in a graph that adds the kernel itself (the tapes' and the distributed
    optimizers' gradients, so that a gradient reaches the core in as few calls as Horovod's:
    docs/design-core.md): the op module and the attributes of one ``BaguaHvdCollective``
    allreduce of ``tensors``, named and checked as :func:`grouped_allreduce_dense` names and
    checks them; None where that runs another way (eagerly; without the kernel library or its
    collectives). The op's gradient is the same allreduce (:func:`_collective_gradient`)."""
    if tf.executing_eagerly() or not _collective_kernel[0]:
        return None
    ops = _kernels.load()
    if ops is None:
        return None
    for t in tensors:
        _check_dtype(t.dtype, _REDUCE_CODES)
    if op == Adasum:
        _adasum_checks(process_set)
    _ops.check_scale_factors(prescale_factor, postscale_factor)
    label = "HorovodGroupedAllreduce"
    attrs = dict(
        op_type=_ops.OP_ALLREDUCE,
        core_name=_core_name(
            "grouped_allreduce", None, None, label, ignore_name_scope, process_set
        ),
        process_set_id=_ps_id(process_set),
        reduce_op=op,
        prescale_factor=float(np.float32(prescale_factor)),
        postscale_factor=float(np.float32(postscale_factor)),
    )
    return ops, attrs


@tf.RegisterGradient("BaguaHvdCollective")
def _collective_gradient(op: Any, *dys: Any) -> List[tf.Tensor]:
    """The gradient of a kernel added by :func:`allreduce_kernel`'s callers (elsewhere the
    kernel runs under tf.custom_gradient, which takes precedence): the same allreduce of the
    upstream gradients (Horovod's _allreduce_grad)."""
    if op.get_attr("op_type") != _ops.OP_ALLREDUCE:
        raise LookupError(f"No gradient defined for operation '{op.name}' (a {op.type} that is "
                          "not an allreduce)")  # fmt: skip
    label = "HorovodGroupedAllreduce"
    outs = _kernels.load().bagua_hvd_collective(
        _zeros_if_none(dys, op.outputs),
        op_type=_ops.OP_ALLREDUCE,
        core_name=_core_name("grouped_allreduce", None, None, label, False, global_process_set),
        process_set_id=op.get_attr("process_set_id"),
        reduce_op=op.get_attr("reduce_op"),
        prescale_factor=op.get_attr("prescale_factor"),
        postscale_factor=op.get_attr("postscale_factor"),
    )
    for o, x in zip(outs, op.inputs):
        o.set_shape(x.shape)
    return list(outs)


def allreduce_dense(
    tensor: tf.Tensor,
    op: int = Sum,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> tf.Tensor:
    """Allreduce of one dense tensor (Horovod's ``_allreduce``; default op Sum)."""
    return grouped_allreduce_dense(
        [tensor], op, prescale_factor, postscale_factor, name, process_set, ignore_name_scope,
        prefix="allreduce",
    )[0]  # fmt: skip


# ---- allgather ---------------------------------------------------------------------------------
def _set_rank(process_set: ProcessSet) -> int:
    return rank() if _ps_id(process_set) == 0 else process_set.rank()


def grouped_allgather(
    tensors: Sequence[tf.Tensor],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
    _prefix: str = "grouped_allgather",
) -> List[tf.Tensor]:
    """Concatenates every rank's tensors along dim 0 (one core request; differentiable: the
    gradient is this rank's rows of the Average-allreduced upstream gradient, Horovod's
    _allgather_grad)."""
    tensors = _as_list(tensors, "grouped_allgather") if _prefix != "allgather" else tensors
    for t in tensors:
        _check_dtype(t.dtype, _MOVE_CODES)
    label = "HorovodAllgather" if _prefix == "allgather" else "HorovodGroupedAllgather"

    def forward(xs: List[tf.Tensor]) -> Tuple[List[tf.Tensor], Callable[..., Any]]:
        ps_id = _ps_id(process_set)
        core_name = _core_name(_prefix, name, xs[0], label, ignore_name_scope, process_set)

        fn, kernel = _graph_paths(_ops.OP_ALLGATHER, _prefix, core_name, ps_id)
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else None
                  for x in xs]  # fmt: skip
        outs = execute(fn, xs, [x.dtype for x in xs], shapes, kernel)

        def grad(*dys: Any) -> List[tf.Tensor]:
            dys = _zeros_if_none(dys, outs)
            averaged = grouped_allreduce_dense(
                dys, op=Average, process_set=process_set, ignore_name_scope=ignore_name_scope,
                prefix="allreduce" if len(dys) == 1 else "grouped_allreduce",
            )  # fmt: skip
            # Every rank's dim-0 sizes, to find this rank's rows.
            dims = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])[tf.newaxis]
            gathered = allgather(dims, process_set=process_set, ignore_name_scope=True)
            r = _set_rank(process_set)
            offsets = tf.reduce_sum(gathered[:r], axis=0)
            return [g[offsets[i] : offsets[i] + dims[0, i]] for i, g in enumerate(averaged)]

        return outs, grad

    return _differentiable(forward, list(tensors))


def allgather(
    tensor: tf.Tensor,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Concatenates every rank's tensor along dim 0 (other dims must match)."""
    return grouped_allgather(
        [as_tensor(tensor)], name, ignore_name_scope, process_set, _prefix="allgather"
    )[0]


# ---- broadcast ---------------------------------------------------------------------------------
def _broadcast_tensor(
    tensor: tf.Tensor,
    root_rank: int,
    name: str | None,
    ignore_name_scope: bool,
    process_set: ProcessSet,
) -> tf.Tensor:
    _check_dtype(tensor.dtype, _MOVE_CODES)
    root_rank = int(root_rank)
    try:
        _ops.check_root_rank(root_rank)
    except ValueError as e:  # the class TF raises for any other bad root
        raise tf.errors.InvalidArgumentError(None, None, str(e)) from None

    def forward(xs: List[tf.Tensor]) -> Tuple[List[tf.Tensor], Callable[..., Any]]:
        ps_id = _ps_id(process_set)
        core_name = _core_name(
            "broadcast", name, xs[0], "HorovodBroadcast", ignore_name_scope, process_set
        )

        fn, kernel = _graph_paths(
            _ops.OP_BROADCAST, "broadcast", core_name, ps_id, root_rank=root_rank
        )
        outs = execute(fn, xs, [xs[0].dtype], [xs[0].shape], kernel)

        def grad(dy: Any) -> List[tf.Tensor]:
            # Horovod's _broadcast_grad: Average-allreduce, zero on every rank but the root.
            dy = tf.zeros_like(outs[0]) if dy is None else dy
            reduced = allreduce_dense(
                dy, op=Average, process_set=process_set, ignore_name_scope=ignore_name_scope
            )
            return [reduced if rank() == root_rank else reduced * 0]

        return outs, grad

    return _differentiable(forward, [tensor])[0]


def broadcast(
    tensor: tf.Tensor,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Returns the global rank ``root_rank``'s tensor on every rank of the set."""
    return _broadcast_tensor(as_tensor(tensor), root_rank, name, ignore_name_scope, process_set)


def tf_variable(v: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable (hashable through ``ref()``); ``v`` else."""
    if hasattr(v, "ref"):
        return v
    inner = getattr(v, "_value", None)
    return inner if isinstance(inner, tf.Variable) else v


def broadcast_(
    variables: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Broadcasts ``root_rank``'s values into the variables in place (a list of tf.Variable, or
    one). Returns, as Horovod does, the variables' values after the broadcast: a list of
    tensors (one tensor for a single variable). In a TF1 graph nothing runs until they are
    evaluated: ``session.run`` of the returned tensors performs the broadcast."""
    single = isinstance(tf_variable(variables), tf.Variable)
    var_list = [variables] if single else list(variables)
    values = []
    for i, given in enumerate(var_list):
        v = tf_variable(given)
        if not isinstance(v, tf.Variable):
            raise ValueError(f"broadcast_ expects tf.Variable objects, got {type(given).__name__}")
        vname = None if name is None else (name if single else f"{name}.{i}")
        bcast = _broadcast_tensor(as_tensor(v), root_rank, vname, False, process_set)
        # Eagerly the assignment is done here; in a graph the value read waits for it.
        with tf.control_dependencies([v.assign(bcast, read_value=False)]):
            values.append(v.read_value())
    return values[0] if single else values


# ---- alltoall ----------------------------------------------------------------------------------
def _splits_values(splits: Any) -> List[int]:
    if isinstance(splits, (tf.Tensor, tf.Variable, np.ndarray)):
        if splits.dtype not in (tf.int32, np.int32):
            raise tf.errors.InvalidArgumentError(
                None, None, "alltoall expects splits to contain 32-bit integer elements."
            )
        if len(splits.shape) != 1:
            raise tf.errors.InvalidArgumentError(None, None, "alltoall expects a 1D splits tensor")
        return [int(v) for v in np.asarray(splits)]
    try:
        values = np.asarray(list(splits))
    except TypeError:
        raise tf.errors.InvalidArgumentError(
            None, None, "alltoall splits must be a list of integers or a 1D int32 tensor"
        ) from None
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise tf.errors.InvalidArgumentError(None, None, "alltoall expects a 1D splits tensor")
    return [int(v) for v in values]


def alltoall(
    tensor: tf.Tensor,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends rows of dim 0 to every rank of the set and gathers theirs.

    ``splits`` (a list or 1-D int32 tensor) gives the rows sent to each rank; None splits evenly.
    Returns ``(output, received_splits)`` when ``splits`` is given, else ``output``. The gradient
    is an alltoall of the upstream gradient with the received splits.
    """
    tensor = as_tensor(tensor)
    _check_dtype(tensor.dtype, _MOVE_CODES)
    splits_t = None
    if splits is not None:
        if tf.executing_eagerly() or not isinstance(splits, (tf.Tensor, tf.Variable)):
            splits_t = tf.constant(_splits_values(splits), dtype=tf.int32)
        else:
            if splits.dtype != tf.int32:
                raise tf.errors.InvalidArgumentError(
                    None, None, "alltoall expects splits to contain 32-bit integer elements."
                )
            if splits.shape.rank is not None and splits.shape.rank != 1:
                raise tf.errors.InvalidArgumentError(
                    None, None, "alltoall expects a 1D splits tensor"
                )
            splits_t = tf.convert_to_tensor(splits)

    def forward(xs: List[tf.Tensor]) -> Tuple[List[tf.Tensor], Callable[..., Any]]:
        ps_id = _ps_id(process_set)
        core_name = _core_name(
            "alltoall", name, xs[0], "HorovodAlltoall", ignore_name_scope, process_set
        )

        def fn(a: np.ndarray, *sp: np.ndarray) -> List[np.ndarray]:
            split_list = [int(v) for v in sp[0]] if sp else None
            outs, rsplits = _collective(
                _ops.OP_ALLTOALL, [a], what="alltoall", name=core_name, ps_id=ps_id,
                splits=split_list,
            )  # fmt: skip
            return [outs[0], np.asarray(rsplits, dtype=np.int32)]

        def kernel(ops: Any, ins: List[tf.Tensor]) -> Sequence[tf.Tensor]:
            even = tf.zeros([0], tf.int32)  # no splits: the core splits evenly
            return ops.bagua_hvd_alltoall(
                ins[0], ins[1] if len(ins) > 1 else even, core_name=core_name or "",
                process_set_id=ps_id,
            )  # fmt: skip

        x = xs[0]
        inputs = [x] if splits_t is None else [x, splits_t]
        out_shape = tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else None
        out, rsplits = execute(fn, inputs, [x.dtype, tf.int32], [out_shape, [None]], kernel)

        def grad(dy: Any, *_: Any) -> List[tf.Tensor]:
            dy = tf.zeros_like(out) if dy is None else dy
            g, _unused = alltoall(
                dy, splits=rsplits, process_set=process_set, ignore_name_scope=ignore_name_scope
            )
            return [g]

        return [out, rsplits], grad

    out, rsplits = _differentiable(forward, [tensor])
    return out if splits is None else (out, rsplits)


# ---- reducescatter -----------------------------------------------------------------------------
def grouped_reducescatter_dense(
    tensors: Sequence[tf.Tensor],
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    _prefix: str = "grouped_reducescatter",
) -> List[tf.Tensor]:
    """Reducescatter in one core request. Gradient (Horovod's rule, as in the torch frontend):
    allgather of the upstream gradient, x set size for Sum, x prescale x postscale."""
    tensors = [as_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype, _REDUCE_CODES)
    if op not in (Average, Sum):
        raise tf.errors.InvalidArgumentError(
            None, None, "Reducescatter currently only supports AVERAGE and SUM."
        )
    label = "HorovodReducescatter" if _prefix == "reducescatter" else "HorovodGroupedReducescatter"

    def forward(xs: List[tf.Tensor]) -> Tuple[List[tf.Tensor], Callable[..., Any]]:
        ps_id = _ps_id(process_set)
        core_name = _core_name(_prefix, name, xs[0], label, ignore_name_scope, process_set)

        fn, kernel = _graph_paths(
            _ops.OP_REDUCESCATTER, _prefix, core_name, ps_id, reduce_op=op,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        )  # fmt: skip
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else x.shape
                  for x in xs]  # fmt: skip
        outs = execute(fn, xs, [x.dtype for x in xs], shapes, kernel)

        def grad(*dys: Any) -> List[tf.Tensor]:
            dys = _zeros_if_none(dys, outs)
            if len(dys) == 1:
                gathered = [allgather(dys[0], process_set=process_set)]
            else:
                gathered = grouped_allgather(dys, process_set=process_set)
            scale = prescale_factor * postscale_factor
            if op == Sum:
                n = traced_set_size(process_set)
                if not isinstance(n, int):  # an elastic job's graph: read when it runs
                    return [g * (tf.cast(n, g.dtype) * tf.cast(scale, g.dtype)) for g in gathered]
                scale *= n
            return [g if scale == 1.0 else g * tf.cast(scale, g.dtype) for g in gathered]

        return outs, grad

    return _differentiable(forward, tensors)


def reducescatter_dense(
    tensor: tf.Tensor,
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reducescatter of one tensor: this rank's slice of dim 0 of the reduction."""
    return grouped_reducescatter_dense(
        [tensor], op, name, process_set, ignore_name_scope, prescale_factor, postscale_factor,
        _prefix="reducescatter",
    )[0]  # fmt: skip


# ---- join, barrier, in-graph queries -----------------------------------------------------------
def _scalar_op(fn: Callable[[], int], dtype: tf.DType = tf.int32) -> tf.Tensor:
    if tf.executing_eagerly():
        return tf.constant(fn(), dtype=dtype)

    @tf.autograph.experimental.do_not_convert
    def run() -> np.ndarray:
        try:
            return np.asarray(fn(), dtype=dtype.as_numpy_dtype)
        except tf.errors.OpError as e:
            raise ValueError(e.message) from None

    out = tf.numpy_function(run, [], dtype, stateful=True)
    out.set_shape([])
    return out


def join() -> tf.Tensor:
    """Signals that this rank has no more data and waits for every rank; returns (as a tensor)
    the global rank that joined last."""

    def run() -> int:
        handle, keep = _enqueue(_ops.OP_JOIN, [], None, urgent=True)
        _wait(handle, "join")
        result = _ops.join_result(handle)
        _ops.release(handle)
        return result

    return _scalar_op(run)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every rank of the set reaches the barrier (not exported by Horovod's TF
    frontend; provided for parity with bagua_hvd.torch)."""
    handle, keep = _enqueue(_ops.OP_BARRIER, [], None, process_set_id=_ps_id(process_set),
                            urgent=True)  # fmt: skip
    _wait(handle, "barrier")
    _ops.release(handle)


def _ps_value(process_set_id: int, what: str) -> Callable[[], int]:
    def run() -> int:
        if not is_initialized():
            raise tf.errors.FailedPreconditionError(None, None, _ops.NOT_INITIALIZED_ERROR)
        if what == "size":
            value = _ops.process_set_size(process_set_id)
        else:
            value = _ops.process_set_rank(process_set_id)
            if value == -1:
                return 0
            value = 1 if value >= 0 else value
        if value < 0:
            raise tf.errors.InvalidArgumentError(
                None, None, f"Process set with id {process_set_id} does not exist."
            )
        return value

    return run


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: the number of ranks in the process set (read when it runs)."""
    return _scalar_op(_ps_value(process_set_id, "size"))


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: 1 if this rank belongs to the process set, else 0."""
    return _scalar_op(_ps_value(process_set_id, "included"))


def local_size_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: the number of ranks on this host."""
    return _scalar_op(local_size)


def rank_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: this process's global rank."""
    return _scalar_op(rank)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: this process's rank on its host."""
    return _scalar_op(local_rank)
