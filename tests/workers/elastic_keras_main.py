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
import hashlib
import json
import os
import signal

import numpy as np
from elastic_common import wait_for_host_update
from tensorflow import keras

import bagua_hvd.tensorflow.keras as hvd
from bagua_hvd.tensorflow import algorithms as A

ALGORITHMS = {
    "bytegrad": lambda: A.ByteGrad(error_feedback=True),
    "decentralized": lambda: A.Decentralized(),
    "low_precision_decentralized": lambda: A.LowPrecisionDecentralized(),
    # warmup_steps: a worker that joins must take the step count from the others (agreed), or
    # it would allreduce gradients while they do not.
    "async": lambda: A.AsyncModelAverage(sync_interval_ms=5, warmup_steps=2),
}

p = argparse.ArgumentParser()
p.add_argument("--logfile", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--exit", default="")
p.add_argument("--algorithm", default="", help="one of ALGORITHMS (default: Horovod's allreduce)")
# A host the discovery script adds after epoch E: rank 0 waits (up to --discovery-wait s) at the
# end of epoch E for the driver's notification, so the next commit brings the new worker in.
p.add_argument("--join-after-epoch", type=int, default=-1)
p.add_argument("--discovery-wait", type=float, default=30.0)
args = p.parse_args()

BATCHES, BATCH = 10, 8
start_rank = int(os.environ["HOROVOD_RANK"])
kill = tuple(int(v) for v in args.exit.split(",")) if args.exit else None

hvd.init()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
algorithm = ALGORITHMS[args.algorithm]() if args.algorithm else None
opt = hvd.DistributedOptimizer(
    keras.optimizers.SGD(learning_rate=0.01 * hvd.size()), algorithm=algorithm
)
model.compile(optimizer=opt, loss="mse")


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
        impl = opt._bhvd.impl
        if args.algorithm == "low_precision_decentralized" and impl is not None:
            # Each rank's replicas (self, left, right) after the epoch's exchanges, for the test
            # to check them against its ring neighbours'.
            impl.flush()
            digests = [[hashlib.sha256(t.tobytes()).hexdigest()[:16] for t in reps]
                       for reps in impl.replicas or []]  # fmt: skip
            with open(f"{args.logfile}.replicas.{hvd.rank()}", "a") as f:
                f.write(json.dumps({"epoch": self.epoch, "size": hvd.size(),
                                    "replicas": digests}) + "\n")  # fmt: skip
        if hvd.rank() == 0:
            line = {"epoch": self.epoch, "size": hvd.size(), "start_rank": start_rank,
                    "rendezvous": state.rendezvous, "sizes": list(state.sizes),
                    "params": params()}  # fmt: skip
            with open(args.logfile, "a") as f:
                f.write(json.dumps(line) + "\n")
            if self.epoch == args.join_after_epoch:
                wait_for_host_update(state, args.discovery_wait)
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
