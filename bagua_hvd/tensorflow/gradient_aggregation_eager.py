"""Horovod's ``horovod.tensorflow.gradient_aggregation_eager``: local gradient aggregation for
eager execution (and ``tf.function``), the helper Horovod's Keras optimizer uses with
``backward_passes_per_step > 1`` when it is built eagerly."""

from __future__ import annotations

from typing import Any, Callable, List

from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.tensorflow.gradient_aggregation import LocalGradientAggregationHelper

__all__ = ["LocalGradientAggregationHelperEager"]


class LocalGradientAggregationHelperEager(LocalGradientAggregationHelper):
    """Aggregates gradients locally and communicates them once every
    ``backward_passes_per_step`` passes (Horovod's class of the same name).

    ``compute_gradients(grads, vars)`` adds ``grads`` to local sums (``tf.Variable``s, one per
    gradient; ``tf.IndexedSlices`` are densified when ``sparse_as_dense``, else ValueError)
    and increments ``counter``; when it reaches ``backward_passes_per_step`` the sums are
    reduced with ``allreduce_func(grads, vars)`` (variables registered with
    ``register_local_var`` keep their sum, divided by the set size when
    ``scale_local_gradients``), divided by ``backward_passes_per_step`` when
    ``average_aggregated_gradients``, returned, and the sums and ``counter`` are reset; on the
    other passes the local sums are returned. ``apply_gradients(apply_grads_closure,
    optimizer, *args, **kwargs)`` runs the closure when ``counter`` is 0 (just after a
    communication), else only increments ``optimizer.iterations``. Both work eagerly and in a
    ``tf.function``.

    Args:
        backward_passes_per_step: passes between communications (> 0, else ValueError).
        allreduce_func: ``f(grads, vars) -> reduced grads`` (e.g. the optimizer's).
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients.
        average_aggregated_gradients: divide the sums by ``backward_passes_per_step``.
        process_set: the set the gradients are reduced over (default: global).
        scale_local_gradients: divide local variables' gradients by the set size (default True).
    """

    def __init__(
        self,
        backward_passes_per_step: int,
        allreduce_func: Callable[..., List[Any]],
        sparse_as_dense: bool,
        average_aggregated_gradients: bool,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        super().__init__(
            backward_passes_per_step, allreduce_func, sparse_as_dense,
            average_aggregated_gradients, 0, LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS,
            process_set, scale_local_gradients,
        )  # fmt: skip

    def apply_gradients(  # type: ignore[override]
        self, apply_grads_closure: Callable[[], Any], optimizer: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Runs ``apply_grads_closure`` on a communication pass (``counter`` 0), otherwise
        increments ``optimizer.iterations``; ``args``/``kwargs`` (the optimizer's
        ``apply_gradients`` arguments) are accepted as Horovod's signature has them."""
        return self._apply_gradients_keras(apply_grads_closure, optimizer)
