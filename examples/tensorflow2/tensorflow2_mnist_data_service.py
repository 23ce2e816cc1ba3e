"""Horovod's tensorflow2_mnist_data_service.py on bagua_hvd: a Keras model trained by a Horovod
job whose input pipeline runs in a second Horovod job, the compute job, through TensorFlow's
tf.data service. The data are scikit-learn's 8x8 handwritten digits (built locally, no
download) in place of MNIST. Start the compute job, then this training job:

    bagua-run -np 2 python -m bagua_hvd.tensorflow.data.compute_worker /tmp/compute.json &
    bagua-run -np 2 python examples/tensorflow2/tensorflow2_mnist_data_service.py /tmp/compute.json

The tf.data dispatcher runs in the compute job by default, or in this training job when the
compute job is started with --dispatcher-side training; this script picks the matching
train_fn from the config file. When training is done, rank 0 tells the compute job to stop.
docs/tf-data-service.md.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # the example runs on CPUs, as Horovod's

# The two train_fn modules next to this script (Python puts its folder on sys.path).
from tensorflow2_mnist_data_service_train_fn_compute_side_dispatcher import (  # noqa: E402
    train_fn as train_fn_compute_side,
)
from tensorflow2_mnist_data_service_train_fn_training_side_dispatcher import (  # noqa: E402
    train_fn as train_fn_training_side,
)

from bagua_hvd.runner.common.util import env  # noqa: E402
from bagua_hvd.tensorflow.data.compute_service import TfDataServiceConfig  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configfile", help="the compute job's config file")
    parser.add_argument(
        "--training-tasks", type=int, dest="training_tasks",
        help="the number of training ranks with a single dispatcher (otherwise one per "
        "dispatcher)",
    )  # fmt: skip
    parser.add_argument(
        "--reuse-dataset", action="store_true", dest="reuse_dataset",
        help="with a single dispatcher, the ranks share one tf.data job (first come first "
        "served) instead of one each",
    )  # fmt: skip
    parser.add_argument(
        "--round-robin", action="store_true", dest="round_robin",
        help="with --reuse-dataset, hand the batches out round robin",
    )  # fmt: skip
    # bagua_hvd additions, to keep a test run short.
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--steps-per-epoch", type=int, default=32, help="over all ranks")
    args = parser.parse_args()

    compute_config = TfDataServiceConfig.read(args.configfile, wait_for_file_creation=True)
    rank, size = env.get_env_rank_and_size()
    if compute_config.dispatchers > 1 and compute_config.dispatchers != size:
        print(
            f"Unless there is only one dispatcher, the number of training ranks ({size}) must "
            f"equal the number of dispatchers ({compute_config.dispatchers}) of the compute "
            f"job ({args.configfile}).",
            file=sys.stderr,
        )
        sys.exit(1)

    if compute_config.dispatcher_side == "training":
        train_fn = train_fn_training_side
    elif compute_config.dispatcher_side == "compute":
        train_fn = train_fn_compute_side
    else:
        raise ValueError(f"Unsupported dispatcher side: {compute_config.dispatcher_side}")

    train_fn(
        compute_config,
        reuse_dataset=args.reuse_dataset,
        round_robin=args.round_robin,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
    )

    if rank == 0:  # training is done: stop the compute job
        compute = compute_config.compute_client(verbose=2)
        compute.shutdown()
