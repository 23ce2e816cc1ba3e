"""Fit scikit-learn's handwritten digits from a Spark DataFrame with bagua_hvd's Spark estimators.

One command, no cluster needed (it starts Spark in local mode, ``local[N]``, itself; the 8x8
digits ship inside scikit-learn):

    python examples/spark/digits_estimator.py --num-proc 2                      # TorchEstimator
    python examples/spark/digits_estimator.py --num-proc 2 --framework keras    # KerasEstimator
    python examples/spark/digits_estimator.py --num-proc 2 --resume             # 10 more epochs

It is a Horovod script: with ``horovod.spark.torch`` / ``horovod.spark.keras`` and
``horovod.spark.common.store`` in the imports (or ``BAGUA_HVD_AS_HOROVOD=1``), it runs unchanged.
The estimator writes the DataFrame to the Store as Parquet, trains on ``--num-proc`` processes
(each a Spark task; rank 0 prints a line per epoch, prefixed ``[0]<stdout>:``), checkpoints every
epoch under ``<store>/runs/<run id>``, and returns a Spark ML model whose ``transform`` adds
``label__output``; the test accuracy is computed from it on a held-out 20 %.
``--resume`` fits again with the same run id: training goes on from the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_STORE = os.path.join(tempfile.gettempdir(), "bagua_hvd_spark_digits_store")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2, help="training processes")
    parser.add_argument("--framework", choices=["torch", "keras"], default="torch")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.003, help="per process (Adam)")
    parser.add_argument("--store", default=DEFAULT_STORE, help="the Store's prefix path")
    parser.add_argument("--run-id", default=None, help="default: digits_<framework>")
    parser.add_argument(
        "--resume", action="store_true", help="keep the run's checkpoint and train on from it"
    )
    parser.add_argument(
        "--algorithm",
        choices=["gradient_allreduce", "bytegrad"],
        default=None,
        help="a BAGUA algorithm for DistributedOptimizer (torch; default: Horovod's allreduce)",
    )
    parser.add_argument("--verbose", type=int, default=1, help="2: a line per step too")
    parser.add_argument(
        "--min-accuracy", type=float, default=0.0, help="exit with status 1 below this"
    )
    args = parser.parse_args(argv)
    for name in ("num_proc", "epochs", "batch_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def spark_session(num_proc: int):
    """Spark in local mode, one task slot per process, its Python workers this Python."""
    import bagua_hvd

    os.environ["PYSPARK_PYTHON"] = sys.executable
    # The ranks and Spark's Python workers import bagua_hvd from where this script did.
    root = str(Path(bagua_hvd.__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{num_proc}]")
        .appName("bagua_hvd digits estimator")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", str(num_proc))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def digits_frames(spark):
    """(train DataFrame, test DataFrame, test labels): the pixels as an ML vector, 20 % held
    out by a permutation seeded 0."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits

    data = load_digits()
    x = data.data / 16.0
    y = data.target.astype(int)
    order = np.random.RandomState(0).permutation(len(x))
    n_test = len(x) // 5

    def frame(idx):
        rows = [(int(i), Vectors.dense(x[i]), int(y[i])) for i in idx]
        return spark.createDataFrame(rows, ["id", "features", "label"])

    test = np.sort(order[:n_test])
    return frame(order[n_test:]), frame(test), y[test]


def common(args: argparse.Namespace, store, run_id: str) -> dict:
    """The estimators' parameters besides the model and how it trains."""
    return dict(
        num_proc=args.num_proc,
        store=store,
        feature_cols=["features"],
        label_cols=["label"],
        validation=0.1,
        batch_size=args.batch_size,
        epochs=args.epochs,
        run_id=run_id,
        random_seed=1,
        verbose=args.verbose,
    )


def torch_estimator(args: argparse.Namespace, store, run_id: str):
    import torch
    from torch import nn

    from bagua_hvd.spark.torch import TorchEstimator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    algorithm = None
    if args.algorithm:
        from bagua_hvd.torch import algorithms

        algorithm = {
            "gradient_allreduce": algorithms.GradientAllReduce,
            "bytegrad": algorithms.ByteGrad,
        }[args.algorithm]()
    return TorchEstimator(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=args.lr),
        loss=nn.CrossEntropyLoss(),
        metrics=[accuracy],
        input_shapes=[[-1, 64]],
        algorithm=algorithm,
        **common(args, store, run_id),
    )


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def keras_estimator(args: argparse.Namespace, store, run_id: str):
    import keras

    from bagua_hvd.spark.keras import KerasEstimator

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    return KerasEstimator(
        model=model,
        optimizer=keras.optimizers.Adam(args.lr),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        **common(args, store, run_id),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bagua_hvd.spark.common.store import Store

    spark = spark_session(args.num_proc)
    try:
        train_df, test_df, y_test = digits_frames(spark)
        store = Store.create(args.store)
        run_id = args.run_id or f"digits_{args.framework}"
        if not args.resume:
            store.delete(store.get_run_path(run_id))  # a fresh run
        make = torch_estimator if args.framework == "torch" else keras_estimator
        model = make(args, store, run_id).fit(train_df)
        rows = model.transform(test_df).select("id", "label__output").collect()
        rows.sort(key=lambda r: r["id"])
        predicted = np.array([np.argmax(r["label__output"].toArray()) for r in rows])
        acc = float((predicted == y_test).mean())
        print(f"checkpoint: {store.get_checkpoint_path(run_id)}/checkpoint")
        print(f"test accuracy: {acc:.4f} ({len(y_test)} held-out digits)")
    finally:
        spark.stop()
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
