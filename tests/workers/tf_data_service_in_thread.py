"""Horovod's own test pattern (test/parallel/test_compute_worker.py): the compute job runs in
a thread of each training rank (``compute_worker.main``), dispatcher on the compute side, then
on the training side; each rank reads a whole epoch, and after rank 0's shutdown the thread
ends within a few seconds.

    bagua-run -np 2 python tests/workers/tf_data_service_in_thread.py DIRECTORY
"""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402
from bagua_hvd.tensorflow.data.compute_service import (  # noqa: E402
    TfDataServiceConfig,
    tf_data_service,
)
from bagua_hvd.tensorflow.data.compute_worker import main  # noqa: E402

N = 256


def run(side: str, directory: str) -> None:
    configfile = os.path.join(directory, f"in-thread-{side}.json")
    worker = threading.Thread(target=main, args=(1, side, configfile, 30), daemon=True)
    worker.start()
    config = TfDataServiceConfig.read(configfile, wait_for_file_creation=True, timeout=60)
    dataset = tf.data.Dataset.range(N).batch(32)
    if side == "compute":
        got = dataset.send_to_data_service(config, hvd.rank(), hvd.size())
        ids = sorted(i for batch in got.as_numpy_iterator() for i in batch.tolist())
    else:
        with tf_data_service(config, hvd.rank()) as address:
            got = dataset.apply(
                tf.data.experimental.service.distribute("distributed_epoch", address)
            )
            ids = sorted(i for batch in got.as_numpy_iterator() for i in batch.tolist())
            hvd.allgather_object(0, name=f"read_{side}")  # before rank 0's dispatcher stops
    assert ids == list(range(N)), (side, ids)
    hvd.allgather_object(0, name=f"done_{side}")  # every rank read before the shutdown
    if hvd.rank() == 0:
        config.compute_client().shutdown()
    worker.join(30)
    assert not worker.is_alive(), f"{side}: the compute thread did not end"
    print(f"rank {hvd.rank()}: {side} side in-thread: whole epoch read, compute thread ended")


if __name__ == "__main__":
    hvd.init()
    for side in ("compute", "training"):
        run(side, sys.argv[1])
