"""Synthetic training throughput with bagua_hvd: Horovod's tensorflow2_synthetic_benchmark.py.

Same flags and output as Horovod's script, with `import bagua_hvd.tensorflow as hvd`:

    bagua-run -np 2 python examples/tensorflow2/synthetic_benchmark.py
    bagua-run -np 2 python examples/tensorflow2/synthetic_benchmark.py --model mlp --fp16-allreduce
    bagua-run -np 2 python examples/tensorflow2/synthetic_benchmark.py --model ResNet50 \
        --image-size 224          # keras.applications, weights=None (slow on a few CPU cores)

Each step is one @tf.function: forward and loss under a tf.GradientTape wrapped by
hvd.DistributedGradientTape (the gradients are averaged across ranks), then the optimizer's
update. After the first step, rank 0's model and optimizer variables are broadcast to every rank
(hvd.broadcast_variables inside the tf.function, as in Horovod's script). After
--num-warmup-batches, --num-iters
iterations of --num-batches-per-iter steps are timed; rank 0 prints the images/s of each
iteration, their mean per rank (+- 1.96 standard deviations) and the total over ranks.

Models (--model):
  resnet   a small ResNet from keras.layers (3 stages of 2 basic blocks, 32/64/128 channels)
  mlp      3 hidden Dense layers of 1024 units with ReLU
  <Name>   any keras.applications model built with weights=None (Horovod's default is
           ResNet50 at 224 x 224; nothing is downloaded)
Inputs are --image-size x --image-size x 3 images (default 32) drawn with tf.random.uniform.

--check-sync (not in Horovod's script) checks the run at the end, on every rank, and exits with
status 1 if a check fails:
  - the trainable weights changed during the run, and are bitwise identical on every rank
    (every rank's flattened weights are allgathered and compared with rank 0's);
  - the ranks' batches differ (else identical weights would prove nothing), and one more
    DistributedGradientTape gradient equals the mean over ranks of the ranks' local gradients
    (plain tf.GradientTape on each rank, allgathered and averaged in numpy).
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow import keras  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402

layers = keras.layers


def basic_block(x: tf.Tensor, planes: int, stride: int) -> tf.Tensor:
    """A ResNet basic block: two 3x3 convolutions with batch norm, plus the shortcut."""
    out = layers.Conv2D(planes, 3, strides=stride, padding="same", use_bias=False)(x)
    out = layers.ReLU()(layers.BatchNormalization()(out))
    out = layers.Conv2D(planes, 3, padding="same", use_bias=False)(out)
    out = layers.BatchNormalization()(out)
    shortcut = x
    if stride != 1 or x.shape[-1] != planes:
        shortcut = layers.Conv2D(planes, 1, strides=stride, use_bias=False)(x)
        shortcut = layers.BatchNormalization()(shortcut)
    return layers.ReLU()(layers.Add()([out, shortcut]))


def resnet(args: argparse.Namespace, widths: tuple[int, ...] = (32, 64, 128)) -> keras.Model:
    """A CIFAR-style ResNet: one 3x3 stem, 3 stages of 2 basic blocks, global pooling."""
    inputs = keras.Input((args.image_size, args.image_size, 3))
    x = layers.Conv2D(widths[0], 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for i, planes in enumerate(widths):
        x = basic_block(x, planes, 1 if i == 0 else 2)
        x = basic_block(x, planes, 1)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(args.num_classes)(x), name="resnet")


def mlp(args: argparse.Namespace, hidden: int = 1024, depth: int = 3) -> keras.Model:
    model = keras.Sequential([keras.Input((args.image_size, args.image_size, 3)), layers.Flatten()])
    for _ in range(depth):
        model.add(layers.Dense(hidden, activation="relu"))
    model.add(layers.Dense(args.num_classes))
    return model


MODELS = {"resnet": resnet, "mlp": mlp}


def build_model(args: argparse.Namespace) -> tuple[keras.Model, bool]:
    """The model and whether it outputs logits (keras.applications ends with a softmax)."""
    if args.model in MODELS:
        return MODELS[args.model](args), True
    app = getattr(keras.applications, args.model, None)
    if app is None or not callable(app):
        raise SystemExit(
            f"--model {args.model}: not one of {', '.join(sorted(MODELS))} nor a "
            "keras.applications model"
        )
    shape = (args.image_size, args.image_size, 3)
    return app(weights=None, input_shape=shape, classes=args.num_classes), False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="TensorFlow Synthetic Benchmark",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--fp16-allreduce",
        action="store_true",
        default=False,
        help="use fp16 compression during allreduce",
    )
    parser.add_argument(
        "--model",
        type=str,
        default="resnet",
        help=f"model to benchmark: {', '.join(sorted(MODELS))} or a keras.applications name",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument(
        "--num-warmup-batches",
        type=int,
        default=10,
        help="number of warm-up batches that don't count towards benchmark",
    )
    parser.add_argument(
        "--num-batches-per-iter",
        type=int,
        default=10,
        help="number of batches per benchmark iteration",
    )
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument(
        "--no-cuda", action="store_true", default=False, help="disables CUDA training"
    )
    # Not in Horovod's script.
    parser.add_argument("--image-size", type=int, default=32, help="height and width of inputs")
    parser.add_argument("--num-classes", type=int, default=1000, help="number of classes")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="TensorFlow intra-op threads per rank; 0: this host's cores divided by the ranks "
        "on it",
    )
    parser.add_argument(
        "--check-sync",
        action="store_true",
        default=False,
        help="at the end, check that the weights changed and are identical on every rank and "
        "that the averaged gradient is the mean of the ranks' gradients (exit status 1 if not)",
    )
    parser.add_argument(
        "--skip-broadcast",
        action="store_true",
        default=False,
        help="do not broadcast rank 0's variables after the first step (the ranks then keep "
        "different weights: shows that --check-sync catches it)",
    )
    args = parser.parse_args(argv)
    for name in ("batch_size", "num_batches_per_iter", "num_iters", "image_size", "num_classes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("num_warmup_batches", "num_threads"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def flat(variables: list) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in variables])


def check_sync(
    args: argparse.Namespace,
    model: keras.Model,
    loss_fn,
    data: tf.Tensor,
    target: tf.Tensor,
    initial: np.ndarray,
    compression,
) -> list[str]:
    """The --check-sync checks; returns the failures (empty: all passed)."""
    failures = []
    size = hvd.size()
    weights = flat(model.trainable_variables)
    if np.array_equal(weights, initial):
        failures.append("the trainable weights did not change during the run")
    everyone = hvd.allgather(tf.constant(weights[np.newaxis]), name="check.weights").numpy()
    for r in range(size):
        if not np.array_equal(everyone[r], everyone[0]):
            diff = np.abs(everyone[r] - everyone[0]).max()
            failures.append(f"rank {r}'s weights differ from rank 0's (max |diff| {diff:.3g})")
    batches = hvd.allgather(tf.reshape(data, [1, -1]), name="check.data").numpy()
    if size > 1 and all(np.array_equal(batches[r], batches[0]) for r in range(size)):
        failures.append("every rank trained on the same batch: the weight check proves nothing")

    # One more gradient, averaged by the tape, against the mean of the local gradients.
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = loss_fn(model(data, training=True))
    local = flat(tape.gradient(loss, variables))
    with tf.GradientTape() as tape:
        loss = loss_fn(model(data, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    averaged = flat(tape.gradient(loss, variables))
    locals_ = hvd.allgather(tf.constant(local[np.newaxis]), name="check.grads").numpy()
    expected = locals_.mean(axis=0)
    # fp16 compression rounds every gradient to 11 significant bits before the sum.
    rtol = 2e-3 if args.fp16_allreduce else 1e-5
    err = np.abs(averaged - expected).max() / max(np.abs(expected).max(), 1e-30)
    if err > rtol:
        failures.append(
            f"the averaged gradient is not the mean of the ranks' gradients "
            f"(max error {err:.3g} of the largest component, tolerance {rtol:g})"
        )
    if size > 1 and np.array_equal(locals_[0], locals_[1]):
        failures.append("the ranks' local gradients are identical: averaging proves nothing")
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    if not args.no_cuda:
        # Horovod: pin GPU to be used to process local rank (one GPU per process).
        gpus = tf.config.experimental.list_physical_devices("GPU")
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        if gpus:
            tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    device = "GPU" if not args.no_cuda and tf.config.list_logical_devices("GPU") else "CPU"

    # Every rank starts from its own random weights: the broadcast after the first step makes
    # them rank 0's. Data differs between ranks too.
    tf.random.set_seed(1234 + hvd.rank())
    model, logits = build_model(args)
    opt = keras.optimizers.SGD(0.01)
    opt.build(model.trainable_variables)  # Keras 3 creates its variables here, not in the step

    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform(
        [args.batch_size, 1], minval=0, maxval=args.num_classes, dtype=tf.int64
    )

    def loss_fn(output: tf.Tensor) -> tf.Tensor:
        return tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(target, output, from_logits=logits)
        )

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    @tf.function
    def benchmark_step(first_batch: bool = False) -> None:
        # Horovod: use DistributedGradientTape
        with tf.GradientTape() as tape:
            loss = loss_fn(model(data, training=True))
        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        #
        # Note: broadcast should be done after the first gradient step to ensure optimizer
        # initialization.
        if first_batch and not args.skip_broadcast:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    def log(s: str, nl: bool = True) -> None:
        if hvd.rank() != 0:
            return
        print(s, end="\n" if nl else "", flush=True)

    n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    log(f"Model: {args.model} ({n_params / 1e6:.2f}M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    log(f"TensorFlow intra-op threads per rank: {threads}")

    with tf.device(device):
        # Warm-up
        log("Running warmup...")
        benchmark_step(first_batch=True)
        # After the broadcast: every rank holds rank 0's weights, the run's starting point.
        initial = flat(model.trainable_variables)
        timeit.timeit(benchmark_step, number=args.num_warmup_batches)

        # Benchmark
        log("Running benchmark...")
        img_secs = []
        for x in range(args.num_iters):
            time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
            img_sec = args.batch_size * args.num_batches_per_iter / time
            log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
            img_secs.append(img_sec)

        # Results
        img_sec_mean = np.mean(img_secs)
        img_sec_conf = 1.96 * np.std(img_secs)
        log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
        log(
            f"Total img/sec on {hvd.size()} {device}(s): "
            f"{hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}"
        )

        if args.check_sync:
            failures = check_sync(args, model, loss_fn, data, target, initial, compression)
            for f in failures:
                print(f"rank {hvd.rank()}: check-sync FAILED: {f}", file=sys.stderr, flush=True)
            if failures:
                return 1
            log(
                f"check-sync passed: weights changed and identical on {hvd.size()} rank(s); "
                "averaged gradient = mean of the ranks' gradients"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
