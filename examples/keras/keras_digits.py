"""Data-parallel Keras 3 training on scikit-learn's handwritten digits with bagua_hvd.

Runs on CPU with no download (the 8x8 digits ship inside scikit-learn):

    bagua-run -np 2 python examples/keras/keras_digits.py

Without the launcher it is a job of size 1. It is a Horovod script: replacing the import line
with `import horovod.tensorflow.keras as hvd` runs it under `horovodrun`. The recipe:
  - the optimizer is wrapped in hvd.DistributedOptimizer (gradients averaged across ranks);
    the learning rate is scaled by hvd.size() and warmed up from lr / size with
    LearningRateWarmupCallback;
  - BroadcastGlobalVariablesCallback(0) makes every replica equal to rank 0's after the first
    batch (each rank starts from a different random initialization here, on purpose);
  - each rank trains on its own shard of the training data and validates on its own shard of
    the test data; MetricAverageCallback averages the epoch's metrics across ranks;
  - rank 0 only keeps the best model (by the averaged val_loss) with hvd's
    BestModelCheckpoint;
  - at the end every rank evaluates the whole test split; rank 0 prints the accuracy.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import bagua_hvd.tensorflow.keras as hvd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="single-rank learning rate")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument(
        "--checkpoint-dir", default=None, help="where rank 0 keeps best.keras (default: temp)"
    )
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(1234 + hvd.rank())  # different initial weights per rank

    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    y = digits.target.astype("int64")
    order = np.random.RandomState(0).permutation(len(x))  # the same split on every rank
    x, y = x[order], y[order]
    n_test = len(x) // 5
    x_test, y_test, x_train, y_train = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    # Each rank's shard of the training and validation data.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    x_val, y_val = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]

    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    scaled_lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1
        ),
    ]
    ckpt_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="keras_digits_")
    if hvd.rank() == 0:  # one writer; after MetricAverageCallback, so it sees averaged metrics
        checkpoint = hvd.callbacks.BestModelCheckpoint(monitor="val_loss")
        checkpoint.filepath = os.path.join(ckpt_dir, "best.keras")  # set later, as Horovod
        callbacks.append(checkpoint)

    start = time.time()
    model.fit(
        x_shard,
        y_shard,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"training took {time.time() - start:.1f} s on {hvd.size()} rank(s)")
        print(f"best model kept in {os.path.join(ckpt_dir, 'best.keras')}")
        print(f"final test loss: {loss:.4f}")
        print(f"final test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
