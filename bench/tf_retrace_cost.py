"""What one retrace of a Keras train step costs, against one step (docs/autotune.md: why the
autotuner does not tune TensorFlow's bucket size, which is fixed when tf.function traces).

    python bench/tf_retrace_cost.py [--model resnet50|mlp] [--repeats 3]

Prints each retrace (a forced new train function and its first step) and a step of the traced
function, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "mlp"], default="resnet50")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import keras
    import numpy as np

    if args.model == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
        x = np.random.rand(8, 64, 64, 3).astype("float32")
    else:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, "relu"),
                                  keras.layers.Dense(10)])  # fmt: skip
        x = np.random.rand(8, 64).astype("float32")
    y = np.random.randint(0, 10, 8)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    model.train_on_batch(x, y)  # the variables and the optimizer's slots exist from here on
    traces, steps = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        model.make_train_function(force=True)
        model.train_on_batch(x, y)
        traces.append(time.perf_counter() - t)
        t = time.perf_counter()
        model.train_on_batch(x, y)
        steps.append(time.perf_counter() - t)
    trace, step = statistics.median(traces), statistics.median(steps)
    print(f"{args.model}: retrace + step {trace:.2f} s (each: "
          + ", ".join(f"{t:.2f}" for t in traces) + f"), step {step:.3f} s")  # fmt: skip
    print(f"ratio retrace / step: {trace / step:.1f}")


if __name__ == "__main__":
    main()
