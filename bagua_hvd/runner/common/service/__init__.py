"""Horovod's ``horovod.runner.common.service``: the compute service of the tf.data service
(``compute_service``)."""
