"""The TensorFlow twin of tests/workers/lp_exit.py: DistributedGradientTape with
LowPrecisionDecentralized; rank 1 sleeps before its last step; the script ends by hvd.shutdown()
(argv[1] == "shutdown") or at interpreter exit."""

import sys
import time

import tensorflow as tf

import bagua_hvd.tensorflow as hvd
from bagua_hvd.tensorflow.algorithms import LowPrecisionDecentralized

hvd.init()
rank = hvd.rank()
tf.random.set_seed(0)
w = tf.Variable(tf.random.normal([64, 32]))
b = tf.Variable(tf.zeros([32]))
alg = LowPrecisionDecentralized()
opt = tf.keras.optimizers.SGD(0.01)
for step in range(5):
    if rank == 1 and step == 4:
        time.sleep(1.0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.random.normal([8, 64]) @ w + b))
    tape = hvd.DistributedGradientTape(tape, algorithm=alg)
    grads = tape.gradient(loss, [w, b])
    opt.apply_gradients(zip(grads, [w, b]))
    tape.step_done()
print(f"rank {rank} done", flush=True)
start = time.monotonic()
if sys.argv[1] == "shutdown":
    hvd.shutdown()
    print(f"rank {rank} shutdown took {time.monotonic() - start:.2f} s", flush=True)
