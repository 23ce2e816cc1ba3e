"""Horovod's ``hvd.DistributedOptimizer`` for ``bagua_hvd.tensorflow``.

- A legacy ``tf.compat.v1.train.Optimizer`` (GradientDescentOptimizer, MomentumOptimizer,
  AdamOptimizer, ...) is wrapped in :class:`_DistributedOptimizer`: ``compute_gradients``
  returns the gradients reduced across the process set (``op``, Average by default), and
  ``apply_gradients`` / ``minimize`` apply them with the wrapped optimizer. Works in TF1-style
  graphs (``tf.compat.v1`` sessions) and eagerly. ``backward_passes_per_step > 1`` accumulates
  gradients locally and communicates every N-th pass (graph mode only, as Horovod).
- Any other optimizer (Keras) goes to ``bagua_hvd.tensorflow.keras.DistributedOptimizer``.
"""

from __future__ import annotations

from typing import Any, List

import tensorflow as tf

from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.tensorflow.compression import Compression
from bagua_hvd.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from bagua_hvd.tensorflow.mpi_ops import Adasum, Average, rank
from bagua_hvd.tensorflow.tape import (
    check_tape_args,
    filtered_reduce,
    make_allreduce_grads_fn,
    variable_key,
)

_LegacyOptimizer = getattr(getattr(tf.compat.v1, "train", None), "Optimizer", None)


if _LegacyOptimizer is not None:

    class _DistributedOptimizer(_LegacyOptimizer):  # type: ignore[misc, valid-type]
        """Wraps a ``tf.compat.v1.train.Optimizer``: an allreduce combines the gradients
        before the wrapped optimizer applies them."""

        def __init__(
            self,
            optimizer: Any,
            name: str | None = None,
            use_locking: bool = False,
            device_dense: str = "",
            device_sparse: str = "",
            compression: Any = Compression.none,
            sparse_as_dense: bool = False,
            op: int = Average,
            gradient_predivide_factor: float = 1.0,
            backward_passes_per_step: int = 1,
            average_aggregated_gradients: bool = False,
            groups: Any = None,
            process_set: ProcessSet = global_process_set,
            scale_local_gradients: bool = True,
        ) -> None:
            if name is None:
                name = f"Distributed{type(optimizer).__name__}"
            super().__init__(name=name, use_locking=use_locking)
            self._optimizer = optimizer
            self._allreduce_grads = make_allreduce_grads_fn(
                name, compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                process_set,
            )  # fmt: skip
            self._local_vars: set = set()
            self.process_set = process_set
            self.scale_local_gradients = scale_local_gradients
            self._agg_helper: LocalGradientAggregationHelper | None = None
            if backward_passes_per_step > 1:
                if tf.executing_eagerly():
                    raise ValueError(
                        "backward_passes_per_step > 1 is not yet supported "
                        "for _LegacyOptimizer with eager execution."
                    )
                self._agg_helper = LocalGradientAggregationHelper(
                    backward_passes_per_step, self._allreduce_grads, sparse_as_dense,
                    average_aggregated_gradients, rank(),
                    LocalGradientAggregationHelper._OPTIMIZER_TYPE_LEGACY, process_set,
                    scale_local_gradients, name,
                )  # fmt: skip

        def register_local_var(self, var: Any) -> None:
            """Marks a variable as worker-local: its gradient is not reduced across ranks."""
            if self._agg_helper is not None:
                self._agg_helper.register_local_var(var)
            else:
                self._local_vars.add(variable_key(var))

        def compute_gradients(self, *args: Any, **kwargs: Any) -> List[tuple]:
            """The wrapped optimizer's ``compute_gradients``, with the gradients reduced
            across the process set (``op``); returns ``[(grad, var), ...]``."""
            gradients = self._optimizer.compute_gradients(*args, **kwargs)
            grads, vars = zip(*gradients)
            if self._agg_helper is not None:
                reduced = self._agg_helper.compute_gradients(grads, vars)
            elif not self.process_set.included():
                reduced = list(grads)
            else:
                reduced = filtered_reduce(
                    self._allreduce_grads, grads, vars, self._local_vars, self.process_set,
                    self.scale_local_gradients,
                )  # fmt: skip
            return list(zip(reduced, vars))

        def apply_gradients(
            self, grads_and_vars: Any, global_step: Any = None, name: str | None = None
        ) -> Any:
            """Calls the wrapped optimizer's ``apply_gradients``."""
            if self._agg_helper is not None:
                grads_and_vars = list(grads_and_vars)
                return self._agg_helper.apply_gradients(
                    lambda: self._optimizer.apply_gradients(
                        grads_and_vars, global_step=global_step, name=name
                    ),
                    self._optimizer, grads_and_vars, global_step=global_step, name=name,
                )  # fmt: skip
            return self._optimizer.apply_gradients(
                grads_and_vars, global_step=global_step, name=name
            )

        def get_slot(self, *args: Any, **kwargs: Any) -> Any:
            """Calls the wrapped optimizer's ``get_slot``."""
            return self._optimizer.get_slot(*args, **kwargs)

        def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
            """Calls the wrapped optimizer's ``get_slot_names``."""
            return self._optimizer.get_slot_names(*args, **kwargs)

        def variables(self, *args: Any, **kwargs: Any) -> Any:
            """Calls the wrapped optimizer's ``variables``."""
            return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
    algorithm: Any = None,
) -> Any:
    """Wraps an optimizer so that gradients are reduced across the process set before they
    are applied (Horovod's ``hvd.DistributedOptimizer``).

    A legacy ``tf.compat.v1.train.Optimizer`` gets :class:`_DistributedOptimizer` (graph mode
    and eager); any other (Keras) optimizer goes to
    ``bagua_hvd.tensorflow.keras.DistributedOptimizer`` (``algorithm``, a BAGUA algorithm, is
    passed there; the legacy path accepts only None). op: Average (default), Sum;
    Adasum is not implemented for legacy optimizers (NotImplementedError) and not supported
    with Keras (ValueError). gradient_predivide_factor (Average only): scale by ``1/f``
    before the sum and ``f/size`` after. groups: int or list of lists of variables (fused
    requests). backward_passes_per_step > 1: accumulate locally, communicate every N passes
    (graph mode only for legacy optimizers; ``average_aggregated_gradients`` divides the sum
    by N). ``device_dense``/``device_sparse``/``use_locking`` are accepted for compatibility.
    Horovod drops ``op`` and ``groups`` on the Keras path; here they are passed on.
    """
    groups = check_tape_args(op, gradient_predivide_factor, num_groups, groups)
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")

    if _LegacyOptimizer is not None and isinstance(optimizer, _LegacyOptimizer):
        if algorithm is not None:
            raise ValueError(
                "algorithm= (BAGUA algorithms) needs a Keras optimizer; a legacy "
                "tf.compat.v1.train.Optimizer supports only Horovod's allreduce"
            )
        if op == Adasum:
            if process_set.process_set_id != 0:
                raise NotImplementedError("Adasum does not support process sets yet")
            raise NotImplementedError(
                "op == Adasum (Horovod's _DistributedAdasumOptimizer) is not implemented for "
                "tf.compat.v1.train optimizers in bagua_hvd; use op=Average or op=Sum"
            )
        return _DistributedOptimizer(
            optimizer=optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
            device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients,
        )  # fmt: skip

    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    import bagua_hvd.tensorflow.keras as hvd_k  # lazily: bagua_hvd.tensorflow loads no Keras

    kwargs = dict(
        optimizer=optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients,
    )  # fmt: skip
    if algorithm is not None:
        kwargs["algorithm"] = algorithm
    return hvd_k.DistributedOptimizer(**kwargs)
