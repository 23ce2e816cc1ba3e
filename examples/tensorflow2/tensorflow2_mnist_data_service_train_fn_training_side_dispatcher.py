"""The training function of tensorflow2_mnist_data_service.py when the tf.data dispatcher runs
in this training job: ``tf_data_service`` starts it, ``distribute`` uses it."""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow2_mnist_data_service_train_fn_compute_side_dispatcher import digits, train

import bagua_hvd.tensorflow.keras as hvd
from bagua_hvd.tensorflow.data.compute_service import TfDataServiceConfig, tf_data_service


# reuse_dataset and round_robin only matter with a single dispatcher.
def train_fn(
    compute_config: TfDataServiceConfig,
    reuse_dataset: bool = False,
    round_robin: bool = False,
    epochs: int = 24,
    steps_per_epoch: int = 32,
) -> float:
    hvd.init()
    keras.utils.set_random_seed(1234 + hvd.rank())  # the broadcast below makes them equal

    with tf_data_service(compute_config, hvd.rank()) as dispatcher_address:
        images, labels = digits()
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))

        # Everything up to distribute runs on the compute job's workers.
        dataset = (
            dataset.repeat()
            .shuffle(10000)
            .batch(128)
            .apply(
                tf.data.experimental.service.distribute(
                    service=dispatcher_address,
                    processing_mode="distributed_epoch",
                    job_name="job" if reuse_dataset else None,
                    consumer_index=hvd.rank() if round_robin else None,
                    num_consumers=hvd.size() if round_robin else None,
                )
            )
            .prefetch(tf.data.experimental.AUTOTUNE)
        )

        return train(dataset, images, labels, epochs, steps_per_epoch)
