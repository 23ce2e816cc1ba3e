"""``AlgorithmImpl``, the base of the TensorFlow implementations of BAGUA's algorithms: the
engine at the points of a TensorFlow step, with the interface that ``reify`` (in
``algorithms.py``) returns; ``KernelImpl`` (``algorithm_kernels.py``) runs it through the
kernel library."""

from __future__ import annotations

import itertools
import threading
from typing import Any, List, Optional, Sequence

import tensorflow as tf

import bagua_hvd.tensorflow.mpi_ops as _mpi
from bagua_hvd.common import algorithms as _common
from bagua_hvd.common import engine
from bagua_hvd.common.process_sets import ProcessSet


def _read(v: Any) -> tf.Tensor:
    """A variable's current value (a read op inside a graph)."""
    if isinstance(v, tf.Variable):
        return v.read_value() if tf.executing_eagerly() else tf.identity(v)
    return tf.convert_to_tensor(v)


_uids = itertools.count()
_uid_lock = threading.Lock()


def _tf_dtype(v: Any) -> tf.DType:
    return tf.as_dtype(v.dtype)


def _dense(g: Any) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.convert_to_tensor(g)
    return g


class AlgorithmImpl(engine.Implementation):
    """An algorithm inside one training loop (a tape's algorithm, a Keras optimizer): the
    engine's gradient path and weight averaging at the points of the step
    (reduce_gradients before the update, after_apply after it), run by
    ``bagua_hvd.tensorflow.algorithm_kernels.KernelImpl`` through the kernel library."""

    def __init__(self, alg: _common.Algorithm, optimizer: Any, process_set: ProcessSet) -> None:
        self.optimizer = optimizer
        self.process_set = process_set
        with _uid_lock:
            self.uid = next(_uids)
        self._names = engine.NumberedNames(self.uid)
        super().__init__(alg, self.adapter(), self._names, process_set, self.size)
        self.needs_after_apply = self.averaging is not None and self.averaging.acts_after_update

    def adapter(self) -> engine.TensorAdapter:
        """What the engine's buffers are for this implementation."""
        raise NotImplementedError

    # -- properties --------------------------------------------------------------------------------
    def size(self) -> int:
        return _mpi.process_set_size(self.process_set)

    @property
    def step(self) -> int:
        """Completed ``reduce_gradients`` calls (steps)."""
        raise NotImplementedError

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
            grads = self._communicate(grads, variables)
        self._tick()
        return grads

    def after_apply(self, variables: Sequence[Any]) -> None:
        """Right after the optimizer applied this step's update."""
        variables = list(variables)
        self._check_variables(variables)
        if self.needs_after_apply and self.process_set.included() and self.size() > 1:
            self._after_apply(variables)

    def _communicate(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """The step's part before the update (there is someone to communicate with)."""
        raise NotImplementedError

    def _after_apply(self, variables: List[Any]) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        """Advances the step count when the step runs."""
        raise NotImplementedError

    @staticmethod
    def _build_staging(q: Any, variables: List[Any]) -> None:
        """QAdam: builds its optimizer (the momentum slots are read before the first
        apply() would build them)."""
        if not q.built:
            with tf.init_scope():
                q.build(variables)

    @staticmethod
    def _handed_over(
        grads: List[Any], present: List[int], outs: List[Any], q: Optional[Any]
    ) -> List[Any]:
        """The gradients for the optimizer: ``outs`` (the communicated ones, after QAdam's
        flag when ``q``, its optimizer, is given) in the places ``present``."""
        if q is not None:
            q.set_momentum_in_grad(outs[0])
            outs = outs[1:]
        out = list(grads)
        for i, r in zip(present, outs):
            out[i] = r
        return out

    def _after_apply_missing(self) -> str:
        return (
            f"{type(self.alg).__name__} needs a call after every optimizer update: "
            "tape.step_done() (or impl.after_apply(variables)) after "
            "optimizer.apply_gradients(...)"
        )

    def _check_variables(self, variables: List[Any]) -> None:
        if self.averaging is None:
            return
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
