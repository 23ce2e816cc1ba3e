"""Horovod's ``horovod.tensorflow.data``: the tf.data service run by a Horovod compute job
(``compute_service``: ``TfDataServiceConfig``, ``tf_data_service``, ``send_to_data_service``,
``compute_worker_fn``; ``python -m bagua_hvd.tensorflow.data.compute_worker``, the compute job).
docs/tf-data-service.md."""

from bagua_hvd.tensorflow.data.compute_service import (
    TfDataServiceConfig,
    compute_worker_fn,
    send_to_data_service,
    tf_data_service,
)

__all__ = ["TfDataServiceConfig", "compute_worker_fn", "send_to_data_service", "tf_data_service"]
