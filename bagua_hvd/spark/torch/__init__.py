"""horovod.spark.torch for bagua_hvd: TorchEstimator and TorchModel (docs/spark.md)."""

from bagua_hvd.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
