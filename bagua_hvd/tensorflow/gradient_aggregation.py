"""Horovod's ``horovod.tensorflow.gradient_aggregation``: ``LocalGradientAggregationHelper``,
the local gradient aggregation of ``backward_passes_per_step > 1`` for the tf.compat.v1
``DistributedOptimizer`` (``bagua_hvd.tensorflow.optimizer``) and the Keras one
(``bagua_hvd._keras.optimizer``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import tensorflow as tf

from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.tensorflow.tape import filtered_reduce, variable_key

__all__ = ["LocalGradientAggregationHelper"]


def _not_none(tensors: Sequence[Any]) -> List[Any]:
    return [t for t in tensors if t is not None]


class LocalGradientAggregationHelper:
    """Horovod's local gradient aggregation for ``backward_passes_per_step > 1``, one class for
    both kinds of optimizer as in Horovod (same constructor; ``optimizer_type`` chooses the
    mode). ``counter`` counts the passes since the last communication.

    - ``_OPTIMIZER_TYPE_LEGACY`` (``tf.compat.v1.train`` optimizers, graph mode):
      ``compute_gradients`` sums the gradients into local variables (initialized by the
      session's local-variable initializers); every ``backward_passes_per_step``-th run reduces
      the sums across ranks with ``allreduce_func`` (divided by the number of passes when
      ``average_aggregated_gradients``), and ``apply_gradients`` applies only on those runs
      (other runs only increment ``global_step``).
    - ``_OPTIMIZER_TYPE_KERAS`` (the Keras wrapper of ``bagua_hvd._keras``, eager and
      ``tf.function``): :meth:`step` accumulates densely (``tf.IndexedSlices`` are converted) in
      non-trainable ``tf.Variable``s that the optimizer does not track (not saved with it),
      ``counter`` is a ``tf.Variable`` created with the helper, and the N-th call reduces with
      ``allreduce_func`` and applies.
    """

    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(
        self,
        backward_passes_per_step: int,
        allreduce_func: Callable[..., List[Any]],
        sparse_as_dense: bool,
        average_aggregated_gradients: bool,
        rank: int,
        optimizer_type: str = _OPTIMIZER_TYPE_LEGACY,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
        name: str = "",
    ) -> None:
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self._allreduce_grads = allreduce_func
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.rank = rank
        self.optimizer_type = optimizer_type
        self.name = name
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.counter: Any = None
        self.locally_aggregated_grads: List[Any] = []
        self.not_none_indexes: dict = {}
        self.num_none_grad_updates = 0
        self._local_vars: set = set()
        self._acc: Dict[Any, tf.Variable] = {}  # Keras mode: accumulator by variable key
        if optimizer_type == self._OPTIMIZER_TYPE_KERAS:
            with tf.init_scope():  # created once, outside any tf.function being traced
                self.counter = tf.Variable(
                    0, dtype=tf.int32, trainable=False, name="bhvd_agg_counter"
                )

    def register_local_var(self, var: Any) -> None:
        """Marks a variable as worker-local (its gradient is not reduced)."""
        self._local_vars.add(variable_key(var))

    def _maybe_convert_grad(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if self.sparse_as_dense:
                return tf.convert_to_tensor(grad)
            raise ValueError(
                "IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                "`sparse_as_dense` is False."
            )
        return grad

    def _init_aggregation_vars(self, grads: Sequence[Any]) -> None:
        scope = "aggregation_variables_" + self.name + str(self.rank)
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.compat.v1.variable_scope(scope, reuse=tf.compat.v1.AUTO_REUSE):
            self.counter = tf.compat.v1.get_variable(
                "aggregation_counter", shape=(), dtype=tf.int32, trainable=False,
                initializer=tf.compat.v1.zeros_initializer(), collections=local,
            )  # fmt: skip
            self.locally_aggregated_grads = []
            self.not_none_indexes = {}
            self.num_none_grad_updates = 0
            for idx, grad in enumerate(grads):
                grad = self._maybe_convert_grad(grad)
                if grad is None:
                    self.num_none_grad_updates += 1
                    continue
                self.not_none_indexes[idx] = len(self.locally_aggregated_grads)
                zero = tf.zeros(shape=grad.get_shape().as_list(), dtype=grad.dtype)
                acc = tf.compat.v1.get_variable(
                    str(idx), trainable=False, initializer=zero,
                    collections=local + ["aggregating_collection"],
                )  # fmt: skip
                self.locally_aggregated_grads.append(acc)

    def _allreduce_aggregated(self, vars: Sequence[Any]) -> List[Any]:
        aggregated = [g.read_value() for g in self.locally_aggregated_grads]
        present_vars = [vars[i] for i in sorted(self.not_none_indexes)]
        with tf.control_dependencies(aggregated):
            reduced = filtered_reduce(
                self._allreduce_grads, aggregated, present_vars, self._local_vars,
                self.process_set, self.scale_local_gradients,
            )  # fmt: skip
            with tf.control_dependencies([g for g in reduced if g is not None]):
                reset = self.counter.assign(0, use_locking=True)
            with tf.control_dependencies([reset]):
                divisor = self.backward_passes_per_step if self.average_aggregated_gradients else 1
                return [tf.identity(g / divisor) for g in reduced]

    def compute_gradients(self, grads: Sequence[Any], vars: Sequence[Any]) -> List[Any]:
        """Adds ``grads`` to the local sums and counts the pass. On every
        ``backward_passes_per_step``-th pass returns the sums reduced across the process set
        (divided by the number of passes when ``average_aggregated_gradients``) and resets
        them; on the other passes returns the local gradients (Keras mode: the local sums, as
        Horovod's eager helper). ``None`` stays ``None``."""
        if self.optimizer_type == self._OPTIMIZER_TYPE_KERAS:
            return self._compute_gradients_keras(grads, vars)
        self._init_aggregation_vars(grads)
        clear = tf.cond(
            tf.equal(self.counter, 0),
            lambda: tf.group(*[g.assign(tf.zeros_like(g)) for g in self.locally_aggregated_grads]),
            tf.no_op,
        )
        with tf.control_dependencies([clear]):
            adds = [
                acc.assign_add(self._maybe_convert_grad(g))
                for acc, g in zip(self.locally_aggregated_grads, _not_none(grads))
            ]
        with tf.control_dependencies(adds):
            bump = self.counter.assign_add(1)
        with tf.control_dependencies([bump]):
            present = [self._maybe_convert_grad(g) for g in _not_none(grads)]
            result = tf.cond(
                tf.equal(self.counter, self.backward_passes_per_step),
                lambda: self._allreduce_aggregated(vars),
                lambda: [tf.identity(g) for g in present],
            )
        if not isinstance(result, (list, tuple)):
            result = [result]
        n = len(self.locally_aggregated_grads) + self.num_none_grad_updates
        return [result[self.not_none_indexes[i]] if i in self.not_none_indexes else None
                for i in range(n)]  # fmt: skip

    def apply_gradients(
        self, apply_closure: Callable[[], Any], optimizer: Any, grads_and_vars: Any,
        global_step: Any = None, name: str | None = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        """Runs ``apply_closure`` when the counter was just reset (a communication pass);
        otherwise increments ``global_step`` only (Keras mode: ``optimizer.iterations``; other
        keyword arguments, those of the Keras ``apply_gradients``, are ignored here)."""
        if self.optimizer_type == self._OPTIMIZER_TYPE_KERAS:
            return self._apply_gradients_keras(apply_closure, optimizer)
        flat = [t for gv in grads_and_vars for t in gv if t is not None]
        with tf.control_dependencies([tf.group(*flat)]):
            train_op = tf.cond(tf.equal(self.counter, 0), lambda: tf.group(apply_closure()),
                               tf.no_op)  # fmt: skip

        def bump_step() -> Any:
            if global_step is None:
                return tf.no_op()
            return tf.group(global_step.assign_add(tf.constant(1, dtype=global_step.dtype)))

        with tf.control_dependencies([train_op]):
            return tf.cond(tf.equal(self.counter, 0), tf.no_op, bump_step)

    def _compute_gradients_keras(self, grads: Sequence[Any], vars: Sequence[Any]) -> List[Any]:
        grads = [None if g is None else self._maybe_convert_grad(g) for g in grads]
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        vars = list(vars)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        accs = {i: self._accumulator(vars[i], grads[i]) for i in present}
        for i in present:
            accs[i].assign_add(grads[i])
        count = self.counter.assign_add(1)
        n = self.backward_passes_per_step

        def reduce_and_clear() -> List[Any]:
            agg: List[Any] = [None] * len(grads)
            for i in present:
                agg[i] = accs[i].read_value()
            reduced = filtered_reduce(
                self._allreduce_grads, agg, vars, self._local_vars, self.process_set,
                self.scale_local_gradients,
            )  # fmt: skip
            if self.average_aggregated_gradients:
                reduced = [None if g is None else g / tf.cast(n, g.dtype) for g in reduced]
            out = [tf.identity(reduced[i]) for i in present]
            # Cleared after the reduced values exist, by assigning zeros (not multiplying by
            # them): a non-finite sum does not leak into the next cycle.
            with tf.control_dependencies(out):
                for i in present:
                    accs[i].assign(tf.zeros_like(accs[i]))
                self.counter.assign(0)
            return out

        def local_sums() -> List[Any]:
            return [accs[i].read_value() for i in present]

        if tf.executing_eagerly():
            result = reduce_and_clear() if int(count.numpy()) >= n else local_sums()
        else:
            result = tf.cond(count >= n, reduce_and_clear, local_sums)
            if not isinstance(result, (list, tuple)):
                result = [result]
        out: List[Any] = [None] * len(grads)
        for i, g in zip(present, result):
            out[i] = g
        return out

    def _apply_gradients_keras(self, apply_closure: Callable[[], Any], optimizer: Any) -> Any:
        def apply() -> tf.Tensor:
            apply_closure()
            return tf.constant(True)

        def skip() -> tf.Tensor:
            iterations = getattr(optimizer, "iterations", None)
            if iterations is not None:
                iterations.assign_add(1)
            return tf.constant(False)

        if tf.executing_eagerly():
            return apply() if int(self.counter.numpy()) == 0 else skip()
        return tf.cond(tf.equal(self.counter, 0), apply, skip)

    def _accumulator(self, var: Any, grad: Any) -> tf.Variable:
        k = variable_key(var)
        if k not in self._acc:
            with tf.init_scope():  # created once, outside any tf.function being traced
                self._acc[k] = tf.Variable(
                    tf.zeros(tuple(var.shape), dtype=grad.dtype), trainable=False,
                    name="bhvd_agg_grad",
                )  # fmt: skip
        return self._acc[k]

    def step(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any],
        apply_fn: Callable[[List[Any]], Any],
        skip_fn: Callable[[], Any],
    ) -> Any:
        """Keras mode: accumulates ``grads``; on the N-th pass reduces them with
        ``allreduce_func``, applies them (``apply_fn``) and resets the accumulators and the
        counter, else calls ``skip_fn``."""
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        variables = list(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        accs = {i: self._accumulator(variables[i], grads[i]) for i in present}
        for i in present:
            accs[i].assign_add(grads[i])
        count = self.counter.assign_add(1)
        n = self.backward_passes_per_step

        def do_update() -> tf.Tensor:
            agg: List[Any] = [None] * len(grads)
            for i in present:
                v = accs[i].read_value()
                if self.average_aggregated_gradients:
                    v = v / tf.cast(n, v.dtype)
                agg[i] = v
            apply_fn(self._allreduce_grads(agg, variables))
            for i in present:
                accs[i].assign(tf.zeros_like(accs[i]))
            self.counter.assign(0)
            return tf.constant(True)

        def skip() -> tf.Tensor:
            skip_fn()
            return tf.constant(False)

        if tf.executing_eagerly():
            return do_update() if int(count.numpy()) >= n else skip()
        return tf.cond(count >= n, do_update, skip)
