"""``DistributedGradientTape`` and ``PartialDistributedGradientTape`` (Horovod's TF2 tapes).

``tape.gradient(target, sources)`` computes the local gradients with the wrapped
``tf.GradientTape`` and reduces them across the process set: dense gradients in one grouped
allreduce (or one per group with ``groups``), ``tf.IndexedSlices`` through the allgather path
unless ``sparse_as_dense``. ``None`` gradients stay ``None``. Works eagerly and inside
``tf.function`` (the collectives are stateful ops that run in program order on every rank).

``algorithm=`` (BAGUA's algorithms, ``bagua_hvd.tensorflow.algorithms``) replaces the gradient
allreduce by the algorithm's ``reduce_gradients``; see :func:`DistributedGradientTape`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Sequence, Tuple

import tensorflow as tf

from bagua_hvd.common import algorithms as _common_algorithms
from bagua_hvd.common import config
from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.common.util import check_predivide_and_groups, split_list
from bagua_hvd.tensorflow.compression import Compression
from bagua_hvd.tensorflow.functions import grouped_allreduce
from bagua_hvd.tensorflow.mpi_ops import (
    Average,
    allreduce_kernel,
    process_set_size,
    rocm_built,
    tf_variable,
    traced_set_size,
)


def variable_key(v: Any) -> Any:
    """A hashable key for a variable (or tensor): ``ref()``; a Keras 3 variable (no ``ref``,
    not hashable) is keyed by the tf.Variable it wraps; anything else by its id."""
    inner = tf_variable(v)
    return inner.ref() if hasattr(inner, "ref") else id(v)


def _scale_local(grad: Any, n: Any) -> Any:
    """A worker-local gradient divided by the set size (Horovod's scale_local_gradients; ``n``:
    an int, or a size tensor in an elastic job's graph)."""
    if grad is None or (isinstance(n, int) and n <= 1):
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            grad.values / tf.cast(n, grad.values.dtype), grad.indices, grad.dense_shape
        )
    return grad / tf.cast(n, grad.dtype)


def filtered_reduce(
    reduce_fn: Callable[[List[Any], List[Any]], List[Any]],
    grads: Sequence[Any],
    vars: Sequence[Any],
    local_keys: set,
    process_set: ProcessSet,
    scale_local_gradients: bool,
) -> List[Any]:
    """``reduce_fn(grads, vars)`` on the gradients of the non-local variables; the local ones
    (keys ``variable_key(var)`` in ``local_keys``) stay local, divided by the set size when
    ``scale_local_gradients`` (Horovod PR 3695). Shared by the tapes, the tf.compat.v1
    optimizer and the Keras optimizer."""
    idx = [i for i, v in enumerate(vars) if variable_key(v) not in local_keys]
    out = list(grads)
    if idx:
        reduced = reduce_fn([grads[i] for i in idx], [vars[i] for i in idx])
        for i, g in zip(idx, reduced):
            out[i] = g
    if scale_local_gradients and local_keys:
        n = traced_set_size(process_set)
        out = [
            _scale_local(g, n) if variable_key(v) in local_keys else g for g, v in zip(out, vars)
        ]
    return out


def make_allreduce_grads_fn(
    name: str,
    compression: Any,
    sparse_as_dense: bool,
    op: int,
    gradient_predivide_factor: float,
    groups: Any,
    process_set: ProcessSet,
) -> Callable[..., List[Any]]:
    """Returns ``allreduce_grads(grads, vars, use_generic_names)`` (Horovod's helper of the
    same name): reduces a flat list of gradients, keeping ``None`` entries."""
    if op == Average:
        # Horovod splits the averaging around the sum: x (1/f) before, x (f / size) after.
        prescale_factor = 1.0 / gradient_predivide_factor
        postscale_factor = gradient_predivide_factor
    else:
        prescale_factor = postscale_factor = 1.0
    group_refs = (
        [[variable_key(v) for v in g] for g in groups] if isinstance(groups, list) else None
    )

    def allreduce_grads(
        grads: List[Any], vars: Sequence[Any] | None = None, use_generic_names: bool = False
    ) -> List[Any]:
        grads = list(grads)
        if sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        if not present or process_set_size(process_set) <= 1:
            return grads  # Horovod's _allreduce_cond: identity on a set of one rank
        if group_refs is not None:
            if vars is None:
                raise ValueError("groups given as lists of variables need the gradients' sources")
            where = {variable_key(vars[i]): (i, g) for i, g in present}
            split = []
            for group in group_refs:
                chunk = [where.pop(r) for r in group if r in where]
                if chunk:
                    split.append(chunk)
            # Gradients of variables in no group are reduced one by one (as Horovod).
            split.extend([[ig] for ig in sorted(where.values(), key=lambda x: x[0])])
        elif groups is not None and groups > 0:
            split = [c for c in split_list(present, int(groups)) if c]
        else:
            split = [present]
        out = list(grads)
        with tf.name_scope(name + "_Allreduce"):
            for chunk in split:
                idx = [i for i, _ in chunk]
                gs = [g for _, g in chunk]
                if not any(isinstance(g, tf.IndexedSlices) for g in gs):
                    cs, ctxs = zip(*[compression.compress(g) for g in gs])
                    kernel = allreduce_kernel(
                        cs, op, prescale_factor, postscale_factor, process_set, use_generic_names
                    )
                    if kernel is not None:  # in a graph: the kernel added here, no call between
                        ops, attrs = kernel
                        rs = ops.bagua_hvd_collective(list(cs), **attrs)
                        for i, r, c, g in zip(idx, rs, ctxs, gs):
                            r.set_shape(g.shape)
                            out[i] = compression.decompress(r, c)
                        continue
                reduced = grouped_allreduce(
                    gs, compression=compression, op=op, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor, process_set=process_set,
                    ignore_name_scope=use_generic_names,
                )  # fmt: skip
                for i, r in zip(idx, reduced):
                    out[i] = r
        return out

    return allreduce_grads


class _DistributedGradientTape(tf.GradientTape):
    """Methods copied into a subclass of the wrapped tape's class (as Horovod does)."""

    def __init__(
        self,
        tape: Any,
        compression: Any,
        sparse_as_dense: bool,
        op: int,
        gradient_predivide_factor: float,
        groups: Any,
        persistent: bool = False,
        watch_accessed_variables: bool = True,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
        algorithm: Any = None,
    ) -> None:
        tf.GradientTape.__init__(self, persistent, watch_accessed_variables)
        self._tape = tape  # the wrapped tape's recording: gradient() reads it
        self._allreduce_grads = make_allreduce_grads_fn(
            "DistributedGradientTape", compression, sparse_as_dense, op,
            gradient_predivide_factor, groups, process_set,
        )  # fmt: skip
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set = set()
        self.algorithm = algorithm
        # The algorithm's implementation: one per algorithm object and process set (tapes are
        # built every step; its state must outlive them).
        self._algo_impl: Any = None
        if algorithm is not None:
            import bagua_hvd.tensorflow.algorithms as _alg

            self._algo_impl = _alg.tape_impl(algorithm, process_set)
        self._last_sources: List[Any] = []

    def register_local_source(self, source: Any) -> None:
        """Marks a variable as worker-local: its gradient is not reduced across ranks (it is
        divided by the set size when ``scale_local_gradients``)."""
        self._local_sources.add(variable_key(source))

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """The wrapped tape's gradients, reduced (``op``) across the process set, or, with an
        ``algorithm``, as the algorithm hands them to the optimizer."""
        grads = tf.GradientTape.gradient(
            self, target, sources, output_gradients, unconnected_gradients
        )
        if self._algo_impl is None and not self._local_sources and self.process_set.included():
            # Horovod's path, no call in between (docs/design-core.md).
            flat = self._allreduce_grads(
                tf.nest.flatten(grads), tf.nest.flatten(sources), use_generic_names
            )
            return tf.nest.pack_sequence_as(sources, flat)
        return self._reduce(grads, sources, use_generic_names)

    def get_local_and_global_gradients(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> Tuple[List[Tuple[Any, Any]], List[Tuple[Any, Any]]]:
        """Horovod's helper: ``(local_vars_grads, global_vars_grads)``, two lists of
        ``(source, gradient)`` pairs in the order of ``sources``: the worker-local sources'
        (:meth:`register_local_source`, ``local_layers``) and the others', each with what
        :meth:`gradient` returns for it (a local source's own gradient, divided by the set size
        when ``scale_local_gradients``; a global one's reduced across the process set)."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local: List[Tuple[Any, Any]] = []
        glob: List[Tuple[Any, Any]] = []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if variable_key(s) in self._local_sources else glob).append((s, g))
        return local, glob

    def step_done(self, variables: Any = None) -> None:
        """Call after ``optimizer.apply_gradients(...)`` when the tape has an ``algorithm`` that
        acts after the update (``LowPrecisionDecentralized``, ``AsyncModelAverage``; a no-op for
        the others and without an algorithm). ``variables`` default to the (global) sources of
        this tape's last :meth:`gradient` call."""
        impl = self._algo_impl
        if impl is None or not self.process_set.included():
            return
        flat = tf.nest.flatten(variables) if variables is not None else self._last_sources
        impl.after_apply(list(flat))

    def _reduce(self, grads: Any, sources: Any, use_generic_names: bool) -> Any:
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        if not self.process_set.included():
            return grads

        def reduce(gs: List[Any], vs: List[Any]) -> List[Any]:
            if self._algo_impl is None:
                return self._allreduce_grads(gs, vs, use_generic_names)
            self._last_sources = vs
            with tf.name_scope("DistributedGradientTape_" + type(self.algorithm).__name__):
                return self._algo_impl.reduce_gradients(gs, vs)

        out = filtered_reduce(
            reduce, flat_grads, flat_sources, self._local_sources, self.process_set,
            self.scale_local_gradients,
        )  # fmt: skip
        return tf.nest.pack_sequence_as(sources, out)


def check_tape_args(op: int, gradient_predivide_factor: float, num_groups: int, groups: Any) -> Any:
    """Horovod's checks of the tape's and the optimizer's arguments; returns the groups."""
    groups = check_predivide_and_groups(
        op, gradient_predivide_factor, num_groups, groups, rocm_built(), stacklevel=4
    )
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError(
                "groups should be a non-negative integer or a list of list of tf.Variable."
            )
    return groups


class _NoQAdamOptimizer:
    """Stands for QAdamOptimizer before its module is imported: nothing is one then."""


def _qadam_optimizer_class() -> type:
    """TensorFlow's QAdamOptimizer, if ``bagua_hvd.tensorflow.algorithms`` (which defines it)
    was imported; not imported here, as it loads Keras and needs the kernel library, which
    Horovod's allreduce (``GradientAllReduce()``) does not."""
    module = sys.modules.get("bagua_hvd.tensorflow.algorithms")
    return _NoQAdamOptimizer if module is None else module.QAdamOptimizer


def resolve_algorithm(
    algorithm: Any, op: int, compression: Any, groups: Any, optimizer: Any = None
) -> Tuple[Any, int]:
    """``(algorithm or None, op)`` for the tapes and the Keras optimizer (``optimizer``: the
    wrapped one): :func:`bagua_hvd.common.algorithms.resolve` with this frontend's names.
    With an algorithm, its module is imported here: without the kernel library that is the
    ImportError naming what to install, as the tape or optimizer is built."""
    resolved = _common_algorithms.resolve(
        algorithm, frontend="tensorflow", op=op, compression=compression, groups=groups,
        optimizer=optimizer, qadam_optimizer_class=_qadam_optimizer_class,
    )  # fmt: skip
    if resolved[0] is not None:
        import bagua_hvd.tensorflow.algorithms  # noqa: F401
    return resolved


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
    algorithm: Any = None,
) -> tf.GradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns gradients reduced across the
    process set (Horovod's ``hvd.DistributedGradientTape``).

    compression: ``Compression.none``/``fp16``/``bf16`` for dense gradients. sparse_as_dense:
    densify ``tf.IndexedSlices`` before the allreduce (else values and indices are allgathered).
    op: Average (default), Sum or Adasum. gradient_predivide_factor (Average only): gradients
    are scaled by ``1/f`` before the sum and ``f/size`` after. groups: an int (split the
    gradients into that many fused requests) or a list of lists of variables (one request per
    list; other gradients one by one); default: one fused request for all gradients.
    ``device_dense``/``device_sparse`` are accepted for compatibility.

    algorithm: one of BAGUA's algorithms (``bagua_hvd.tensorflow.algorithms``:
    ``GradientAllReduce``, ``ByteGrad``, ``Decentralized``, ``LowPrecisionDecentralized``,
    ``QAdamAlgorithm``, ``AsyncModelAverage``; docs/algorithms.md), or a name (``"auto"``:
    the faster of GradientAllReduce and ByteGrad, measured during the first steps; ``Auto``
    takes other candidates). Default None: the
    ``BAGUA_HVD_ALGORITHM`` environment variable (``bagua-run --algorithm``) if set, else
    Horovod's allreduce configured by the arguments above. ``gradient()`` then returns what the
    optimizer must apply (ByteGrad: the compressed average; Decentralized: the local gradients,
    after averaging the sources, which must be variables, with peers). Create the algorithm
    once and pass the same object to every step's tape: its state (step count, residuals,
    replicas) lives with it. Each ``gradient()`` call is one training step. Usage::

        alg = LowPrecisionDecentralized()                 # once

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(model(x), y)
            tape = hvd.DistributedGradientTape(tape, algorithm=alg)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            tape.step_done()  # needed by LowPrecisionDecentralized and AsyncModelAverage

    ``tape.step_done()`` runs the algorithm's part that follows the update (the low-precision
    ring step, the asynchronous averaging's step boundary); it is a no-op for the other
    algorithms and without one, so it can always be called. Forgetting it where it is needed
    raises ValueError at the next step. ``QAdamAlgorithm(q)`` needs ``q``, its
    ``QAdamOptimizer``, to apply the gradients. A non-Horovod algorithm cannot be combined with
    ``compression=`` or ``groups=``; ``GradientAllReduce(hierarchical=False)`` is Horovod's
    path with ``op`` Average or Sum (``average=``).
    """
    groups = check_tape_args(op, gradient_predivide_factor, num_groups, groups)
    named = isinstance(algorithm, str) and algorithm.lower() == "auto"  # the one name taken
    if (algorithm is None and config.algorithm_name()) or named:
        # A tape is built at every step: the environment's (or a named) algorithm is one
        # object for all.
        import bagua_hvd.tensorflow.algorithms as _alg  # loads Keras: only with an algorithm

        algorithm = _alg.environment_algorithm(algorithm)
    algorithm, op = resolve_algorithm(algorithm, op, compression, groups)
    cls = type(
        gradtape.__class__.__name__,
        (gradtape.__class__,),
        {k: v for k, v in _DistributedGradientTape.__dict__.items() if k not in ("__dict__",)},
    )
    return cls(
        gradtape._tape, compression, sparse_as_dense, op, gradient_predivide_factor, groups,
        gradtape._persistent, getattr(gradtape, "_watch_accessed_variables", True),
        process_set=process_set, scale_local_gradients=scale_local_gradients,
        algorithm=algorithm,
    )  # fmt: skip


def _layer_variables(layer: Any) -> List[Any]:
    for attr in ("trainable_weights", "trainable_variables"):
        if hasattr(layer, attr):
            return list(getattr(layer, attr))
    raise ValueError("All local layers must be of tf.keras.layers.Layer type.")


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
    algorithm: Any = None,
) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` whose ``local_layers`` (a layer or a list of layers:
    Keras layers or ``tf.Module`` objects) keep their gradients local (not reduced; divided
    by the set size when ``scale_local_gradients``). With ``algorithm``, the local layers'
    variables are left out of the algorithm (their weights are not averaged either)."""
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    local_vars = [v for layer in local_layers for v in _layer_variables(layer)]
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
        algorithm,
    )  # fmt: skip
    for v in local_vars:
        tape.register_local_source(v)
    return tape
