"""The distributed Keras optimizer shared by ``bagua_hvd.tensorflow.keras`` and ``bagua_hvd.keras``
(Horovod's ``horovod/_keras/__init__.py::create_distributed_optimizer``).

As in Horovod, the wrapper is a class built at run time that subclasses the wrapped optimizer's
own class (same ``__name__``; ``__module__`` is ``bagua_hvd._keras``) and is instantiated with
``cls.from_config(optimizer.get_config())``, so ``isinstance(opt, keras.optimizers.SGD)`` holds
and ``opt.__class__.from_config(opt.get_config())`` gives an equivalent distributed optimizer.

Where the gradients are reduced:

- **Keras 3** optimizers (``keras.optimizers.*``, also ``tf.keras`` on TF >= 2.16): they have no
  ``_compute_gradients``/``get_gradients``/``_aggregate_gradients`` (Horovod issue #4290);
  ``model.fit``'s ``train_step`` calls ``optimizer.apply_gradients(zip(grads, vars))``, which calls
  ``optimizer.apply(grads, vars)``. The wrapper overrides ``apply``, so ``model.fit``, a custom
  ``train_step`` and a plain ``GradientTape`` loop calling ``apply_gradients``/``apply`` all reduce
  the gradients (eagerly and inside ``tf.function``).
- **Keras 2** (``tf_keras``, with ``TF_USE_LEGACY_KERAS=1``): the wrapper overrides
  ``apply_gradients`` (reached from ``minimize``, i.e. ``model.fit``, and from custom loops);
  ``_compute_gradients`` and ``get_gradients`` also return reduced gradients when called directly
  (Horovod's behaviour), but not a second time inside ``minimize``.

``backward_passes_per_step=N`` goes through Horovod's ``LocalGradientAggregationHelper``
(``bagua_hvd.tensorflow.gradient_aggregation``, in its Keras mode): gradients are summed into local ``tf.Variable`` accumulators for N calls; the N-th call reduces the sum (divided
by N when ``average_aggregated_gradients``) and applies it; the other calls only advance the
optimizer's ``iterations``. ``opt._agg_helper.counter`` (a ``tf.Variable``) counts the passes since
the last update. The decision is a ``tf.cond`` on that counter, so it works inside ``tf.function``.

``algorithm=`` (a bagua_hvd extension; default: the ``BAGUA_HVD_ALGORITHM`` environment variable,
else plain allreduce) replaces the allreduce by a BAGUA algorithm of
``bagua_hvd.tensorflow.algorithms`` (``reduce_gradients`` before the update, ``after_apply`` after).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import tensorflow as tf

from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from bagua_hvd.tensorflow.gradient_aggregation_eager import LocalGradientAggregationHelperEager
from bagua_hvd.tensorflow.mpi_ops import rank, tf_variable
from bagua_hvd.tensorflow.optimizer_state import build_optimizer
from bagua_hvd.tensorflow.tape import (
    filtered_reduce,
    make_allreduce_grads_fn,
    resolve_algorithm,
    variable_key,
)

_MODULE = "bagua_hvd._keras"


def is_keras3_optimizer(optimizer: Any) -> bool:
    """True for Keras 3 optimizers (``apply(grads, vars)`` API), False for Keras 2 ones."""
    return hasattr(optimizer, "_backend_apply_gradients") and hasattr(optimizer, "apply")


class _State:
    """The wrapper's settings, kept outside Keras' attribute tracking (lists of variables
    assigned to an optimizer would be tracked, and saved, as its variables)."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)
        self.local_keys: set = set()
        self.impl: Any = None
        self.in_minimize = False
        # Keras 2: the gradients the last _compute_gradients/get_gradients returned, already
        # reduced (or aggregated); apply_gradients handed exactly these does not reduce again.
        self.prereduced: List[Any] = []


def _is_auto(algorithm: Any) -> bool:
    from bagua_hvd.common.algorithms import Auto

    return isinstance(algorithm, Auto)


def _check_not_xla() -> None:
    """The collectives are custom asynchronous kernels and ``tf.numpy_function`` ops, which XLA
    cannot compile. Keras 3 turns XLA on by itself (``jit_compile="auto"``) on machines with a
    GPU: say what to do instead of failing later with XLA's "unsupported op"."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - private module moved
        return
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "bagua_hvd's DistributedOptimizer cannot run inside an XLA-compiled function (its "
            "collectives are tf.numpy_function ops). Compile the model with "
            "model.compile(..., jit_compile=False) (Keras 3 enables XLA by default when a GPU "
            "is visible) or call it from a tf.function without jit_compile=True."
        )


def create_distributed_optimizer(
    keras: Any,
    optimizer: Any,
    name: str | None,
    device_dense: str,
    device_sparse: str,
    compression: Any,
    sparse_as_dense: bool,
    gradient_predivide_factor: float,
    op: int,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
    algorithm: Any = None,
    local_layers: Any = None,
) -> Any:
    """Returns a distributed copy of ``optimizer`` (same class name and config, fresh state).

    Arguments are Horovod's (checked by the public ``DistributedOptimizer`` functions);
    ``local_layers``: layers whose trainable weights are registered as local variables (their
    gradients are not reduced; divided by the set size when ``scale_local_gradients``).
    ``keras`` (the Keras module of the caller) is kept for Horovod's signature: the Keras
    version is told from the optimizer itself (``apply`` API: Keras 3, else Keras 2).
    """
    if process_set is None:
        process_set = global_process_set
    base = optimizer.__class__
    keras3 = is_keras3_optimizer(optimizer)
    algorithm, op = resolve_algorithm(algorithm, op, compression, groups, optimizer)
    if isinstance(groups, list):
        # Keras 3 variables are unhashable: the allreduce helper matches tf.Variable refs.
        groups = [[tf_variable(v) for v in g] for g in groups]
    wrapper_name = name or f"Distributed{base.__name__}"
    dist_cls: Any = None  # the class built below; methods call super(dist_cls, self)

    class _DistributedOptimizer:
        _HAS_AGGREGATE_GRAD = True
        _bhvd_distributed = True

        def __init__(self, **kwargs: Any) -> None:
            super(dist_cls, self).__init__(**kwargs)
            self._bhvd = _State(
                name=wrapper_name,
                process_set=process_set,
                algorithm=algorithm,
                allreduce_grads=make_allreduce_grads_fn(
                    wrapper_name,
                    compression,
                    sparse_as_dense,
                    op,
                    gradient_predivide_factor,
                    groups,
                    process_set,
                ),
            )
            self.process_set = process_set
            self.scale_local_gradients = scale_local_gradients
            self._agg_helper = None
            if _is_auto(algorithm):  # tf.train.Checkpoint(optimizer=...) keeps Auto's choice
                import bagua_hvd.tensorflow.algorithms as algorithms  # loads Keras: lazily

                self._bhvd_auto_choice = algorithms.AutoCheckpoint(algorithm)
            if backward_passes_per_step > 1 and tf.executing_eagerly():
                # Horovod's choice: the eager helper when built eagerly (the Keras mode of
                # LocalGradientAggregationHelper under Horovod's eager constructor).
                self._agg_helper = LocalGradientAggregationHelperEager(
                    backward_passes_per_step, self._allreduce, sparse_as_dense,
                    average_aggregated_gradients, process_set, scale_local_gradients,
                )  # fmt: skip
            elif backward_passes_per_step > 1:
                self._agg_helper = LocalGradientAggregationHelper(
                    backward_passes_per_step, self._allreduce, sparse_as_dense,
                    average_aggregated_gradients, rank(),
                    LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS, process_set,
                    scale_local_gradients, wrapper_name,
                )  # fmt: skip

        def register_local_var(self, var: Any) -> None:
            """Marks ``var`` as worker-local: its gradient is not reduced across ranks (it is
            divided by the set size when ``scale_local_gradients``)."""
            self._bhvd.local_keys.add(variable_key(var))

        def _algorithm_impl(self) -> Any:
            st = self._bhvd
            if st.algorithm is None:
                return None
            if st.impl is None:
                import bagua_hvd.tensorflow.algorithms as algorithms  # loads Keras: lazily

                with tf.init_scope():
                    st.impl = algorithms.reify(st.algorithm, self, st.process_set)
            return st.impl

        def _allreduce(self, grads: Sequence[Any], vars: Sequence[Any]) -> List[Any]:
            """Reduces ``grads`` (one per variable of ``vars``) across the process set now:
            local variables keep their gradient (scaled by 1/size when asked), ``None`` stays
            ``None``. With an algorithm, its ``reduce_gradients`` replaces the allreduce."""
            st = self._bhvd
            grads, vars = list(grads), list(vars)
            _check_not_xla()
            if len(grads) != len(vars):
                raise ValueError(
                    f"got {len(grads)} gradients for {len(vars)} variables; they must match"
                )
            if not st.process_set.included():
                return grads
            impl = self._algorithm_impl()
            reduce = impl.reduce_gradients if impl is not None else st.allreduce_grads
            return filtered_reduce(
                reduce, grads, vars, st.local_keys, st.process_set, self.scale_local_gradients
            )

        def _after_apply(self, vars: Sequence[Any]) -> None:
            impl = self._algorithm_impl()
            if impl is not None:
                impl.after_apply(list(vars))

        def _bhvd_step(
            self,
            grads: List[Any],
            vars: List[Any],
            apply_fn: Callable[[List[Any]], Any],
            skip_fn: Callable[[], Any],
        ) -> Any:
            if self._agg_helper is not None:
                return self._agg_helper.step(
                    grads, vars, lambda g: self._bhvd_apply(apply_fn, g, vars), skip_fn
                )
            return self._bhvd_apply(apply_fn, self._allreduce(grads, vars), vars)

        def _bhvd_apply(self, apply_fn: Callable[[List[Any]], Any], grads: List[Any], vars: Any):
            result = apply_fn(grads)
            self._after_apply(vars)
            return result

    if keras3:

        def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
            """Reduces ``grads`` across the process set, then applies them (Keras 3 ``apply``,
            which ``apply_gradients`` and ``model.fit`` call)."""
            grads = list(grads)
            if not grads:
                return super(dist_cls, self).apply(grads, trainable_variables)
            if trainable_variables is None:
                if not self.built:
                    return super(dist_cls, self).apply(grads, None)  # raises Keras' error
                vars = list(self._trainable_variables)
            else:
                vars = list(trainable_variables)
            if not self.built and (self._agg_helper is not None or self._bhvd.algorithm):
                # Build on all the variables first, as Keras' own apply does: outside the
                # tf.cond (optimizer variables cannot be created in a branch), and before an
                # algorithm sees only those with a gradient (QAdam's reduce_gradients builds
                # its optimizer on the variables it is handed).
                build_optimizer(self, vars)

            def apply_fn(g: List[Any]) -> Any:
                return super(dist_cls, self).apply(g, vars)

            def skip_fn() -> Any:
                return self._iterations.assign_add(1)

            self._bhvd_step(grads, vars, apply_fn, skip_fn)

        _DistributedOptimizer.apply = apply  # type: ignore[attr-defined]
        if isinstance(getattr(base, "variables", None), property):

            def _variables(self: Any) -> List[Any]:
                """The wrapped optimizer's variables (aggregation buffers are not included)."""
                return super(dist_cls, self).variables

            _DistributedOptimizer.variables = property(_variables)  # type: ignore[attr-defined]
    else:

        def _build_slots(self: Any, vars: List[Any]) -> None:
            with tf.init_scope():  # create slots outside the tf.cond
                if hasattr(self, "_create_all_weights"):
                    self._create_all_weights(vars)
                elif hasattr(self, "build"):
                    self.build(vars)

        def apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            """Reduces the gradients across the process set, then applies them (Keras 2).

            Gradients that ``_compute_gradients``/``get_gradients`` just returned (already
            reduced, Horovod's path) are applied as they are; with ``backward_passes_per_step``
            only on the pass that communicated (the others only advance ``iterations``)."""
            pairs = list(grads_and_vars)
            grads = [g for g, _ in pairs]
            vars = [v for _, v in pairs]
            marked, self._bhvd.prereduced = self._bhvd.prereduced, []
            prereduced = len(marked) == len(grads) > 0 and all(
                g is m for g, m in zip(grads, marked)
            )

            def apply_fn(g: List[Any]) -> Any:
                return super(dist_cls, self).apply_gradients(list(zip(g, vars)), *args, **kwargs)

            def skip_fn() -> Any:
                return self.iterations.assign_add(1)

            if self._agg_helper is not None:
                _build_slots(self, vars)
            if prereduced:
                if self._agg_helper is None:
                    return self._bhvd_apply(apply_fn, grads, vars)
                return self._agg_helper.apply_gradients(
                    lambda: self._bhvd_apply(apply_fn, grads, vars), self, pairs
                )
            return self._bhvd_step(grads, vars, apply_fn, skip_fn)

        def _bhvd_reduce_returned(self: Any, grads: List[Any], vars: List[Any]) -> List[Any]:
            """Horovod's ``_allreduce``: the gradients reduced across the process set, or with
            ``backward_passes_per_step`` added to the local sums (reduced every N-th pass);
            remembered so that ``apply_gradients`` does not reduce them again."""
            if self._agg_helper is not None:
                out = self._agg_helper.compute_gradients(grads, vars)
            else:
                out = self._allreduce(grads, vars)
            self._bhvd.prereduced = list(out)
            return out

        def _compute_gradients(
            self: Any, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
        ) -> Any:
            """Horovod's hook: the wrapped optimizer's gradients of ``loss`` (a tensor computed
            under ``tape``, or a callable) for ``var_list``, reduced across the process set
            (with ``backward_passes_per_step``: aggregated, reduced every N-th call); returns
            ``[(grad, var), ...]``. Not reduced when called from ``minimize``:
            ``apply_gradients`` does it."""
            tape = tf.GradientTape() if tape is None else tape
            parent = super(dist_cls, self)
            if hasattr(parent, "_compute_gradients"):
                gv = parent._compute_gradients(loss, var_list, grad_loss, tape=tape)
            else:  # tf_keras' new optimizers (the default ones) name it compute_gradients
                if grad_loss is not None:
                    raise ValueError(
                        f"grad_loss is not supported by {base.__name__}.compute_gradients"
                    )
                gv = parent.compute_gradients(loss, var_list, tape=tape)
            gv = list(gv)
            if self._bhvd.in_minimize or not gv:
                return gv
            grads, weights = [g for g, _ in gv], [v for _, v in gv]
            return list(zip(_bhvd_reduce_returned(self, grads, weights), weights))

        def compute_gradients(self: Any, loss: Any, var_list: Any, tape: Any = None) -> Any:
            """Horovod's ``compute_gradients``: ``_compute_gradients`` without ``grad_loss``."""
            return self._compute_gradients(loss, var_list, None, tape)

        def minimize(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._bhvd.in_minimize = True
            try:
                return super(dist_cls, self).minimize(*args, **kwargs)
            finally:
                self._bhvd.in_minimize = False

        _DistributedOptimizer.apply_gradients = apply_gradients  # type: ignore[attr-defined]
        _DistributedOptimizer._compute_gradients = _compute_gradients  # type: ignore
        _DistributedOptimizer.compute_gradients = compute_gradients  # type: ignore
        _DistributedOptimizer.minimize = minimize  # type: ignore[attr-defined]

        if hasattr(base, "get_gradients"):

            def get_gradients(self: Any, loss: Any, params: Any) -> Any:
                """The wrapped optimizer's ``get_gradients``, reduced across the process set
                (aggregated with ``backward_passes_per_step``, as Horovod)."""
                grads = list(super(dist_cls, self).get_gradients(loss, params))
                return _bhvd_reduce_returned(self, grads, list(params))

            _DistributedOptimizer.get_gradients = get_gradients  # type: ignore[attr-defined]

        var_attr = getattr(base, "variables", None)
        if isinstance(var_attr, property):

            def _variables_prop(self: Any) -> List[Any]:
                return super(dist_cls, self).variables

            _DistributedOptimizer.variables = property(_variables_prop)  # type: ignore
        elif callable(var_attr):

            def variables(self: Any) -> List[Any]:
                """The wrapped optimizer's variables (aggregation buffers are not included)."""
                return super(dist_cls, self).variables()

            _DistributedOptimizer.variables = variables  # type: ignore[attr-defined]

    members = {
        k: v
        for k, v in _DistributedOptimizer.__dict__.items()
        if k not in ("__dict__", "__weakref__")
    }
    members["__module__"] = _MODULE
    members["__qualname__"] = base.__name__
    # Same class name as the wrapped optimizer, so that a saved model refers to a known name.
    dist_cls = type(base.__name__, (base,), members)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    opt = dist_cls.from_config(config)
    if local_layers is not None:
        layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
        for layer in layers:
            for v in layer.trainable_weights:
                opt.register_local_var(v)
    return opt


def is_distributed_optimizer(optimizer: Any) -> bool:
    """True for optimizers built by :func:`create_distributed_optimizer`."""
    return bool(getattr(type(optimizer), "_bhvd_distributed", False))
