"""An elastic Keras training (``bagua_hvd.tensorflow.keras``, Keras 3) through ``model.fit`` with
Horovod's elastic callbacks, logging as tests/workers/elastic_torch_main.py does: rank 0
appends one JSON line per epoch (epoch, size, start_rank, rendezvous, the size each committed
batch ran at, the model's parameters) to --logfile, and first a line with the initial
parameters. --exit "EPOCH,BATCH,START_RANK" makes that worker SIGKILL itself before the batch.

Each rank's batch depends on its current rank, the epoch and the batch number only, so the
test can replay the training from the logged sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np
from tensorflow import keras

import bagua_hvd.tensorflow.keras as hvd

p = argparse.ArgumentParser()
p.add_argument("--logfile", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--exit", default="")
args = p.parse_args()

BATCHES, BATCH = 10, 8
start_rank = int(os.environ["HOROVOD_RANK"])
kill = tuple(int(v) for v in args.exit.split(",")) if args.exit else None

hvd.init()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.01 * hvd.size()))
model.compile(optimizer=opt, loss="mse")
opt.build(model.trainable_variables)  # KerasState needs the optimizer's variables


def params() -> list:
    return [float(v) for w in model.get_weights() for v in np.asarray(w).T.flatten()]


def data(epoch: int, rank: int, first: int):
    xs = [
        np.random.default_rng(100000 * rank + 1000 * epoch + b).standard_normal((BATCH, 4))
        for b in range(first, BATCHES)
    ]
    x = np.concatenate(xs).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


class Steps(keras.callbacks.Callback):
    """Kills on schedule; keeps the sizes of the epoch's batches; rank 0 logs each epoch.
    Listed before CommitStateCallback, so that a commit saves what it recorded."""

    def on_train_begin(self, logs=None):
        self.epoch = state.epoch

    def on_batch_begin(self, batch, logs=None):
        if kill == (state.epoch, batch, start_rank):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_batch_end(self, batch, logs=None):
        state.sizes = state.sizes + (hvd.size(),)

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 0:
            line = {"epoch": self.epoch, "size": hvd.size(), "start_rank": start_rank,
                    "rendezvous": state.rendezvous, "sizes": list(state.sizes),
                    "params": params()}  # fmt: skip
            with open(args.logfile, "a") as f:
                f.write(json.dumps(line) + "\n")
        state.sizes = ()


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    while state.epoch < args.epochs:
        x, y = data(state.epoch, hvd.rank(), state.batch)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            Steps(),
            hvd.elastic.CommitStateCallback(state),
        ])  # fmt: skip


def on_reset():
    opt.learning_rate.assign(0.01 * hvd.size())


state = hvd.elastic.KerasState(model, batch=0, epoch=0, rendezvous=0, sizes=())
state.register_reset_callbacks([on_reset])
if hvd.rank() == 0:
    with open(args.logfile, "a") as f:
        f.write(json.dumps({"init": params()}) + "\n")
train(state)
