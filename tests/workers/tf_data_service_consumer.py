"""A training job of tests/test_tf_data_service.py: reads a compute job's config, consumes a
small dataset through the tf.data service in three ways, and checks on every rank what each
rank received against what Horovod's options imply, with every element's value recomputed here
in numpy. Rank 0 then asks the compute job to stop (unless --no-shutdown).

    bagua-run -np 2 python tests/workers/tf_data_service_consumer.py CONFIGFILE [--no-shutdown]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402
from bagua_hvd.tensorflow.data import (  # noqa: E402
    TfDataServiceConfig,
    send_to_data_service,
    tf_data_service,
)

N, BATCH = 240, 16
# (processing_mode, reuse_dataset): each a tf.data job per rank or one shared.
CASES = [("distributed_epoch", False), ("parallel_epochs", False), ("distributed_epoch", True)]


def source() -> tf.data.Dataset:
    # The map runs on the compute job's workers: the values are checked against value().
    return tf.data.Dataset.range(N).map(lambda i: (i, (i * i) % 997 + 3)).batch(BATCH)


def value(ids: np.ndarray) -> np.ndarray:
    return (ids * ids) % 997 + 3


def expected(config: TfDataServiceConfig, mode: str, reuse: bool, rank: int, size: int) -> tuple:
    """(the ranks whose elements together make one share, the ids that share holds sorted)."""
    per_dispatcher = size if config.dispatchers == 1 else 1
    group = [r for r in range(size) if r // per_dispatcher == rank // per_dispatcher]
    if mode == "parallel_epochs":  # every worker of the dispatcher produces the whole epoch
        return [rank], sorted(list(range(N)) * config.workers_per_dispatcher)
    if reuse:  # the dispatcher's ranks share one job: together they get each element once
        return group, list(range(N))
    return [rank], list(range(N))  # a job per rank: the workers split one epoch for it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("configfile")
    parser.add_argument("--no-shutdown", action="store_true")
    args = parser.parse_args()

    config = TfDataServiceConfig.read(args.configfile, wait_for_file_creation=True, timeout=120)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    if config.dispatcher_side == "training":
        try:
            send_to_data_service(source(), config, rank, size)
            sys.exit("send_to_data_service accepted a training-side config")
        except RuntimeError as e:
            assert "tf_data_service" in str(e), e
        service = tf_data_service(config, rank)
    else:
        service = contextlib.nullcontext()

    with service as dispatcher_address:
        for case, (mode, reuse) in enumerate(CASES):
            if dispatcher_address is None:  # compute side: Horovod's Dataset method
                dataset = source().send_to_data_service(
                    config, rank, size, processing_mode=mode, reuse_dataset=reuse
                )
            else:
                dataset = source().apply(
                    tf.data.experimental.service.distribute(
                        processing_mode=mode,
                        service=dispatcher_address,
                        job_name="job" if reuse else None,
                    )
                )
            ids, values = [], []
            for batch_ids, batch_values in dataset.as_numpy_iterator():
                assert 0 < len(batch_ids) <= BATCH, batch_ids
                ids.extend(batch_ids.tolist())
                values.extend(batch_values.tolist())
            ids_np = np.asarray(ids, dtype=np.int64)
            assert np.array_equal(np.asarray(values, dtype=np.int64), value(ids_np)), (ids, values)
            everyone = hvd.allgather_object(ids, name=f"tf_data_service_case_{case}")
            group, want = expected(config, mode, reuse, rank, size)
            got = sorted(i for r in group for i in everyone[r])
            assert got == want, (
                f"rank {rank}: {mode} reuse={reuse}: ranks {group} got {len(got)} elements "
                f"{got[:20]}..., expected {len(want)}: per rank {[len(e) for e in everyone]}"
            )
            print(
                f"rank {rank}: {mode} reuse_dataset={reuse}: {len(ids)} elements, values "
                f"checked, share of ranks {group} complete",
                flush=True,
            )
        hvd.allgather_object(rank, name="tf_data_service_done")  # all read before it stops

    if rank == 0 and not args.no_shutdown:
        config.compute_client(verbose=2).shutdown()
        print("rank 0: compute job shutdown requested", flush=True)


if __name__ == "__main__":
    main()
