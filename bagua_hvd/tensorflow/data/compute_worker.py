"""Horovod's compute worker: a tf.data service run as a Horovod job (the compute job)::

    bagua-run -np 4 python -m bagua_hvd.tensorflow.data.compute_worker /tmp/compute.json
    bagua-run -np 4 python -m bagua_hvd.tensorflow.data.compute_worker --dispatchers 2 \\
        --dispatcher-side training --timeout 60 /tmp/compute.json

Rank 0 runs the compute service and writes the config file (``TfDataServiceConfig``, JSON);
every rank runs :func:`compute_worker_fn` until a training job asks for the shutdown. Then the
ranks meet once more (so that none still needs the service), rank 0 stops the service and
removes the config file if it is still this job's, and the job ends. docs/tf-data-service.md.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Optional

from bagua_hvd.runner.common.util import secret
from bagua_hvd.tensorflow import functions, mpi_ops
from bagua_hvd.tensorflow.data.compute_service import (
    DISPATCHER_SIDES,
    TfDataServiceConfig,
    compute_worker_fn,
)

logger = logging.getLogger(__name__)


def _remove_if_ours(configfile: str, config: TfDataServiceConfig) -> None:
    """Removes the config file unless another compute job replaced it meanwhile: a training job
    started later then waits for the next compute job's file instead of reading a stale one."""
    try:
        if TfDataServiceConfig.read(configfile).key == config.key:
            os.unlink(configfile)
    except (OSError, ValueError):
        pass  # gone or replaced already


def main(dispatchers: int, dispatcher_side: str, configfile: str, timeout: int) -> None:
    """Runs the compute job on this rank (Horovod's signature): ``dispatchers`` dispatchers on
    the ``dispatcher_side`` ("compute" or "training"), the config written to ``configfile``,
    ``timeout`` seconds for each registration."""
    # Checked on every rank before any rank waits for another.
    if dispatcher_side not in DISPATCHER_SIDES:
        raise ValueError(f"dispatcher side must be 'compute' or 'training': {dispatcher_side!r}")
    if dispatchers <= 0:
        raise ValueError(f"The number of dispatchers must be larger than 0: {dispatchers}")
    mpi_ops.init()
    rank, size = mpi_ops.rank(), mpi_ops.size()
    if size % dispatchers:
        raise ValueError(
            f"Number of processes ({size}) must be a multiple of number of dispatchers "
            f"({dispatchers})."
        )
    workers_per_dispatcher = size // dispatchers

    from bagua_hvd.rendezvous.compute_service import ComputeService

    compute: Optional[ComputeService] = None
    compute_config: Optional[TfDataServiceConfig] = None
    try:
        if rank == 0:
            key = secret.make_secret_key()
            compute = ComputeService(dispatchers, workers_per_dispatcher, key=key)
            compute_config = TfDataServiceConfig(
                dispatchers=dispatchers,
                workers_per_dispatcher=workers_per_dispatcher,
                dispatcher_side=dispatcher_side,
                addresses=compute.addresses(),
                key=key,
                timeout=timeout,
            )
            compute_config.write(configfile)
        compute_config = functions.broadcast_object(compute_config, name="TfDataServiceConfig")
        compute_worker_fn(compute_config)
        # Every rank has its shutdown answer before rank 0 stops the service.
        mpi_ops.barrier()
    finally:
        if compute is not None:
            compute.shutdown()
            if compute_config is not None:
                _remove_if_ours(configfile, compute_config)


def _parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bagua_hvd.tensorflow.data.compute_worker",
        description="Runs a tf.data service (dispatchers and workers) as a Horovod job.",
    )
    parser.add_argument("configfile", help="where rank 0 writes the config file (JSON)")
    parser.add_argument(
        "--dispatchers", type=int, default=1, help="how many tf.data dispatchers (default 1)"
    )
    parser.add_argument(
        "--dispatcher-side", dest="dispatcher_side", default="compute", choices=DISPATCHER_SIDES,
        help="the job the dispatchers run in (default: compute)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=int, default=60,
        help="seconds each dispatcher and worker registration may take (default 60)",
    )  # fmt: skip
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = _parse_args()
    main(args.dispatchers, args.dispatcher_side, args.configfile, args.timeout)
