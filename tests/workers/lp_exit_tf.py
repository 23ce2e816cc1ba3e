"""The TensorFlow twin of tests/workers/lp_exit.py: DistributedGradientTape with
LowPrecisionDecentralized; rank 1 takes its last step only once rank 0 has reached the end
of the script ($LP_EXIT_MARKER); the script ends by hvd.shutdown()
(argv[1] == "shutdown") or at interpreter exit."""

import os
import sys
import time
from pathlib import Path

import tensorflow as tf
from marker import wait_for  # tests/workers/marker.py

import bagua_hvd.tensorflow as hvd
from bagua_hvd.tensorflow.algorithms import LowPrecisionDecentralized

hvd.init()
rank = hvd.rank()
tf.random.set_seed(0)
w = tf.Variable(tf.random.normal([64, 32]))
b = tf.Variable(tf.zeros([32]))
alg = LowPrecisionDecentralized()
opt = tf.keras.optimizers.SGD(0.01)
marker = Path(os.environ["LP_EXIT_MARKER"])
for step in range(5):
    if rank == 1 and step == 4:
        wait_for(marker, "rank 1", "rank 0 reaching the end of the script")
        time.sleep(0.3)  # rank 0 is now in shutdown (or exit), its last exchange in flight
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.random.normal([8, 64]) @ w + b))
    tape = hvd.DistributedGradientTape(tape, algorithm=alg)
    grads = tape.gradient(loss, [w, b])
    opt.apply_gradients(zip(grads, [w, b]))
    tape.step_done()
print(f"rank {rank} done", flush=True)
if rank == 0:
    marker.touch()  # rank 1 takes its last step only now
start = time.monotonic()
if sys.argv[1] == "shutdown":
    hvd.shutdown()
    print(f"rank {rank} shutdown took {time.monotonic() - start:.2f} s", flush=True)
