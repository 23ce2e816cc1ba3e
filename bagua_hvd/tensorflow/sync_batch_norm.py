"""``SyncBatchNormalization``: batch normalization whose training-mode statistics are those of
the global batch (all ranks' samples together), Horovod's ``hvd.SyncBatchNormalization``.

In training mode each rank computes, per channel, its sample count ``n_r``, sum ``sum(x)``
and sum of squares ``sum(x^2)`` (count-weighted, from its local moments), one Sum-allreduce
of the three combines them, and the layer normalizes with ``mean = S1 / N`` and
``var = S2 / N - mean^2`` (biased, as Keras). The moving statistics are updated with those
global values, so they stay identical on every rank. Horovod averages the ranks' local
moments with equal weights; counting samples gives the same result for equal per-rank batch
sizes and the exact global statistics when they differ. The allreduce has a gradient (the
Sum-allreduce of the upstream gradient), so the input gradients are those of the global
batch normalization. At size 1 the layer is a plain BatchNormalization.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import tensorflow as tf

from bagua_hvd.tensorflow.mpi_ops import Sum, allreduce_dense, size

_BatchNormalization = tf.keras.layers.BatchNormalization


def _base_accepts_fused() -> bool:
    # tf_keras (TF_USE_LEGACY_KERAS=1) has a `fused` argument; Keras 3 rejects unknown kwargs.
    try:
        return "fused" in inspect.signature(_BatchNormalization.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


class SyncBatchNormalization(_BatchNormalization):
    """Synchronous batch normalization: statistics are synchronized across all workers
    during training (a subclass of ``tf.keras.layers.BatchNormalization``; every other
    argument is BatchNormalization's).

    ``fused`` must be False (``True``/``None`` raise ValueError, as Horovod). Unlike Horovod,
    an unnamed layer gets Keras' unique automatic name (``sync_batch_normalization``,
    ``sync_batch_normalization_1``, ...) instead of the same fixed name for every instance,
    which Keras 3 models would reject as duplicate layer names.
    """

    def __init__(self, fused: Optional[bool] = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if _base_accepts_fused():
            kwargs["fused"] = fused
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Global (all ranks) mean and variance over the reduction axes.

        Keras 3 calls ``_moments(inputs, mask)``; tf_keras calls
        ``_moments(inputs, reduction_axes, keep_dims[, mask])``."""
        if size() == 1:
            return super()._moments(inputs, *args, **kwargs)
        if args and isinstance(args[0], (list, tuple)) or "reduction_axes" in kwargs:
            axes = list(args[0] if args else kwargs["reduction_axes"])
            keep_dims = bool(args[1] if len(args) > 1 else kwargs.get("keep_dims", False))
            mask = args[2] if len(args) > 2 else kwargs.get("mask")
        else:
            axes = list(self._reduction_axes)
            keep_dims = False
            mask = args[0] if args else kwargs.get("mask")
        return self._global_moments(inputs, axes, keep_dims, mask)

    def _global_moments(
        self, inputs: Any, axes: Sequence[int], keep_dims: bool, mask: Any
    ) -> tuple:
        x = tf.convert_to_tensor(inputs)
        dtype = x.dtype if x.dtype in (tf.float32, tf.float64) else tf.float32
        x = tf.cast(x, dtype)
        if mask is None:
            local_mean, local_var = tf.nn.moments(x, axes, keepdims=True)
            shape = tf.shape(x)
            count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), dtype)
            count = count * tf.ones_like(local_mean)
        else:
            w = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), dtype)
            count = tf.reduce_sum(w, axes, keepdims=True)
            safe = tf.maximum(count, 1.0)
            local_mean = tf.reduce_sum(w * x, axes, keepdims=True) / safe
            local_var = tf.reduce_sum(w * tf.square(x - local_mean), axes, keepdims=True) / safe
        # Count-weighted sums: sum(x) = n * mean, sum(x^2) = n * (var + mean^2).
        stats = tf.stack([count * local_mean, count * (local_var + tf.square(local_mean)), count])
        total = allreduce_dense(stats, op=Sum)
        n = tf.maximum(total[2], 1.0)
        mean = total[0] / n
        variance = tf.maximum(total[1] / n - tf.square(mean), 0.0)
        if not keep_dims:
            mean = tf.squeeze(mean, axes)
            variance = tf.squeeze(variance, axes)
        return mean, variance
