"""horovod.spark.keras for bagua_hvd: KerasEstimator and KerasModel for Keras 3 (docs/spark.md)."""

from bagua_hvd.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
