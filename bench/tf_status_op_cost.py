"""Cost of the graph-mode status op (BaguaHvdRaise, bagua_hvd/tensorflow/kernels.py), one process.

    python bench/tf_status_op_cost.py

Times a tf.function holding one identity tf.numpy_function, with and without the two status
outputs and BaguaHvdRaise after it (what every collective carries on the numpy_function path,
without the kernels; with them collectives are asynchronous kernels), side by side in
alternating rounds; no collective runs, so only TensorFlow's part is measured.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bagua_hvd.tensorflow import kernels  # noqa: E402

CALLS = 2000


def main() -> None:
    op = kernels.load()
    assert op is not None, "bagua_hvd's TensorFlow kernels did not build"
    x = tf.ones([1])

    @tf.function
    def plain(x: tf.Tensor) -> tf.Tensor:
        return tf.numpy_function(lambda a: [np.array(a)], [x], [tf.float32], stateful=True)

    @tf.function
    def with_status(x: tf.Tensor) -> tf.Tensor:
        out, code, msg = tf.numpy_function(
            lambda a: [np.array(a), np.int32(0), b""],
            [x],
            [tf.float32, tf.int32, tf.string],
            stateful=True,
        )
        with tf.control_dependencies([op.bagua_hvd_raise(code, msg)]):
            return tf.identity(out)

    results: dict = {"plain": [], "with_status": []}
    for _ in range(3):
        for name, fn in (("plain", plain), ("with_status", with_status)):
            for _ in range(200):
                fn(x)
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn(x)
            results[name].append((time.perf_counter() - t0) / CALLS * 1e6)
    for name, us in results.items():
        print(f"{name:12s} " + " / ".join(f"{u:.1f}" for u in us) + " us per call (3 rounds)")
    ratio = np.median(results["with_status"]) / np.median(results["plain"])
    print(f"with_status / plain: {ratio:.3f}")


if __name__ == "__main__":
    main()
