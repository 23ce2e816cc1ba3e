"""Horovod's ``horovod.tensorflow.data.compute_service``: TensorFlow's own tf.data service
(``tf.data.experimental.service``) run inside a Horovod compute job, used by a training job.

- :class:`TfDataServiceConfig`: what the compute job writes to its config file and the
  training job reads (Horovod's JSON format);
- :func:`compute_worker_fn`: run on every rank of the compute job: a tf.data worker server per
  rank, and a dispatcher per ``workers_per_dispatcher`` ranks when the dispatchers live on the
  compute side; returns once the training job asked for the shutdown;
- :func:`tf_data_service`: the training job's context that yields its dispatcher's address
  (and runs the dispatchers when they live on the training side);
- :func:`send_to_data_service` (also ``tf.data.Dataset.send_to_data_service``): moves the
  dataset's transformations so far to the service.

The jobs meet through :mod:`bagua_hvd.rendezvous.compute_service`. docs/tf-data-service.md.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from tempfile import NamedTemporaryFile
from typing import Any, Iterator, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from bagua_hvd.rendezvous.compute_service import ComputeClient, service_address
from bagua_hvd.tensorflow import mpi_ops

logger = logging.getLogger(__name__)

DISPATCHER_SIDES = ("compute", "training")
PROCESSING_MODES = ("distributed_epoch", "parallel_epochs")
# TfDataServiceConfig.read(wait_for_file_creation=True) gives up after this long (Horovod waits
# without a limit); it polls this often.
DEFAULT_READ_WAIT_S = 600.0
READ_POLL_S = 0.1
# How long a tf.data server's stop may take before the compute job goes on without it.
STOP_WAIT_S = 5.0
_FIELDS = ("dispatchers", "workers_per_dispatcher", "dispatcher_side", "addresses", "key")


@dataclasses.dataclass(frozen=True)
class TfDataServiceConfig:
    """How a training job reaches a compute job's tf.data service (Horovod's fields).

    Args:
        dispatchers: the number of dispatchers (1, or one per training rank).
        workers_per_dispatcher: the compute ranks (tf.data workers) per dispatcher.
        dispatcher_side: where the dispatchers run, ``"compute"`` or ``"training"``.
        addresses: the compute service's ``{interface: [(address, port)]}``.
        key: the compute service's secret (written hex-encoded to the config file, which is
            therefore created readable by its owner only).
        timeout: seconds every registration wait may take (default 60).
    """

    dispatchers: int
    workers_per_dispatcher: int
    dispatcher_side: str
    addresses: Mapping[str, Sequence[Tuple[str, int]]]
    key: bytes
    timeout: int = 60

    def __post_init__(self) -> None:
        # Checked here so that a bad config fails where it is made or read, naming the field,
        # not later as a stuck registration.
        for name in ("dispatchers", "workers_per_dispatcher"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TfDataServiceConfig.{name} must be a positive int: {value!r}")
        if self.dispatcher_side not in DISPATCHER_SIDES:
            raise ValueError(
                f"TfDataServiceConfig.dispatcher_side must be 'compute' or 'training': "
                f"{self.dispatcher_side!r}"
            )
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ValueError(f"TfDataServiceConfig.timeout must be > 0 seconds: {self.timeout!r}")
        if not isinstance(self.key, bytes) or not self.key:
            raise ValueError("TfDataServiceConfig.key must be non-empty bytes")
        if not self.addresses or not all(self.addresses.values()):
            raise ValueError(
                f"TfDataServiceConfig.addresses has no address of the compute service: "
                f"{self.addresses!r}"
            )

    def compute_client(self, verbose: int = 1) -> ComputeClient:
        """A client of the compute job's compute service."""
        return ComputeClient(self.addresses, self.key, verbose=verbose)

    def to_dict(self) -> Mapping[str, Any]:
        """The fields as JSON takes them (``key`` hex-encoded)."""
        config = dataclasses.asdict(self)
        config["key"] = binascii.hexlify(self.key).decode()
        return config

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> TfDataServiceConfig:
        """The config from :meth:`to_dict`'s form; ValueError naming missing fields."""
        missing = [name for name in _FIELDS if name not in config]
        if missing:
            raise ValueError(f"tf.data service config lacks {', '.join(missing)}: {config!r}")
        try:
            key = binascii.unhexlify(config["key"])
            addresses = {
                str(intf): [(str(addr[0]), int(addr[1])) for addr in addrs]
                for intf, addrs in config["addresses"].items()
            }
        except (binascii.Error, TypeError, ValueError, AttributeError, IndexError) as e:
            raise ValueError(f"tf.data service config: bad key or addresses: {e}") from None
        return TfDataServiceConfig(
            dispatchers=config["dispatchers"],
            workers_per_dispatcher=config["workers_per_dispatcher"],
            dispatcher_side=config["dispatcher_side"],
            addresses=addresses,
            key=key,
            timeout=config.get("timeout", 60),
        )

    def write(self, filename: str) -> None:
        """Writes the config as JSON to ``filename``, atomically (a complete file appears under
        that name or none: readers may wait for it)."""
        path = Path(filename)
        with NamedTemporaryFile(
            "w", dir=str(path.parent), prefix=path.name, delete=False
        ) as w:  # created with mode 0600: the file holds the key
            logger.info("Writing config to %s", w.name)
            w.write(json.dumps(self.to_dict()))
        logger.info("Renaming config from %s to %s", w.name, filename)
        os.replace(w.name, filename)

    @staticmethod
    def read(
        filename: str, wait_for_file_creation: bool = False, *, timeout: float = DEFAULT_READ_WAIT_S
    ) -> TfDataServiceConfig:
        """The config in ``filename``; with ``wait_for_file_creation``, waits up to ``timeout``
        seconds (a bagua_hvd addition: Horovod waits without a limit) for the compute job to
        write it."""
        deadline = time.monotonic() + timeout
        while wait_for_file_creation and not os.path.exists(filename):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the tf.data service config file {filename} did not appear within "
                    f"{timeout:g}s: start the compute job (python -m "
                    f"bagua_hvd.tensorflow.data.compute_worker {filename}) first"
                )
            time.sleep(READ_POLL_S)
        with open(filename) as r:
            text = r.read()
        try:
            return TfDataServiceConfig.from_dict(json.loads(text))
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{filename} is not a tf.data service config: {e}") from None


def _start_dispatcher(compute: ComputeClient, dispatcher_id: int) -> Any:
    """A tf.data dispatcher, registered with the compute service as dispatcher_id."""
    server = tf.data.experimental.service.DispatchServer()
    # TF's own target names localhost; the other job needs this job's address.
    port = server.target.rsplit(":", 1)[1]
    address = f"{server.target.split('://', 1)[0]}://{service_address()}:{port}"
    logger.debug("Registering Dispatcher %d at %s", dispatcher_id, address)
    compute.register_dispatcher(dispatcher_id, address)
    logger.info("Registered Dispatcher %d at %s", dispatcher_id, address)
    return server


def _stop_server(server: Any, what: str) -> None:
    """Stops a tf.data server, waiting up to STOP_WAIT_S for it. TensorFlow's only way to stop
    its servers is the private ``_stop`` (as in Horovod), and a worker's stop can hang while it
    still produces for a consumer that went away (an infinite dataset not read to its end): the
    stop then goes on in a daemon thread, which the process's exit ends."""
    logger.debug("Shutting down %s", what)

    def stop() -> None:
        server._stop()
        server.join()

    thread = threading.Thread(target=stop, name=f"bagua_hvd-stop-{what}", daemon=True)
    thread.start()
    thread.join(STOP_WAIT_S)
    if thread.is_alive():
        logger.warning(
            "tf.data %s did not stop within %gs (it still serves a consumer that went away); "
            "leaving it to the process's exit",
            what,
            STOP_WAIT_S,
        )
    else:
        logger.info("%s shut down", what)


@contextmanager
def tf_data_service(compute_config: TfDataServiceConfig, rank: int) -> Iterator[str]:
    """Yields the address of the tf.data dispatcher this training rank uses, once all of its
    workers registered. With ``dispatcher_side == "training"`` it runs the dispatcher too (on
    rank 0 for a single dispatcher, on every rank otherwise) until the context ends."""
    compute = compute_config.compute_client(verbose=2)
    dispatcher_server = None
    if compute_config.dispatcher_side == "training":
        if compute_config.dispatchers > 1 or rank == 0:
            if compute_config.dispatchers == 1:
                logger.info("Setting up Dispatcher for all tasks")
            else:
                logger.info("Setting up Dispatcher for task %d", rank)
            dispatcher_server = _start_dispatcher(compute, rank)
    try:
        dispatcher_id = rank if compute_config.dispatchers > 1 else 0
        address = compute.wait_for_dispatcher_registration(dispatcher_id, compute_config.timeout)
        compute.wait_for_dispatcher_worker_registration(dispatcher_id, compute_config.timeout)
        yield address
    finally:
        if dispatcher_server is not None:
            _stop_server(dispatcher_server, "Dispatcher")


def send_to_data_service(
    dataset: tf.data.Dataset,
    compute_config: TfDataServiceConfig,
    rank: int,
    size: Optional[int] = None,
    processing_mode: str = "distributed_epoch",
    reuse_dataset: bool = False,
    round_robin: bool = False,
) -> tf.data.Dataset:
    """The dataset's elements produced by the compute job's tf.data workers (compute-side
    dispatchers only; training-side ones need :func:`tf_data_service`).

    Args:
        dataset: what the service runs (every transformation so far).
        compute_config: the compute job's config.
        rank: this training rank.
        size: the training job's size (used with ``reuse_dataset`` and ``round_robin``).
        processing_mode: ``"distributed_epoch"`` (the workers split one epoch) or
            ``"parallel_epochs"`` (every worker produces a whole epoch).
        reuse_dataset: the ranks of one dispatcher share one tf.data job (``job_name="job"``),
            first come first served, instead of one job each.
        round_robin: with ``reuse_dataset``, hand out the elements round robin
            (``consumer_index=rank``, ``num_consumers=size``; needs an infinite dataset).
    """
    if compute_config.dispatcher_side == "training":
        raise RuntimeError(
            "training side dispatcher not supported, use tf_data_service context manager instead"
        )
    with tf_data_service(compute_config, rank) as dispatcher_address:
        return dataset.apply(
            tf.data.experimental.service.distribute(
                processing_mode=processing_mode,
                service=dispatcher_address,
                job_name="job" if reuse_dataset else None,
                consumer_index=rank if reuse_dataset and round_robin else None,
                num_consumers=size if reuse_dataset and round_robin else None,
            )
        )


# As Horovod: dataset.send_to_data_service(compute_config, rank, size, ...).
tf.data.Dataset.send_to_data_service = send_to_data_service


def compute_worker_fn(compute_config: TfDataServiceConfig) -> None:
    """Runs on every rank of the compute job: starts this rank's tf.data worker (and its
    dispatcher on the first rank of each ``workers_per_dispatcher``, compute side), registers
    them, and returns after the training job asked for the shutdown, with both stopped."""
    mpi_ops.init()
    index, size = mpi_ops.rank(), mpi_ops.size()
    needed = compute_config.dispatchers * compute_config.workers_per_dispatcher
    if size != needed:
        raise ValueError(
            f"the compute job has {size} ranks, but its config asks for "
            f"{compute_config.dispatchers} dispatcher(s) x "
            f"{compute_config.workers_per_dispatcher} worker(s) = {needed}"
        )
    dispatcher_index = index // compute_config.workers_per_dispatcher
    compute = compute_config.compute_client(verbose=2)

    dispatcher_server = worker_server = None
    try:
        if (
            compute_config.dispatcher_side == "compute"
            and index % compute_config.workers_per_dispatcher == 0
        ):
            if compute_config.dispatchers == 1:
                logger.info("Setting up Dispatcher for all tasks")
            else:
                logger.info("Setting up Dispatcher for task %d", dispatcher_index)
            dispatcher_server = _start_dispatcher(compute, dispatcher_index)

        logger.debug("Waiting for dispatcher %d for worker %d", dispatcher_index, index)
        dispatcher_address = compute.wait_for_dispatcher_registration(
            dispatcher_index, compute_config.timeout
        )
        host = service_address()
        worker_config = tf.data.experimental.service.WorkerConfig(
            dispatcher_address=dispatcher_address.split("://", 1)[1],
            # TF's defaults name localhost: the training job needs this job's address.
            worker_address=f"{host}:%port%",
            data_transfer_address=f"{host}:%dts_port%",
            heartbeat_interval_ms=1000,
            dispatcher_timeout_ms=int(compute_config.timeout * 1000),
        )
        worker_server = tf.data.experimental.service.WorkerServer(worker_config)
        logger.debug("Started worker for dispatcher %d", dispatcher_index)
        compute.register_worker_for_dispatcher(dispatcher_index, index)
        logger.info("Worker for dispatcher %d registered", dispatcher_index)

        compute.wait_for_shutdown()
        logger.debug("Shutdown requested")
    finally:
        if worker_server is not None:
            _stop_server(worker_server, "Worker")
        if dispatcher_server is not None:
            _stop_server(dispatcher_server, "Dispatcher")
