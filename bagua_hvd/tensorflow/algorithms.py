"""BAGUA's algorithms for the TensorFlow frontend (docs/algorithms.md, section "TensorFlow").

The declarations are the framework-neutral ones of ``bagua_hvd.common.algorithms`` (the same
classes as ``bagua_hvd.torch.algorithms``); this module adds their TensorFlow implementations
and a Keras ``QAdamOptimizer``. The math runs in the C++ core, as for torch: tensors reach it
through numpy (``tf.numpy_function`` inside ``tf.function``), weights are written back with
``assign``.

Users pass an algorithm to ``hvd.DistributedGradientTape(tape, algorithm=...)`` (or to the
Keras ``hvd.DistributedOptimizer(opt, algorithm=...)``). Frontend code (the tape, the Keras
optimizer) calls::

    impl = reify(algorithm, optimizer, process_set)
    grads = impl.reduce_gradients(grads, variables)   # instead of the gradient allreduce
    optimizer.apply_gradients(zip(grads, variables))
    impl.after_apply(variables)                       # right after the update

Both methods work eagerly and inside ``tf.function``; ``None`` gradients stay ``None``.
``reduce_gradients`` counts the steps (``impl.step``): each call is one training step. The
count lives on the Python side, advanced by a stateful op where the step runs, so an
implementation creates no ``tf.Variable`` and can first be used in any trace of a
``tf.function`` (TensorFlow allows variables only in a function's first trace). ``after_apply`` is required after every step by ``LowPrecisionDecentralized``
and ``AsyncModelAverage`` (``impl.needs_after_apply``); for the others it does nothing.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from bagua_hvd.common import _native, config
from bagua_hvd.common import algorithms as _common
from bagua_hvd.common import basics as _basics
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.tensorflow import mpi_ops as _mpi
from bagua_hvd.tensorflow.tape import _set_size

__all__ = [*_common.FRONTEND_EXPORTS, "QAdamOptimizer", "reify"]

Algorithm = _common.Algorithm
GradientAllReduce = _common.GradientAllReduce
ByteGrad = _common.ByteGrad
Decentralized = _common.Decentralized
LowPrecisionDecentralized = _common.LowPrecisionDecentralized
QAdamAlgorithm = _common.QAdamAlgorithm
AsyncModelAverage = _common.AsyncModelAverage
BY_NAME = _common.BY_NAME
from_name = _common.from_name
from_environment = _common.from_environment
ALGORITHM_ENV = _common.ALGORITHM_ENV

_F32 = np.float32
_F64 = np.float64


# ---- QAdamOptimizer ----------------------------------------------------------------------------
def _fma(a: tf.Tensor, b: Any, c: tf.Tensor) -> tf.Tensor:
    """a * b + c rounded once (torch's CPU kernels fuse these: the reference's bits). float32
    products are exact in float64, so the float64 sum rounded to float32 is the fused result
    (barring a double rounding, about once in 2**29)."""
    dt = c.dtype
    if dt == tf.float64:
        return a * tf.cast(b, dt) + c
    wide = tf.cast(a, tf.float64) * tf.cast(tf.cast(b, tf.float32), tf.float64)
    return tf.cast(tf.cast(wide + tf.cast(c, tf.float64), tf.float32), dt)


def _np_fma(a: np.ndarray, b: Any, c: np.ndarray) -> np.ndarray:
    """numpy version of :func:`_fma` (float32 values)."""
    wide = a.astype(_F64) * _F64(_F32(b))
    return (wide + c.astype(_F64)).astype(_F32)


class QAdamOptimizer(tf.keras.optimizers.Optimizer):
    """BAGUA's QAdam for Keras/TensorFlow: Adam during ``warmup_steps`` (the gradients averaged
    by ``QAdamAlgorithm``), then the second moment is frozen and the momentum is averaged
    through the 8-bit compressed allreduce (docs/algorithms.md). Unlike BAGUA, ``weight_decay``
    (L2, added to the gradient) is applied in both stages, and after warm-up the denominator is
    floored by ``|m| / (1 - beta1**s)`` (no coordinate moves by more than the learning rate per
    step).

    The update repeats ``torch.optim.Adam``'s CPU expressions (fused multiply-adds included),
    so it agrees with bagua_hvd's torch QAdamOptimizer and the reference. Without
    ``QAdamAlgorithm`` it is a local QAdam (no communication).
    """

    def __init__(
        self,
        learning_rate: Any = 1e-3,
        warmup_steps: int = 100,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: Optional[float] = 0.0,
        name: str = "QAdamOptimizer",
        **kwargs: Any,
    ) -> None:
        weight_decay = 0.0 if weight_decay is None else float(weight_decay)
        if isinstance(learning_rate, (int, float)) and not 0.0 <= learning_rate:
            raise ValueError(f"Invalid learning rate: {learning_rate}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps <= 0:
            raise ValueError(
                f"warmup_steps must be a positive integer, got {warmup_steps!r}: the compression "
                "stage freezes the second moment estimated during warm-up"
            )
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.warmup_steps = warmup_steps
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.l2_weight_decay = weight_decay

    def build(self, var_list: List[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums = [self.add_variable_from_reference(v, "momentum") for v in var_list]
        self._velocities = [self.add_variable_from_reference(v, "velocity") for v in var_list]
        # 1 while the gradients handed to apply() are already this step's momentum (set by
        # QAdamAlgorithm's reduce_gradients in the compression stage).
        self._momentum_in_grad = self.add_variable(
            (), initializer="zeros", dtype="int32", name="momentum_in_grad"
        )

    def in_warmup(self) -> bool:
        """True while the next step is a warm-up (plain Adam) step (eager)."""
        return int(self.iterations.numpy()) < self.warmup_steps

    def momentum_slot(self, variable: Any) -> Any:
        """The first-moment variable of ``variable`` (the optimizer must be built)."""
        return self._momentums[self._get_variable_index(variable)]

    def velocity_slot(self, variable: Any) -> Any:
        return self._velocities[self._get_variable_index(variable)]

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        result = super().apply(grads, trainable_variables)
        if self.built:
            self._momentum_in_grad.assign(0)
        return result

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        x = tf.convert_to_tensor(variable)
        dt = x.dtype
        g = tf.cast(tf.convert_to_tensor(gradient), dt)
        m_var = self.momentum_slot(variable)
        v_var = self.velocity_slot(variable)
        m = tf.convert_to_tensor(m_var)
        v = tf.convert_to_tensor(v_var)
        b1, b2 = self.betas
        wd = self.l2_weight_decay
        s = tf.cast(self.iterations + 1, tf.float64)
        warm = self.iterations < self.warmup_steps
        g_wd = _fma(x, wd, g) if wd != 0 else g  # g.add(x, alpha=wd)
        # Warm-up: torch.optim.Adam's single-tensor update, operation for operation.
        m_warm = _fma(g_wd - m, 1 - b1, m)  # m.lerp_(g, 1 - b1)
        v_warm = _fma(tf.cast(_F32(1 - b2), dt) * g_wd, g_wd, v * tf.cast(_F32(b2), dt))
        # Compression stage: the averaged momentum (or this rank's, without communication);
        # v frozen; coordinates with v == 0 get m = 0 and stay put;
        # the denominator is floored by |m| / bc1 (docs/algorithms.md).
        m_local = _fma(g_wd, 1 - b1, m * tf.cast(_F32(b1), dt))  # m.mul(b1).add_(g, alpha)
        m_comp = tf.where(self._momentum_in_grad > 0, g, m_local)
        m_comp = tf.where(v == 0, tf.zeros_like(m_comp), m_comp)
        m_new = tf.where(warm, m_warm, m_comp)
        v_new = tf.where(warm, v_warm, v)
        lr = tf.cast(learning_rate, tf.float64)
        bc1 = 1.0 - tf.pow(tf.constant(b1, tf.float64), s)
        bc2 = 1.0 - tf.pow(tf.constant(b2, tf.float64), s)
        denom = tf.sqrt(v_new) / tf.cast(tf.sqrt(bc2), dt)
        denom = tf.where(warm, denom, tf.maximum(denom, tf.abs(m_new) / tf.cast(bc1, dt)))
        denom = denom + tf.cast(self.eps, dt)
        value = tf.cast(-(lr / bc1), dt)
        self.assign(m_var, m_new)
        self.assign(v_var, v_new)
        self.assign(variable, x + (value * m_new) / denom)  # x.addcdiv_(m, denom, value)

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "warmup_steps": self.warmup_steps,
                "betas": self.betas,
                "eps": self.eps,
                "weight_decay": self.l2_weight_decay,
            }
        )
        return config


_common.register_qadam_optimizer(QAdamOptimizer)


# ---- numpy staging -----------------------------------------------------------------------------
_uids = itertools.count()
_uid_lock = threading.Lock()


def _tf_dtype(v: Any) -> tf.DType:
    return tf.as_dtype(v.dtype)


def _read(v: Any) -> tf.Tensor:
    """A variable's current value (a read op inside a graph)."""
    if isinstance(v, tf.Variable):
        return v.read_value() if tf.executing_eagerly() else tf.identity(v)
    return tf.convert_to_tensor(v)


def _dense(g: Any) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.convert_to_tensor(g)
    return g


def _code(a: np.ndarray) -> int:
    code = _mpi._NP_CODES.get(a.dtype)
    if code is None:
        raise tf.errors.InvalidArgumentError(None, None, f"Tensor type {a.dtype} is not supported.")
    return code


def _desc(a: np.ndarray) -> Tuple[int, int, Tuple[int, ...]]:
    return (a.ctypes.data if a.size else 0, _code(a), (a.size,))


def _check_status(status: int) -> None:
    if status != _ops.OK:
        raise _mpi._tf_error(status, _native.last_error() or "core call failed")


class _Flats:
    """Tensors (numpy arrays) flattened into one contiguous buffer per bucket."""

    def __init__(self, arrays: Sequence[np.ndarray], layout: List[List[int]]) -> None:
        self.layout = layout
        self.flats = [
            np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in b]) for b in layout
        ]

    def split_into(self, out: List[Any], shapes: Sequence[Tuple[int, ...]]) -> None:
        for b, flat in zip(self.layout, self.flats):
            off = 0
            for i in b:
                n = int(np.prod(shapes[i], dtype=np.int64))
                out[i] = flat[off : off + n].reshape(shapes[i])
                off += n


def _layout_for(arrays: Sequence[np.ndarray]) -> List[List[int]]:
    infos = [(a.size, a.dtype, a.dtype.itemsize) for a in arrays]
    return _common.bucket_layout(infos, _common.bucket_bytes())


def _signature(arrays: Sequence[np.ndarray]) -> Tuple[Any, ...]:
    return tuple((a.shape, a.dtype) for a in arrays)


def _run(
    fn: Callable[..., List[np.ndarray]],
    inputs: Sequence[tf.Tensor],
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[Any],
) -> List[tf.Tensor]:
    """Runs ``fn`` on the inputs' numpy values: eagerly, or as a stateful numpy_function."""
    return _mpi._execute(fn, list(inputs), list(out_dtypes), list(out_shapes))


def _assign_if(flag: tf.Tensor, variables: Sequence[Any], values: Sequence[tf.Tensor]) -> None:
    """Writes ``values`` into ``variables`` when ``flag`` (a scalar bool) is true."""
    if tf.executing_eagerly():
        if bool(np.asarray(flag)):
            for v, x in zip(variables, values):
                v.assign(tf.cast(x, _tf_dtype(v)))
        return

    def write() -> tf.Tensor:
        with tf.control_dependencies([v.assign(tf.cast(x, _tf_dtype(v))) for v, x in
                                      zip(variables, values)]):  # fmt: skip
            return tf.constant(True)

    tf.cond(flag, write, lambda: tf.constant(False))


# ---- implementations ---------------------------------------------------------------------------
class _Impl:
    """An algorithm inside one training loop (a tape's algorithm, a Keras optimizer). The base
    class is the gradient path: GradientAllReduce (average or sum) and ByteGrad."""

    needs_after_apply = False

    def __init__(self, alg: Algorithm, optimizer: Any, process_set: ProcessSet) -> None:
        self.alg = alg
        self.optimizer = optimizer
        self.process_set = process_set
        with _uid_lock:
            self.uid = next(_uids)
        self._steps = 0  # reduce_gradients calls that ran (advanced by _tick)
        self._residuals: Dict[Any, List[Tuple[np.ndarray, np.ndarray]]] = {}
        self._applied = 0  # completed after_apply calls (numpy side), for the check below

    # -- properties --------------------------------------------------------------------------------
    def size(self) -> int:
        return _set_size(self.process_set)

    def hierarchical(self) -> bool:
        return bool(getattr(self.alg, "hierarchical", False))

    def _ps_id(self) -> int:
        return _mpi._ps_id(self.process_set)

    def _name(self, kind: str, i: int) -> str:
        return f"bagua_tf{self.uid}.{kind}.{i}"

    # -- the public interface ----------------------------------------------------------------------
    def reduce_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """This step's gradients as the optimizer must apply them (may also change the
        variables); ``None`` entries stay ``None``. Advances :attr:`step`."""
        grads = [_dense(g) for g in grads]
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError(
                f"reduce_gradients got {len(grads)} gradients for {len(variables)} variables"
            )
        self._check_variables(variables)
        if self.process_set.included() and self.size() > 1:
            grads = self._reduce(grads, variables)
        self._tick()
        return grads

    @property
    def step(self) -> int:
        """Completed ``reduce_gradients`` calls (steps)."""
        return self._steps

    def _tick(self) -> None:
        """Advances the step count when the step runs (a stateful op inside tf.function:
        ordered after this step's callbacks and before the next's)."""

        def bump() -> List[np.ndarray]:
            self._steps += 1
            return [np.array(self._steps, np.int64)]

        _run(bump, [], [tf.int64], [tf.TensorShape([])])

    def after_apply(self, variables: Sequence[Any]) -> None:
        """Right after the optimizer applied this step's update."""
        variables = list(variables)
        self._check_variables(variables)
        if self.needs_after_apply and self.process_set.included() and self.size() > 1:
            self._after(variables)

    # -- overridden by the algorithms --------------------------------------------------------------
    def _check_variables(self, variables: List[Any]) -> None:
        pass

    def _reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        return self._gradient_path(grads, variables)

    def _after(self, variables: List[Any]) -> None:
        pass

    def _compressed(self, step: int) -> bool:
        return self.alg.compresses_gradients(step)

    def _communicates(self, step: int) -> bool:
        return self.alg.communicates_gradients(step)

    def _average(self) -> bool:
        return bool(getattr(self.alg, "average", True))

    def _check_after_apply(self, step: int) -> None:
        """A step's reduce_gradients finds every earlier step's after_apply done."""
        if self.needs_after_apply and self._applied < step:
            raise ValueError(
                f"{type(self.alg).__name__} needs a call after every optimizer update: "
                "tape.step_done() (or impl.after_apply(variables)) after "
                "optimizer.apply_gradients(...)"
            )

    # -- gradient path -----------------------------------------------------------------------------
    def _gradient_path(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        ins = [tf.convert_to_tensor(grads[i]) for i in present]

        def fn(*arrays: np.ndarray) -> List[np.ndarray]:
            t = self._steps
            self._check_after_apply(t)
            if not self._communicates(t):
                return [np.array(a) for a in arrays]
            return self.allreduce_arrays(list(arrays), self._compressed(t), self._average())

        outs = _run(fn, ins, [x.dtype for x in ins], [x.shape for x in ins])
        out = list(grads)
        for i, r in zip(present, outs):
            out[i] = r
        return out

    def _enqueue_each(
        self,
        op: int,
        prefix: str,
        kind: str,
        inputs: Sequence[np.ndarray],
        outputs: Optional[Sequence[np.ndarray]] = None,
        aux: Optional[Sequence[Sequence[np.ndarray]]] = None,
        **kwargs: Any,
    ) -> List[Tuple[int, Any, str]]:
        """Enqueues one urgent core operation per flat buffer on this process set (``inputs[i]``
        into ``outputs[i]``, in place without ``outputs``; ``aux[i]`` its extra buffers); returns
        the ``(handle, buffers kept alive, name)`` list that :func:`_wait_all` takes."""
        pending = []
        for i, flat in enumerate(inputs):
            out = flat if outputs is None else outputs[i]
            name = f"{prefix}." + self._name(kind, i)
            handle, keep = _mpi._enqueue(
                op,
                [_desc(flat)],
                [_desc(out)],
                name=name,
                process_set_id=self._ps_id(),
                urgent=True,
                aux=None if aux is None else [_desc(a) for a in aux[i]],
                **kwargs,
            )
            pending.append((handle, (keep, flat, out), name))
        return pending

    def allreduce_arrays(
        self, arrays: List[np.ndarray], compressed: bool, average: bool, kind: str = "grad"
    ) -> List[np.ndarray]:
        """Bucketed allreduce (ByteGrad's compressed one if ``compressed``) of numpy arrays in
        the core; returns new arrays of the same shapes."""
        shapes = [a.shape for a in arrays]
        layout = _layout_for(arrays)
        flats = _Flats(arrays, layout)
        residuals = None
        ef = compressed and bool(getattr(self.alg, "error_feedback", False))
        if ef:
            key = (kind, _signature(arrays))
            residuals = self._residuals.get(key)
            if residuals is None:
                n = _ops.native().lib.bhvd_compression_group_size(
                    self._ps_id(), 1 if self.hierarchical() else 0
                )
                residuals = []
                for f in flats.flats:
                    chunk = -(-f.size // n)
                    residuals.append((np.zeros(chunk * n, f.dtype), np.zeros(chunk, f.dtype)))
                self._residuals = {key: residuals}  # a new layout starts from zero residuals
        pending = self._enqueue_each(
            _ops.OP_ALLREDUCE,
            "allreduce",
            kind,
            flats.flats,
            aux=residuals,
            reduce_op=_ops.Average if average else _ops.Sum,
            compression=_ops.COMPRESSION_MINMAX_UINT8 if compressed else _ops.COMPRESSION_NONE,
            hierarchical=self.hierarchical(),
        )
        _wait_all(pending)
        out: List[Any] = [None] * len(arrays)
        flats.split_into(out, shapes)
        return out


def _wait_all(pending: List[Tuple[int, Any, str]]) -> None:
    """Waits for every handle (all of them, even after a failure), releases them, and raises
    the first failure."""
    error: Optional[BaseException] = None
    for handle, _keep, name in pending:
        try:
            _mpi._wait(handle, name)
        except KeyboardInterrupt:
            _mpi._abandoned.append(pending)
            raise
        except Exception as e:  # noqa: BLE001 - re-raised below
            error = error or e
        _ops.release(handle)
    if error is not None:
        raise error


class _WeightImpl(_Impl):
    """Algorithms that communicate weights: one numpy buffer set per model (variable list)."""

    def _check_variables(self, variables: List[Any]) -> None:
        if not all(hasattr(v, "assign") for v in variables):
            raise ValueError(
                f"{type(self.alg).__name__} communicates weights: the sources of the gradients "
                "must be variables (tf.Variable or Keras variables), not tensors"
            )
        sig = tuple((tuple(v.shape), _tf_dtype(v).name) for v in variables)
        known = getattr(self, "_variables_sig", None)
        if known is None:
            self._variables_sig = sig
        elif known != sig:
            raise ValueError(self._other_model_error())

    def _other_model_error(self) -> str:
        return (
            f"{type(self.alg).__name__} keeps per-model state, but it was given a different "
            "list of variables than before: use one algorithm object per model"
        )

    def _bind(self, arrays: Sequence[np.ndarray]) -> List[List[int]]:
        sig = _signature(arrays)
        bound = getattr(self, "_bound", None)
        if bound is None:
            self._bound = (sig, _layout_for(arrays))
            return self._bound[1]
        if bound[0] != sig:
            raise ValueError(self._other_model_error())
        return bound[1]

    def _weights_op(
        self,
        fn: Callable[[int, List[np.ndarray]], Optional[List[np.ndarray]]],
        variables: List[Any],
    ) -> None:
        """Runs ``fn(step, weights) -> new weights or None`` on the variables' values and
        writes the result back."""
        if not variables:
            return
        ins = [_read(v) for v in variables]

        def call(*arrays: np.ndarray) -> List[np.ndarray]:
            new = fn(self._steps, list(arrays))
            if new is None:
                return [np.array(False)] + [np.array(a) for a in arrays]
            return [np.array(True)] + [np.asarray(x, a.dtype) for x, a in zip(new, arrays)]

        outs = _run(
            call,
            ins,
            [tf.bool] + [x.dtype for x in ins],
            [tf.TensorShape([])] + [x.shape for x in ins],
        )
        _assign_if(outs[0], variables, outs[1:])


class _DecentralizedImpl(_WeightImpl):
    """Every ``communication_interval`` steps the weights that produced this step's gradients
    are replaced by the peer average; the local gradients are returned for the update."""

    def _reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        self._weights_op(self._average_weights, variables)
        return grads

    def _average_weights(self, step: int, arrays: List[np.ndarray]) -> Optional[List[np.ndarray]]:
        interval = self.alg.communication_interval
        if step % interval != 0:
            return None
        layout = self._bind(arrays)
        flats = _Flats(arrays, layout)
        peers = [np.empty_like(f) for f in flats.flats]
        pending = self._enqueue_each(
            _ops.OP_DECENTRALIZED,
            "decentralized",
            "w",
            flats.flats,
            peers,
            peer_mode=_ops.PEER_MODES[self.alg.peer_selection_mode],
            step=step // interval,
            hierarchical=self.hierarchical(),
        )
        _wait_all(pending)
        flats.flats = peers
        out: List[Any] = [None] * len(arrays)
        flats.split_into(out, [a.shape for a in arrays])
        return out


class _LowPrecisionDecentralizedImpl(_WeightImpl):
    """Replicas initialised at the first step (before its update); after each update of a
    communicating step, the compressed ring step of the core."""

    needs_after_apply = True

    def __init__(self, alg: Algorithm, optimizer: Any, process_set: ProcessSet) -> None:
        super().__init__(alg, optimizer, process_set)
        self.replicas: Optional[List[List[np.ndarray]]] = None  # per bucket: self, left, right
        self.pending: List[Tuple[int, Any, str]] = []
        self._diffs: List[np.ndarray] = []
        # A faster rank must not stop the job while a slower one's last exchange needs it.
        _basics.before_shutdown(_sweep_in_flight)

    def _reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        self._weights_op(self._init_replicas, variables)
        return grads

    def _init_replicas(self, step: int, arrays: List[np.ndarray]) -> None:
        self._check_after_apply(step)
        if self.replicas is not None:
            return None
        layout = self._bind(arrays)
        flats = _Flats(arrays, layout)
        out = [[np.empty_like(f) for _ in range(3)] for f in flats.flats]
        pending = self._enqueue_each(
            _ops.OP_LP_DECENTRALIZED,
            "lp_decentralized",
            "init",
            flats.flats,
            aux=out,
            peer_mode=1,
            hierarchical=self.hierarchical(),
        )
        _wait_all(pending)
        self.replicas = out
        return None

    def _after(self, variables: List[Any]) -> None:
        self._weights_op(self._ring_step, variables)

    def _split(self) -> bool:
        """Flat ring (no host hierarchy in play): the local half runs here, the exchange in the
        background, overlapping the next forward and backward."""
        split = getattr(self, "_split_cached", None)
        if split is None:
            group = _ops.native().lib.bhvd_compression_group_size(self._ps_id(), 1)
            split = self._split_cached = not self.hierarchical() or group == self.size()
        return split

    def _ring_step(self, step: int, arrays: List[np.ndarray]) -> Optional[List[np.ndarray]]:
        t = step - 1  # reduce_gradients already counted this step
        self._applied = step
        if self.replicas is None or t % self.alg.communication_interval != 0:
            return None
        layout = self._bind(arrays)
        flats = _Flats(arrays, layout)
        if self._split():
            self.flush()  # the replicas must have the previous round's differences
            lib = _ops.native().lib
            if not self._diffs:
                self._diffs = [
                    np.empty(lib.bhvd_minmax_uint8_size(_code(f), f.size, 1), np.uint8)
                    for f in flats.flats
                ]
            ffi = _native.ffi
            for flat, (own, left, right), c in zip(flats.flats, self.replicas, self._diffs):
                _check_status(
                    lib.bhvd_lp_decentralized_local(
                        ffi.cast("void *", flat.ctypes.data),
                        ffi.cast("void *", own.ctypes.data),
                        ffi.cast("void *", left.ctypes.data),
                        ffi.cast("void *", right.ctypes.data),
                        _code(flat),
                        flat.size,
                        ffi.cast("uint8_t *", c.ctypes.data),
                    )
                )
            pending = self._enqueue_each(
                _ops.OP_LP_DECENTRALIZED,
                "lp_decentralized",
                "x",
                self._diffs,
                aux=[r[1:] for r in self.replicas],
                peer_mode=2,
            )
            self.pending = pending  # waited for before the next local half
            # The exchange writes into the replicas after this returns: keep them alive even
            # if this implementation is dropped before flush().
            _in_flight.append(
                (weakref.ref(self), [h for h, _, _ in pending], (self.replicas, self._diffs))
            )
        else:  # hierarchical: the host average needs communication first, one blocking op
            pending = self._enqueue_each(
                _ops.OP_LP_DECENTRALIZED,
                "lp_decentralized",
                "step",
                flats.flats,
                aux=self.replicas,
                hierarchical=True,
            )
            _wait_all(pending)
        out: List[Any] = [None] * len(arrays)
        flats.split_into(out, [a.shape for a in arrays])
        return out

    def flush(self) -> None:
        """Waits for the last exchange: afterwards the replicas are final."""
        pending, self.pending = self.pending, []
        _wait_all(pending)
        done = {h for h, _, _ in pending}
        _in_flight[:] = [e for e in _in_flight if not done.intersection(e[1])]
        _sweep_in_flight()


# Exchanges started by low-precision decentralized steps and not waited for yet:
# (owner, handles, buffers the core writes into).
_in_flight: List[Tuple[Any, List[int], Any]] = []


def _sweep_in_flight() -> None:
    """Waits for every other implementation's exchange, and releases those whose implementation
    was dropped. Waits rather than polls, and whether or not the owner is still alive: a name
    stays taken until its handle is seen complete, and whether it has completed, or whether the
    garbage collector has freed its owner yet, may differ between ranks, while this point of the
    program is the same on all."""
    keep = []
    for owner, handles, buffers in _in_flight:
        for h in handles:
            try:
                _ops.wait(h, "a low-precision decentralized exchange")
            except Exception:  # noqa: BLE001  (its owner reports it in its own flush)
                pass
        if owner() is None:
            for h in handles:
                _ops.release(h)
        else:
            keep.append((owner, handles, buffers))
    _in_flight[:] = keep


class _QAdamImpl(_Impl):
    """Warm-up: gradients averaged in full precision. Compression stage: this rank's new
    momentum (from the optimizer's m) through ByteGrad's average; the optimizer applies it as
    the momentum (v frozen)."""

    def __init__(self, alg: Algorithm, optimizer: Any, process_set: ProcessSet) -> None:
        super().__init__(alg, optimizer, process_set)
        self.qadam: QAdamOptimizer = optimizer

    def _reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        q = self.qadam
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        pvars = [variables[i] for i in present]
        if not q.built:  # the momentum slots are read before the first apply() builds them
            with tf.init_scope():
                q.build(variables)
        ins = [tf.convert_to_tensor(grads[i]) for i in present]
        xs = [_read(v) for v in pvars]
        ms = [_read(q.momentum_slot(v)) for v in pvars]
        k = len(ins)
        b1 = q.betas[0]
        wd = q.l2_weight_decay

        def fn(iterations: np.ndarray, *arrays: np.ndarray) -> List[np.ndarray]:
            gs, x, m = arrays[:k], arrays[k : 2 * k], arrays[2 * k :]
            if int(iterations) < q.warmup_steps:
                return [np.array(0, np.int32)] + self.allreduce_arrays(list(gs), False, True)
            moms = []
            for g, xi, mi in zip(gs, x, m):
                if g.dtype != np.float32:
                    raise ValueError(f"QAdamOptimizer runs on float32 variables, not {g.dtype}")
                if wd != 0:
                    g = _np_fma(xi, wd, g)  # g.add(x, alpha=wd)
                moms.append(_np_fma(g, 1 - b1, mi * _F32(b1)))  # m.mul(b1).add_(g, alpha)
            reduced = self.allreduce_arrays(moms, True, True, kind="momentum")
            return [np.array(1, np.int32)] + reduced

        outs = _run(
            fn,
            [_read(q.iterations)] + ins + xs + ms,
            [tf.int32] + [x.dtype for x in ins],
            [tf.TensorShape([])] + [x.shape for x in ins],
        )
        q._momentum_in_grad.assign(outs[0])
        out = list(grads)
        for i, r in zip(present, outs[1:]):
            out[i] = r
        return out


class _AsyncImpl(_WeightImpl):
    """Gradient allreduce during warm-up, then background averaging by the core; the weights
    are staged through numpy buffers at each step boundary (after_apply)."""

    needs_after_apply = True

    def __init__(self, alg: Algorithm, optimizer: Any, process_set: ProcessSet) -> None:
        super().__init__(alg, optimizer, process_set)
        self.id: Optional[int] = None
        self.generation = 0
        self.aborted = False
        self._keep: Any = None
        self._buffers: List[np.ndarray] = []

    def _reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        return self._gradient_path(grads, variables)

    def _compressed(self, step: int) -> bool:
        return False

    def _average(self) -> bool:
        return True

    def _after(self, variables: List[Any]) -> None:
        self._weights_op(self._boundary, variables)

    def _boundary(self, step: int, arrays: List[np.ndarray]) -> Optional[List[np.ndarray]]:
        self._applied = step
        if step <= self.alg.warmup_steps or self.aborted:
            return None
        layout = self._bind(arrays)
        flats = _Flats(arrays, layout)
        if self.id is None:
            self._buffers = flats.flats
            self._start()
        else:
            for buf, f in zip(self._buffers, flats.flats):
                buf[...] = f
        lib = _ops.native().lib
        before = int(lib.bhvd_async_rounds(self.id))
        _check_status(lib.bhvd_async_step(self.id))
        if int(lib.bhvd_async_rounds(self.id)) == before:
            return None  # a snapshot (or nothing): the weights are unchanged
        flats.flats = self._buffers
        out: List[Any] = [None] * len(arrays)
        flats.split_into(out, [a.shape for a in arrays])
        return [np.array(o) for o in out]

    def _start(self) -> None:
        ffi = _native.ffi
        tensors = ffi.new("bhvd_tensor[]", len(self._buffers))
        keep = []
        for i, buf in enumerate(self._buffers):
            shape = ffi.new("int64_t[]", [buf.size])
            keep.append(shape)
            tensors[i].data = ffi.cast("void *", buf.ctypes.data)
            tensors[i].dtype = _code(buf)
            tensors[i].ndim = 1
            tensors[i].shape = shape
        out = ffi.new("int64_t *")
        name = f"async.bagua_tf{self.uid}.{self.generation}"
        _check_status(
            _ops.native().lib.bhvd_async_start(
                name.encode(),
                tensors,
                len(self._buffers),
                self._ps_id(),
                int(self.alg.sync_interval_ms),
                out,
            )
        )
        self.id = int(out[0])
        self._keep = (tensors, keep)
        _live_averagers[self.id] = self  # the core holds the buffers: alive until abort()

    def rounds(self) -> int:
        return int(_ops.native().lib.bhvd_async_rounds(self.id)) if self.id is not None else 0

    def abort(self) -> None:
        self.aborted = True
        if self.id is None:
            return
        lib = _ops.native().lib
        status = lib.bhvd_async_abort(self.id, -1)
        lib.bhvd_async_release(self.id)
        _live_averagers.pop(self.id, None)
        self.id = None
        if status not in (_ops.OK, _ops.ABORTED):
            raise _mpi._tf_error(status, _native.last_error() or "async averaging failed")

    def resume(self) -> None:
        if not self.aborted:
            return
        self.aborted = False
        self.generation += 1


_live_averagers: Dict[int, _AsyncImpl] = {}

_IMPLS: Dict[type, type] = {
    Decentralized: _DecentralizedImpl,
    LowPrecisionDecentralized: _LowPrecisionDecentralizedImpl,
    QAdamAlgorithm: _QAdamImpl,
    AsyncModelAverage: _AsyncImpl,
}


def check_algorithm(algorithm: Any, optimizer: Any = None) -> None:
    """Raises ValueError (with the torch frontend's messages) for an object that is not an
    algorithm, or a QAdamAlgorithm/QAdamOptimizer mismatch."""
    if not isinstance(algorithm, Algorithm):
        raise ValueError(
            "algorithm must be an object from bagua_hvd.tensorflow.algorithms, got "
            f"{type(algorithm).__name__}"
        )
    if isinstance(algorithm, QAdamAlgorithm):
        q = algorithm.optimizer if optimizer is None else optimizer
        if not isinstance(q, QAdamOptimizer):
            raise ValueError(
                "QAdamAlgorithm goes with QAdamOptimizer: pass the QAdamOptimizer to both "
                "QAdamAlgorithm(...) and DistributedOptimizer(...)"
                + (
                    " (this QAdamOptimizer is torch's: use bagua_hvd.tensorflow.algorithms'"
                    " QAdamOptimizer)"
                    if optimizer is None
                    else ""
                )
            )
    elif isinstance(optimizer, QAdamOptimizer):
        raise ValueError(
            "QAdamAlgorithm goes with QAdamOptimizer: pass the QAdamOptimizer to both "
            "QAdamAlgorithm(...) and DistributedOptimizer(...)"
        )


def reify(
    algorithm: Algorithm | str,
    optimizer: Any = None,
    process_set: ProcessSet = global_process_set,
) -> _Impl:
    """The TensorFlow implementation of ``algorithm`` for one training loop.

    ``optimizer``: the (unwrapped) Keras optimizer that applies the gradients, or None (tape
    users). ``algorithm`` may also be a name of :data:`BY_NAME` (``bagua-run --algorithm``).
    ``QAdamAlgorithm`` needs a :class:`QAdamOptimizer` (``optimizer``, or else the one
    the algorithm holds). Returns an object with ``reduce_gradients(grads, variables) -> grads``
    (call it instead of the gradient allreduce, before the update), ``after_apply(variables)``
    (call it right after the update), ``step`` (the count of reduce_gradients calls that ran)
    and ``needs_after_apply``. It creates no TF variable: it may be built in any trace of a
    ``tf.function``. The core names the
    implementation's operations after a per-process counter of reify() calls: every rank must
    build its implementations in the same order.
    """
    if isinstance(algorithm, str):  # a name, e.g. BAGUA_HVD_ALGORITHM's value
        algorithm = from_name(algorithm)
    check_algorithm(algorithm, optimizer)
    impl_cls = next((c for t, c in _IMPLS.items() if isinstance(algorithm, t)), _Impl)
    if isinstance(algorithm, QAdamAlgorithm) and optimizer is None:
        optimizer = algorithm.optimizer
    impl = impl_cls(algorithm, optimizer, process_set)
    if isinstance(algorithm, AsyncModelAverage):
        algorithm.register_impl(impl)
    return impl


# Tapes are built anew every step: their implementation lives with the algorithm object.
_env_algorithms: Dict[str, Algorithm] = {}


def tape_impl(algorithm: Algorithm, process_set: ProcessSet) -> _Impl:
    """The implementation a DistributedGradientTape uses for ``algorithm``: one per algorithm
    object and process set, so that its state (step count, residuals, replicas) survives the
    per-step tapes."""
    cache = algorithm.__dict__.setdefault("_tf_tape_impls", {})
    key = process_set.process_set_id
    impl = cache.get(key)
    if impl is None:
        impl = cache[key] = reify(algorithm, None, process_set)
    return impl


def environment_algorithm() -> Optional[Algorithm]:
    """``from_environment()``, the same object for every call with the same value (a tape
    built each step keeps the algorithm's state)."""
    name = config.algorithm_name()
    if not name:
        return None
    alg = _env_algorithms.get(name)
    if alg is None:
        alg = _env_algorithms[name] = from_name(name)
    return alg
