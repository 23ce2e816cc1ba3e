"""Per-op cost of bagua_hvd.tensorflow against bagua_hvd.torch (not a test).

    python -m bagua_hvd.runner.launch -np 2 python bench/tf_overhead.py [iters]

For a 4-byte and a 1 MiB float32 Sum-allreduce it prints the median and p90 time per call
(max over ranks) of: the framework-neutral layer alone (bagua_hvd.common.ops on a numpy
buffer), torch allreduce, TF allreduce eagerly, TF allreduce inside a tf.function (one
allreduce per call) through the BaguaHvdCollective kernel and through the numpy_function path
(the kernels' fallback), and TensorFlow's floor: a tf.function returning tf.identity of its
input. The differences are the frontends' own overhead.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import bagua_hvd.tensorflow as hvd_tf  # noqa: E402
import bagua_hvd.torch as hvd  # noqa: E402
from bagua_hvd.common import ops  # noqa: E402


def _timed(fn, iters: int) -> list:
    for _ in range(max(10, iters // 10)):  # warm-up (tracing, allocator, connections)
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _report(label: str, samples: list) -> None:
    stats = torch.tensor(
        [statistics.median(samples), sorted(samples)[int(len(samples) * 0.9)]], dtype=torch.float64
    )
    stats = hvd.allreduce(stats, op=hvd.Max, name="bench.stats")
    if hvd.rank() == 0:
        med, p90 = stats.tolist()
        print(f"{label:<36} median {med * 1e6:9.1f} us   p90 {p90 * 1e6:9.1f} us", flush=True)


def _bench_size(nbytes: int, iters: int) -> None:
    n = nbytes // 4
    a = np.ones(n, np.float32)
    out = np.empty_like(a)
    desc_in = [(a.ctypes.data, ops.FLOAT32, a.shape)]
    desc_out = [(out.ctypes.data, ops.FLOAT32, out.shape)]

    def raw() -> None:
        h, _ = ops.enqueue(ops.OP_ALLREDUCE, desc_in, desc_out, reduce_op=ops.Sum, urgent=True)
        ops.wait(h)
        ops.release(h)

    x_torch = torch.ones(n)
    x_tf = tf.ones([n])
    graph_fn = tf.function(lambda t: hvd_tf.allreduce(t, op=hvd_tf.Sum))
    graph_fn.get_concrete_function(x_tf)
    hvd_tf.mpi_ops._collective_kernel[0] = False  # the path is chosen at trace time
    numpy_fn = tf.function(lambda t: hvd_tf.allreduce(t, op=hvd_tf.Sum))
    numpy_fn.get_concrete_function(x_tf)
    hvd_tf.mpi_ops._collective_kernel[0] = True
    floor_fn = tf.function(tf.identity)
    cases = [
        ("core layer (numpy buffer)", raw),
        ("torch allreduce", lambda: hvd.allreduce(x_torch, op=hvd.Sum)),
        ("tf allreduce, eager", lambda: hvd_tf.allreduce(x_tf, op=hvd_tf.Sum)),
        ("tf allreduce, tf.function (kernel)", lambda: graph_fn(x_tf)),
        ("tf allreduce, tf.function (numpy)", lambda: numpy_fn(x_tf)),
        ("tf.function(tf.identity), no comm", lambda: floor_fn(x_tf)),
    ]
    if hvd.rank() == 0:
        print(f"--- {nbytes} bytes, {hvd.size()} ranks, {iters} iterations", flush=True)
    for label, fn in cases:
        hvd.barrier()
        _report(label, _timed(fn, iters))


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    hvd.init()
    hvd_tf.init()
    for nbytes in (4, 1 << 20):
        _bench_size(nbytes, iters)
    hvd.barrier()


if __name__ == "__main__":
    main()
