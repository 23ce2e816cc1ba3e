"""Horovod's compute service (``horovod.runner.common.service.compute_service``): how a compute
job (the tf.data service's workers, ``bagua_hvd.tensorflow.data``) and a training job find each
other's tf.data dispatchers and workers, and how the training job tells the compute job to stop.

Framework-agnostic, as Horovod's. Horovod runs it as a pickle-over-socket service of its own;
here it is a :class:`~bagua_hvd.rendezvous.store.StoreServer` (the launcher's rendezvous store:
mutual HMAC authentication with the key of the config file, bounded handshakes, bounded
storage) whose keys are checked against the service's shape:

- ``dispatcher/<id>``: the address dispatcher ``id`` registered (once; the same address again
  is fine, another one is refused);
- ``worker/<dispatcher id>/<worker id>``: a worker registered with that dispatcher; the service
  sets ``ready/<dispatcher id>`` itself once ``workers_per_dispatcher`` distinct workers did;
- ``shutdown``: the training job is done (:meth:`ComputeClient.shutdown`);
- ``config``: the service's shape, set by the service, read by clients to check ids.

Every wait has a limit except :meth:`ComputeClient.wait_for_shutdown` (a compute job serves
until the training job is done, as in Horovod), which ends with an error when the service goes
away. The service listens on one address of the job (:func:`service_address`), not on all
interfaces as Horovod's does.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from bagua_hvd.common import config, network
from bagua_hvd.rendezvous.store import (
    StoreClient,
    StoreError,
    StoreServer,
    StoreTimeoutError,
)

logger = logging.getLogger(__name__)

# How long a client tries to reach the service before giving up on an address (the service is
# up before its config file is written, so this only has to cover a slow network).
CONNECT_TIMEOUT_S = 10.0
# wait_for_shutdown asks again this often (each request holds one of the service's threads; a
# client that went away frees it within the store's client check).
SHUTDOWN_POLL_S = 60.0

_CONFIG, _SHUTDOWN = b"config", b"shutdown"

Addresses = Mapping[str, Sequence[Tuple[str, int]]]


def service_address(nics: Optional[Iterable[str]] = None) -> str:
    """The local address other jobs reach this process's services at (the compute service, and
    the tf.data dispatchers and workers): the first of ``nics`` (network interface names) that
    has an IPv4 address, else ``HOROVOD_GLOO_IFACE``'s, else the address this job's own traffic
    leaves from toward its rendezvous store (what the core listens on: ``127.0.0.1`` for a job
    on one host), else ``127.0.0.1`` (no launcher). Set ``HOROVOD_GLOO_IFACE`` when the other
    job runs on another host and this job is launched on one host only."""
    names = sorted(nics) if nics else []
    for name in names:
        addr = network.interface_address(name)
        if addr is not None:
            return addr
    if names:
        raise ValueError(f"none of the network interfaces {names} has an IPv4 address")
    addr = network.iface_address()
    if addr is not None:
        return addr
    endpoint = config.rendezvous_endpoint()
    if endpoint is not None:
        try:
            return network.address_toward(*endpoint)
        except OSError:
            pass  # the store's name does not resolve here: fall back to loopback
    return "127.0.0.1"


def _interface_of(addr: str) -> str:
    """The name of the interface holding ``addr`` (Horovod keys its addresses by interface)."""
    if addr.startswith("127."):
        return "lo"
    for _, name in socket.if_nameindex():
        if network.interface_address(name) == addr:
            return name
    return addr


class _ComputeStore(StoreServer):
    """The store with the compute service's keys checked on every client SET."""

    def __init__(self, key: bytes, dispatchers: int, workers_per_dispatcher: int, host: str):
        # A few keys per dispatcher and worker: an authenticated but buggy client cannot make
        # the service hold more than this.
        keys = 8 + dispatchers * (2 + workers_per_dispatcher)
        super().__init__(key, host=host, port=0, max_stored_keys=keys, max_stored_bytes=keys * 8192)
        self._dispatchers = dispatchers
        self._workers_per_dispatcher = workers_per_dispatcher
        self._workers: List[set] = [set() for _ in range(dispatchers)]

    def _check_id(self, what: str, text: bytes) -> int:
        if not text.isdigit() or not 0 <= int(text) < self._dispatchers:
            raise ValueError(
                f"{what} id must be within [0..{self._dispatchers - 1}]: {text.decode(errors='replace')}"
            )
        return int(text)

    def _client_set(self, key: bytes, value: bytes) -> Optional[str]:
        parts = key.split(b"/")
        with self._cond:  # re-entrant: the base class takes it again to store
            try:
                if parts[0] == b"dispatcher" and len(parts) == 2:
                    dispatcher = self._check_id("Dispatcher", parts[1])
                    old = self._data.get(key)
                    if not value:
                        raise ValueError(f"dispatcher {dispatcher}: empty address")
                    if old is not None and old != value:
                        raise ValueError(
                            f"Dispatcher with id {dispatcher} has already been registered under "
                            f"different address {old.decode(errors='replace')}: "
                            f"{value.decode(errors='replace')}"
                        )
                elif parts[0] == b"worker" and len(parts) == 3 and parts[2].isdigit():
                    self._check_id("Dispatcher", parts[1])
                elif key != _SHUTDOWN:
                    raise ValueError(f"not a compute service key: {key[:64]!r}")
            except ValueError as e:
                return str(e)
            refused = super()._client_set(key, value)
            if refused is None and parts[0] == b"worker":
                dispatcher = int(parts[1])
                self._workers[dispatcher].add(int(parts[2]))
                if len(self._workers[dispatcher]) >= self._workers_per_dispatcher:
                    self._store(b"ready/%d" % dispatcher, b"1")
            return refused


class ComputeService:
    """The compute service of a compute job (run by its rank 0): where dispatchers and workers
    register and the training job asks for the shutdown.

    Args:
        dispatchers: the number of tf.data dispatchers (> 0).
        workers_per_dispatcher: the tf.data workers each dispatcher gets (> 0).
        key: the secret clients must prove (``secret.make_secret_key()``; it goes into the
            config file).
        nics: network interface names to listen on (the first with an address); default: the
            job's address (:func:`service_address`).
    """

    NAME = "Compute service"

    def __init__(
        self,
        dispatchers: int,
        workers_per_dispatcher: int,
        key: bytes,
        nics: Optional[Iterable[str]] = None,
    ) -> None:
        if dispatchers <= 0:
            raise ValueError(f"The number of dispatchers must be larger than 0: {dispatchers}")
        if workers_per_dispatcher <= 0:
            raise ValueError(
                "The number of workers per dispatcher must be larger than 0: "
                f"{workers_per_dispatcher}"
            )
        self._dispatchers = dispatchers
        self._workers_per_dispatcher = workers_per_dispatcher
        self._addr = service_address(nics)
        self._server = _ComputeStore(key, dispatchers, workers_per_dispatcher, self._addr)
        shape = {"dispatchers": dispatchers, "workers_per_dispatcher": workers_per_dispatcher}
        self._server.set(_CONFIG, json.dumps(shape))
        self._server.start()
        self._lock = threading.Lock()
        self._stopped = False
        logger.debug("%s listening on %s:%d", self.NAME, self._addr, self._server.port)

    def addresses(self) -> Dict[str, List[Tuple[str, int]]]:
        """Where clients reach the service: ``{interface: [(address, port)]}`` (Horovod's
        shape)."""
        return {_interface_of(self._addr): [(self._addr, self._server.port)]}

    def shutdown(self) -> None:
        """Tells every worker waiting in :meth:`ComputeClient.wait_for_shutdown` to stop, then
        stops listening (a waiter gets its answer before its connection closes). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.set(_SHUTDOWN, b"1")
        self._server.stop()


class ComputeClient:
    """Talks to a :class:`ComputeService`: one authenticated connection per request, to the
    first of ``compute_addresses`` that answers with the key.

    Args:
        compute_addresses: ``{interface: [(address, port)]}`` (``TfDataServiceConfig.addresses``).
        key: the service's key.
        verbose: Horovod's verbosity (2: log every request at INFO).
    """

    def __init__(self, compute_addresses: Addresses, key: bytes, verbose: int = 1) -> None:
        self._addresses = [
            (str(host), int(port)) for addrs in compute_addresses.values() for host, port in addrs
        ]
        if not self._addresses:
            raise ValueError(f"{ComputeService.NAME}: no address to reach it at")
        self._key = key
        self._verbose = verbose
        self._reachable: Optional[Tuple[str, int]] = None
        self._shape: Optional[dict] = None

    def _connect(self) -> StoreClient:
        candidates = [self._reachable] if self._reachable else self._addresses
        failures = []
        for host, port in candidates:
            try:
                client = StoreClient(host, port, self._key, timeout=CONNECT_TIMEOUT_S)
            except (StoreError, OSError) as e:
                failures.append(f"{host}:{port}: {e}")
                continue
            self._reachable = (host, port)
            return client
        raise ConnectionError(
            f"cannot reach the {ComputeService.NAME.lower()} ({'; '.join(failures)}); is the "
            "compute job (python -m bagua_hvd.tensorflow.data.compute_worker CONFIGFILE) "
            "running, and is the config file its current one?"
        )

    def _log(self, message: str) -> None:
        logger.log(logging.INFO if self._verbose >= 2 else logging.DEBUG, message)

    def _set(self, key: str, value: str) -> None:
        with self._connect() as client:
            try:
                client.set(key, value)
            except StoreError as e:
                raise RuntimeError(f"{ComputeService.NAME}: {e}") from None

    def _get(self, key: str, timeout: float) -> bytes:
        with self._connect() as client:
            return client.get(key, timeout=timeout)

    def _check_dispatcher(self, dispatcher_id: int) -> None:
        if self._shape is None:
            self._shape = json.loads(self._get(_CONFIG.decode(), CONNECT_TIMEOUT_S))
        top = self._shape["dispatchers"] - 1
        if not isinstance(dispatcher_id, int) or not 0 <= dispatcher_id <= top:
            raise IndexError(f"Dispatcher id must be within [0..{top}]: {dispatcher_id}")

    def register_dispatcher(self, dispatcher_id: int, dispatcher_address: str) -> None:
        """Registers dispatcher ``dispatcher_id`` (0-based) at ``dispatcher_address``."""
        self._check_dispatcher(dispatcher_id)
        self._log(f"registering dispatcher {dispatcher_id} at {dispatcher_address}")
        try:
            self._set(f"dispatcher/{dispatcher_id}", dispatcher_address)
        except RuntimeError as e:
            if "already been registered" in str(e):  # the service's refusal, Horovod's type
                raise ValueError(str(e)) from None
            raise

    def wait_for_dispatcher_registration(self, dispatcher_id: int, timeout: float) -> str:
        """The address of dispatcher ``dispatcher_id`` once it registered; TimeoutError after
        ``timeout`` seconds."""
        self._check_dispatcher(dispatcher_id)
        try:
            return self._get(f"dispatcher/{dispatcher_id}", timeout).decode()
        except StoreTimeoutError:
            raise TimeoutError(
                f"Timed out waiting for dispatcher {dispatcher_id} to register ({timeout}s). "
                "Try to find out what takes the dispatcher so long to register or increase "
                "timeout."
            ) from None

    def register_worker_for_dispatcher(self, dispatcher_id: int, worker_id: int) -> None:
        """Registers worker ``worker_id`` as serving dispatcher ``dispatcher_id``."""
        self._check_dispatcher(dispatcher_id)
        self._log(f"registering worker {worker_id} for dispatcher {dispatcher_id}")
        self._set(f"worker/{dispatcher_id}/{int(worker_id)}", "1")

    def wait_for_dispatcher_worker_registration(self, dispatcher_id: int, timeout: float) -> None:
        """Returns once all workers of dispatcher ``dispatcher_id`` registered (of dispatcher 0
        when there is only one); TimeoutError after ``timeout`` seconds."""
        self._check_dispatcher(dispatcher_id)
        if self._shape["dispatchers"] == 1:
            dispatcher_id = 0
        try:
            self._get(f"ready/{dispatcher_id}", timeout)
        except StoreTimeoutError:
            raise TimeoutError(
                f"Timed out waiting for workers for dispatcher {dispatcher_id} to register "
                f"({timeout}s). Try to find out what takes the workers so long to register or "
                "increase timeout."
            ) from None

    def shutdown(self) -> None:
        """Asks the compute job to stop its workers and dispatchers (the training job is done)."""
        self._log("requesting the compute service's shutdown")
        self._set(_SHUTDOWN.decode(), "1")

    def wait_for_shutdown(self) -> None:
        """Returns once the shutdown was requested (no time limit: the compute job serves until
        the training job is done); raises when the service is gone."""
        while True:
            try:
                self._get(_SHUTDOWN.decode(), SHUTDOWN_POLL_S)
                return
            except StoreTimeoutError:
                continue
            except (StoreError, OSError) as e:
                raise ConnectionError(
                    f"lost the {ComputeService.NAME.lower()} while waiting for its shutdown: {e}"
                ) from None
