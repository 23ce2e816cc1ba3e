"""Horovod's ``horovod.tensorflow.gradient_aggregation``: ``LocalGradientAggregationHelper``
(defined in ``bagua_hvd.tensorflow.optimizer``)."""

from bagua_hvd.tensorflow.optimizer import LocalGradientAggregationHelper

__all__ = ["LocalGradientAggregationHelper"]
