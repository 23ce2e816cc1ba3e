"""The functions of ``bagua_hvd.tensorflow`` built on its ops (``mpi_ops``): the reductions
with compression and ``tf.IndexedSlices`` (``allreduce``, ``grouped_allreduce``,
``reducescatter``, ``grouped_reducescatter``, in Horovod's ``horovod/tensorflow/__init__.py``) and
the helpers of Horovod's ``horovod/tensorflow/functions.py`` (``broadcast_variables``,
``broadcast_object``, ``broadcast_object_fn``, ``allgather_object``), with
``broadcast_global_variables``. The package exports them; its modules (the tapes, the elastic
states, the hook, the Keras frontends) import them from here.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable, List, Sequence

import numpy as np
import tensorflow as tf

from bagua_hvd.common import config
from bagua_hvd.common.ops import Adasum, Average, Sum
from bagua_hvd.tensorflow.compression import Compression, NoneCompressor
from bagua_hvd.tensorflow.mpi_ops import (
    ProcessSet,
    allgather,
    allreduce_dense,
    as_tensor,
    broadcast,
    broadcast_,
    global_process_set,
    grouped_allgather,
    grouped_allreduce_dense,
    grouped_reducescatter_dense,
    handle_average_backwards_compatibility,
    rank,
    reducescatter_dense,
    traced_set_size,
)

__all__ = [
    "allreduce",
    "grouped_allreduce",
    "reducescatter",
    "grouped_reducescatter",
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
]

try:
    import cloudpickle as _pickle  # Horovod pickles objects with cloudpickle
except ImportError:  # pragma: no cover - cloudpickle is optional
    _pickle = pickle  # type: ignore[assignment]


def _op_or_average(op: int | None, average: bool | None) -> int:
    return handle_average_backwards_compatibility(op, average)


def _check_sparse(op: int, prescale_factor: float, postscale_factor: float) -> None:
    """Horovod's checks for tf.IndexedSlices (on every rank alike, before any collective)."""
    if op == Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not currently support sparse tensors. As a "
            "workaround please pass sparse_as_dense=True to DistributedOptimizer"
        )
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"Only Sum and Average ops are supported with tf.IndexedSlices, got op {op}"
        )
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _sparse_result(
    values: tf.Tensor, indices: tf.Tensor, dense_shape: Any, op: int, process_set: ProcessSet
) -> tf.IndexedSlices:
    """The reduced IndexedSlices from the gathered values and indices. Average: Horovod's
    ``values / tf.cast(set size, values.dtype)``, TensorFlow's true division (integer values
    become floating point, no rounding back)."""
    if op == Average:
        values = values / tf.cast(traced_set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=dense_shape)


def _check_set(process_set: ProcessSet) -> None:
    """Horovod's allreduce reads the set's size in Python first (an unknown set, or a call
    before init, is a ValueError at once), except under HOROVOD_ELASTIC=1, where it reads it
    with size_op when the op runs (a reset may change it)."""
    if not config.elastic():
        process_set.size()


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Allreduces a tensor across the process set (Horovod's ``hvd.allreduce``).

    op: Average (default), Sum, Min, Max, Product or Adasum; ``average`` is the deprecated
    spelling. Dense result: ``postscale * reduce(prescale * tensor)``; the gradient is the same
    allreduce of the upstream gradient. A ``tf.IndexedSlices`` is reduced by two allgathers
    (values and indices); only Sum and Average apply to it, without scale factors
    (NotImplementedError, as Horovod). Average divides the gathered values by the set size
    with TensorFlow's true division, as Horovod does: integer values become float32 (8- and
    16-bit) or float64 (32- and 64-bit).
    ``device_dense``/``device_sparse`` are accepted for compatibility (tensors are staged
    through host memory).
    """
    op = _op_or_average(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        values = allgather(
            tensor.values, process_set=process_set, ignore_name_scope=ignore_name_scope
        )
        indices = allgather(
            tensor.indices, process_set=process_set, ignore_name_scope=ignore_name_scope
        )
        return _sparse_result(values, indices, tensor.dense_shape, op, process_set)
    tensor = as_tensor(tensor)
    _check_set(process_set)
    if compression is NoneCompressor:
        return allreduce_dense(
            tensor, op, prescale_factor, postscale_factor, name, process_set, ignore_name_scope
        )
    compressed, ctx = compression.compress(tensor)
    reduced = allreduce_dense(
        compressed, op, prescale_factor, postscale_factor, name, process_set, ignore_name_scope
    )
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> List[Any]:
    """Allreduces several dense tensors in one fused core request; returns a list.

    tf.IndexedSlices entries are reduced as :func:`allreduce` does, their values in one
    grouped allgather and their indices in another (Horovod's order).
    """
    op = _op_or_average(op, average)
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(
            f"grouped_allreduce expects a list or tuple of tensors, got {type(tensors).__name__}"
        )
    if not tensors:
        return []
    results: List[Any] = [None] * len(tensors)
    sparse_idx = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense_idx = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse_idx:
        # Horovod's order: one grouped allgather of all values, one of all indices, then the
        # dense tensors' grouped allreduce.
        _check_sparse(op, prescale_factor, postscale_factor)
        values = grouped_allgather(
            [tensors[i].values for i in sparse_idx], process_set=process_set,
            ignore_name_scope=ignore_name_scope,
        )  # fmt: skip
        indices = grouped_allgather(
            [tensors[i].indices for i in sparse_idx], process_set=process_set,
            ignore_name_scope=ignore_name_scope,
        )  # fmt: skip
        for i, v, ix in zip(sparse_idx, values, indices):
            results[i] = _sparse_result(v, ix, tensors[i].dense_shape, op, process_set)
    if dense_idx:
        _check_set(process_set)
        compressed, ctxs = zip(*[compression.compress(as_tensor(tensors[i])) for i in dense_idx])
        reduced = grouped_allreduce_dense(
            list(compressed), op, prescale_factor, postscale_factor, name, process_set,
            ignore_name_scope,
        )  # fmt: skip
        for i, r, c in zip(dense_idx, reduced, ctxs):
            results[i] = compression.decompress(r, c)
    return results


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduces the tensor across the set and returns this rank's slice of dim 0; ranks
    ``0 .. dim0 % size - 1`` get one extra row. op: Average or Sum."""
    compressed, ctx = compression.compress(as_tensor(tensor))
    out = reducescatter_dense(
        compressed, op, name, process_set, ignore_name_scope, prescale_factor, postscale_factor
    )
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> List[tf.Tensor]:
    """Reducescatter of several tensors in one fused request; returns a list."""
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(
            "grouped_reducescatter expects a list or tuple of tensors, got "
            f"{type(tensors).__name__}"
        )
    if not tensors:
        return []
    compressed, ctxs = zip(*[compression.compress(as_tensor(t)) for t in tensors])
    outs = grouped_reducescatter_dense(
        list(compressed), op, None, process_set, False, prescale_factor, postscale_factor
    )
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


# ---- Horovod's functions.py: variables and objects ---------------------------------------------
def broadcast_variables(
    variables: Sequence[tf.Variable],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> Any:
    """Assigns ``root_rank``'s values to the variables on every rank of the set. Returns None
    eagerly; in a TF1 graph, the op that does it (for ``session.run``), as Horovod does."""
    variables = list(variables)
    if inplace:
        done = broadcast_(variables, root_rank, process_set=process_set)
    else:
        done = [v.assign(broadcast(v, root_rank, process_set=process_set)) for v in variables]
    return None if tf.executing_eagerly() else tf.group(*done)


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 helper: broadcasts ``tf.compat.v1.global_variables()``. In eager mode it
    raises RuntimeError, as Horovod does (use ``broadcast_variables``)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _to_bytes(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    _pickle.dump(obj, buf)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def _evaluator(session: Any) -> Callable[[tf.Tensor], np.ndarray]:
    """How the object helpers read a collective's result now: eagerly (also inside tf.function,
    under ``tf.init_scope``), or in a TF1 graph with ``session`` or the default session, as
    Horovod's helpers do."""
    if tf.executing_eagerly():
        return lambda t: t.numpy()
    sess = session or tf.compat.v1.get_default_session()
    if sess is None:
        raise ValueError(
            "broadcast_object/allgather_object in a TF1 graph need a session: pass session= "
            "or call them under a default session (with tf.compat.v1.Session() as sess: ...)"
        )
    return sess.run


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Serializes ``obj`` on ``root_rank`` and returns a copy of it on every other rank of the
    set (the root gets ``obj`` itself).

    The collectives run when called, as Horovod's do: eagerly, inside ``tf.function`` at trace
    time (the result is a Python object, a constant of the traced graph: retracing runs them
    again, calling the traced function does not), and in a TF1 graph through ``session`` or the
    default session."""
    name = name or type(obj).__name__
    with tf.init_scope():
        to_numpy = _evaluator(session)
        is_root = rank() == root_rank
        payload = _to_bytes(obj) if is_root else np.zeros(0, dtype=np.uint8)
        length = to_numpy(
            broadcast(
                tf.constant([payload.size], dtype=tf.int64), root_rank, name=f"{name}.sz",
                process_set=process_set,
            )
        )  # fmt: skip
        data = payload if is_root else np.zeros(int(length[0]), dtype=np.uint8)
        data = to_numpy(
            broadcast(tf.constant(data), root_rank, name=f"{name}.t", process_set=process_set)
        )
    return obj if is_root else _pickle.loads(data.tobytes())


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Callable[[Any], Any]:
    """Returns ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (see broadcast_object)."""

    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(
    obj: Any,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> List[Any]:
    """Serializes ``obj`` on every rank and returns the list of all ranks' objects (in
    process-set rank order). Runs when called, as :func:`broadcast_object`."""
    name = name or type(obj).__name__
    with tf.init_scope():
        to_numpy = _evaluator(session)
        payload = _to_bytes(obj)
        sizes = to_numpy(
            allgather(
                tf.constant([payload.size], dtype=tf.int64), name=f"{name}.sz",
                process_set=process_set,
            )
        )  # fmt: skip
        gathered = to_numpy(
            allgather(tf.constant(payload), name=f"{name}.t", process_set=process_set)
        )
    out, off = [], 0
    for s in sizes:
        out.append(_pickle.loads(gathered[off : off + int(s)].tobytes()))
        off += int(s)
    return out
