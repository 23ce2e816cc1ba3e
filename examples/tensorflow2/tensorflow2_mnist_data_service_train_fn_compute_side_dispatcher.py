"""The training function of tensorflow2_mnist_data_service.py when the tf.data dispatcher runs
in the compute job: ``send_to_data_service`` hands the pipeline to the compute job."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import bagua_hvd.tensorflow.keras as hvd
from bagua_hvd.tensorflow.data.compute_service import TfDataServiceConfig


def digits() -> tuple:
    """scikit-learn's handwritten digits as 8x8x1 images in [0, 1] and int64 labels."""
    data = load_digits()
    images = (data.images[..., np.newaxis] / 16.0).astype("float32")
    return images, data.target.astype("int64")


def make_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, [3, 3], activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


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

    images, labels = digits()
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))

    # Everything up to send_to_data_service runs on the compute job's workers.
    dataset = (
        dataset.repeat()
        .shuffle(10000)
        .batch(128)
        .send_to_data_service(
            compute_config, hvd.rank(), hvd.size(),
            reuse_dataset=reuse_dataset, round_robin=round_robin,
        )
        .prefetch(tf.data.experimental.AUTOTUNE)
    )  # fmt: skip

    return train(dataset, images, labels, epochs, steps_per_epoch)


def train(
    dataset: tf.data.Dataset, images: np.ndarray, labels: np.ndarray, epochs: int, steps: int
) -> float:
    """Horovod's recipe on ``dataset``: scaled learning rate, DistributedOptimizer, broadcast
    and warm-up callbacks; then the accuracy on all digits (every rank done reading first)."""
    model = make_model()
    scaled_lr = 0.002 * hvd.size()  # the learning rate grows with the ranks
    opt = hvd.DistributedOptimizer(
        keras.optimizers.Adam(scaled_lr),
        backward_passes_per_step=1,
        average_aggregated_gradients=True,
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"]
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]
    model.fit(
        dataset,
        steps_per_epoch=steps // hvd.size(),  # the steps are shared by the ranks
        callbacks=callbacks,
        epochs=epochs,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    _, accuracy = model.evaluate(images, labels, verbose=0)
    # With training-side dispatchers, rank 0's stops when its context ends: all read by then.
    hvd.allreduce(accuracy, name="tf_data_service_done")
    if hvd.rank() == 0:
        print(f"final accuracy on all {len(labels)} digits: {accuracy:.4f}", flush=True)
    return accuracy
