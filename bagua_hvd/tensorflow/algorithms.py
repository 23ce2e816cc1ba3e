"""BAGUA's algorithms for the TensorFlow frontend (docs/algorithms.md, section "TensorFlow").

The declarations are the framework-neutral ones of ``bagua_hvd.common.algorithms`` (the same
classes as ``bagua_hvd.torch.algorithms``), implemented once by ``bagua_hvd.common.engine``;
this module adds a Keras ``QAdamOptimizer`` and runs the engine at the points of a TensorFlow
step. The math runs in the C++ core, as for torch; tensors reach it through the kernel
library (``bagua_hvd.tensorflow.algorithm_kernels``: the engine plans at trace time, the graph
holds kernels only). Importing this module builds that library where it is not built yet
(``bagua_hvd.tensorflow.kernels``) and raises ImportError, saying why and what to install,
where it cannot be built, as Horovod's frameworks do without their compiled ops.

Users pass an algorithm to ``hvd.DistributedGradientTape(tape, algorithm=...)`` (or to the
Keras ``hvd.DistributedOptimizer(opt, algorithm=...)``). Frontend code (the tape, the Keras
optimizer) calls::

    impl = reify(algorithm, optimizer, process_set)
    grads = impl.reduce_gradients(grads, variables)   # instead of the gradient allreduce
    optimizer.apply_gradients(zip(grads, variables))
    impl.after_apply(variables)                       # right after the update

Both methods work eagerly and inside ``tf.function``; ``None`` gradients stay ``None``.
``reduce_gradients`` counts the steps (``impl.step``): each call is one training step. The
count is advanced by a stateful op where the step runs and kept outside TensorFlow's
variables (by the kernel library), so an implementation
creates no ``tf.Variable`` and can first be used in any trace of a ``tf.function``
(TensorFlow allows variables only in a function's first trace). ``after_apply`` is required after every step by ``LowPrecisionDecentralized``
and ``AsyncModelAverage`` (``impl.needs_after_apply``); for the others it does nothing.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

import bagua_hvd.tensorflow.kernels as _kernels
import bagua_hvd.tensorflow.mpi_ops as _mpi
from bagua_hvd.common import algorithms as _common
from bagua_hvd.common import config
from bagua_hvd.common.algorithms import *  # noqa: F403  (the declarations, re-exported)
from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.tensorflow.algorithm_impl import AlgorithmImpl, _read
from bagua_hvd.tensorflow.algorithm_kernels import KernelImpl, _branches

__all__ = [*_common.FRONTEND_EXPORTS, "QAdamOptimizer", "reify", "AutoCheckpoint"]

_kernels.require("BAGUA's algorithms in TensorFlow (bagua_hvd.tensorflow.algorithms)")


_F32 = np.float32


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
        _common.check_qadam_arguments(
            learning_rate if isinstance(learning_rate, (int, float)) else None,
            warmup_steps,
            betas,
            eps,
            weight_decay,
            bool_steps=False,
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
        m_local = self._new_momentum(g_wd, m)
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

    def _new_momentum(self, g_wd: tf.Tensor, m: tf.Tensor) -> tf.Tensor:
        """beta1 * m + (1 - beta1) * g_wd, torch's expression (m.mul(b1).add_(g, alpha))."""
        b1 = self.betas[0]
        return _fma(g_wd, 1 - b1, m * tf.cast(_F32(b1), m.dtype))

    def momentum(self, variable: Any, gradient: Any) -> tf.Tensor:
        """Compression stage, before communication: this rank's new momentum of ``variable``,
        beta1 * m + (1 - beta1) * (g + weight_decay * x) (the optimizer must be built)."""
        x = _read(variable)
        g = tf.convert_to_tensor(gradient)
        wd = self.l2_weight_decay
        g_wd = _fma(x, wd, g) if wd != 0 else g  # g.add(x, alpha=wd)
        return self._new_momentum(g_wd, _read(self.momentum_slot(variable)))

    def set_momentum_in_grad(self, flag: tf.Tensor) -> None:
        """Whether the gradients of the next apply() are already this step's averaged momentum
        (an int32 scalar, 0 or 1)."""
        self._momentum_in_grad.assign(flag)

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


def check_algorithm(
    algorithm: Any, optimizer: Any = None, compression: bool = False, groups: Any = None
) -> None:
    """Raises ValueError (with the torch frontend's messages) for an object that is not an
    algorithm, a QAdamAlgorithm/QAdamOptimizer mismatch (``optimizer``: the Keras optimizer,
    or None: the algorithm's own), or an algorithm combined with ``compression`` (other than
    none) or ``groups`` that it does not accept."""
    _common.check_algorithm(algorithm, "tensorflow")
    algorithm.check(optimizer, QAdamOptimizer, compression, groups)


def reify(
    algorithm: _common.Algorithm | str,
    optimizer: Any = None,
    process_set: ProcessSet = global_process_set,
) -> AlgorithmImpl:
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
        algorithm = _common.from_name(algorithm)
    check_algorithm(algorithm, optimizer)
    if isinstance(algorithm, _common.Auto):
        return AutoImpl(algorithm, optimizer, process_set)
    return KernelImpl(algorithm, optimizer, process_set)


class AutoImpl:
    """``Auto`` in TensorFlow, with ``reify``'s interface. Each candidate has two
    implementations: one for its measured steps, one (fresh at the decision) for after the
    choice. At each step the schedule (``bagua_hvd.common.auto_algorithm``) names the
    implementation: called eagerly, or, inside ``tf.function``, through a
    ``tf.numpy_function`` whose result selects a ``tf.switch_case`` branch."""

    def __init__(self, alg: _common.Auto, optimizer: Any, process_set: ProcessSet) -> None:
        self.alg = alg
        self.process_set = process_set
        self.schedule = alg.schedule(process_set)
        cands = alg.candidates
        self.impls = [KernelImpl(c, optimizer, process_set) for c in cands + cands]
        self.needs_after_apply = any(i.needs_after_apply for i in self.impls)
        self._branch = 0  # the implementation of the step in progress

    @property
    def step(self) -> int:
        """Steps begun."""
        return self.schedule.step

    def _next_branch(self) -> np.int32:
        index, final = self.schedule.begin_step()
        self._branch = index + (len(self.alg.candidates) if final else 0)
        return np.int32(self._branch)

    def _current_branch(self) -> np.int32:
        return np.int32(self._branch)

    def _select(self, fn: Any) -> Any:
        if tf.executing_eagerly():
            return int(fn())
        out = tf.numpy_function(fn, [], tf.int32, stateful=True)
        out.set_shape([])
        return out

    def reduce_gradients(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """This step's candidate's ``reduce_gradients``."""
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        variables = list(variables)
        if not (self.process_set.included() and _mpi.process_set_size(self.process_set) > 1):
            return grads
        present = [i for i, g in enumerate(grads) if g is not None]
        branch = self._select(self._next_branch)

        def run(impl: KernelImpl) -> Any:
            def fn() -> List[Any]:
                reduced = impl.reduce_gradients(grads, variables)
                return [reduced[i] for i in present]

            return fn

        outs = _branches(branch, [run(impl) for impl in self.impls])
        out = list(grads)
        for i, o in zip(present, outs):
            out[i] = o
        return out

    def after_apply(self, variables: List[Any]) -> None:
        """This step's candidate's ``after_apply`` (where one needs it)."""
        if not self.needs_after_apply:
            return
        variables = list(variables)

        def run(impl: KernelImpl) -> Any:
            def fn() -> Any:
                impl.after_apply(variables)
                return tf.constant(0)

            return fn

        _branches(self._select(self._current_branch), [run(impl) for impl in self.impls])

    def flush(self) -> None:
        for impl in self.impls:
            if impl.needs_after_apply and impl.alg.weight_averaging == "low_precision_ring":
                impl.flush()


class AutoCheckpoint(tf.train.experimental.PythonState):
    """``Auto``'s choice in a ``tf.train.Checkpoint`` (the Keras ``DistributedOptimizer``
    tracks one: ``tf.train.Checkpoint(optimizer=opt)`` keeps the choice; tape users add
    ``auto=AutoCheckpoint(alg)``). Restored before the first step or after it, the saved
    choice is taken and nothing is measured."""

    def __init__(self, alg: _common.Auto) -> None:
        self.alg = alg

    def serialize(self) -> str:
        return json.dumps(self.alg.state_dict())

    def deserialize(self, string_value: Any) -> None:
        text = string_value.decode() if isinstance(string_value, bytes) else str(string_value)
        self.alg.load_state_dict(json.loads(text))


def tape_impl(algorithm: _common.Algorithm, process_set: ProcessSet) -> AlgorithmImpl:
    """The implementation a DistributedGradientTape uses for ``algorithm``: one per algorithm
    object and process set, so that its state (step count, residuals, replicas) survives the
    per-step tapes."""
    cache = algorithm.__dict__.setdefault("_tf_tape_impls", {})
    key = process_set.process_set_id
    impl = cache.get(key)
    if impl is None:
        impl = cache[key] = reify(algorithm, None, process_set)
    return impl


_env_algorithms: Dict[str, _common.Algorithm] = {}


def environment_algorithm(name: Optional[str] = None) -> Optional[_common.Algorithm]:
    """``from_environment()`` (or ``from_name(name)``), the same object for every call with
    the same value: a tape is built at every step, and the algorithm's state (its
    implementations) lives with it."""
    name = name or config.algorithm_name()
    if not name:
        return None
    alg = _env_algorithms.get(name)
    if alg is None:
        alg = _env_algorithms[name] = _common.from_name(name)
    return alg
