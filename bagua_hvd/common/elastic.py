"""``hvd.elastic``'s framework-neutral part: Horovod's ``horovod.common.elastic`` (``State``,
``ObjectState``, the ``run`` loop) and the worker side of its elastic driver.

How a worker takes part (the launcher's side is bagua_hvd.runner.elastic.driver; the store keys
are below and in docs/elastic.md):

- It starts with Horovod's variables (``HOROVOD_RANK`` ...) for the driver's current generation
  (``BAGUA_HVD_ELASTIC_GENERATION``), and ``hvd.init()`` forms the job as usual.
- A later ``hvd.init()`` in the same process (the reset after a failure or a host change) first
  reports to the driver (``elastic/ready/<generation>/<host>:<local rank>``) and waits for its
  answer (``elastic/next/<generation>/<host>:<local rank>``): the next generation, its new rank
  and size (or that its slot was removed), and whether the new world has workers that were not in
  the old one. The core then forms the new job under that generation.
- Host changes reach the workers as numbered notifications (``elastic/update/<n>``), read by one
  thread per process; ``State.commit()`` / ``check_host_updates()`` broadcast rank 0's view, so
  every rank raises ``HostsUpdatedInterrupt`` at the same commit.

Differences from Horovod, on purpose: notifications are numbered and kept by the driver, so none
is lost when a worker is busy or resetting (Horovod sends each once, to rank 0, with whole-second
timestamps); survivors of a removal skip ``sync()`` only when the driver says no worker of the new
world is new (Horovod's survivors skip it whenever hosts were only removed, and deadlock against
newcomers that arrive later, Horovod issue #3494); a reset whose re-initialisation fails because
another peer died is retried as a failed step, instead of ending the process.
"""

from __future__ import annotations

import functools
import queue
import threading
from enum import IntFlag
from typing import Any, Callable, Dict, List, Optional, Tuple

from bagua_hvd.common import config
from bagua_hvd.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

# ---- the store keys shared with the driver -----------------------------------------------


def ready_key(generation: int, hostname: str, local_rank: int) -> str:
    """Set by a worker when it resets out of ``generation``."""
    return f"elastic/ready/{generation}/{hostname}:{local_rank}"


def next_key(generation: int, hostname: str, local_rank: int) -> str:
    """Set by the driver for a worker that reset out of ``generation``: see :func:`parse_next`."""
    return f"elastic/next/{generation}/{hostname}:{local_rank}"


def update_key(seq: int) -> str:
    """The driver's ``seq``-th host-update notification (from 1): ``"<seq> <HostUpdateResult>"``."""
    return f"elastic/update/{seq}"


class HostUpdateResult(IntFlag):
    """What a host update did (``horovod.runner.elastic.worker.HostUpdateResult``)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class Assignment:
    """The driver's answer to a reset: ``"<generation> <rank>,<size>,<local_rank>,<local_size>,
    <cross_rank>,<cross_size> <fresh> <first_update>"``; rank -1 means the slot was removed from
    the job, fresh 1 that some worker of the new generation was not in the old one, and
    first_update the number of the first host update published after the new generation's hosts
    were chosen (the earlier ones are part of it; the later ones are news to it)."""

    FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")

    def __init__(
        self, generation: int, ranks: Tuple[int, ...], fresh: bool, first_update: int
    ) -> None:
        self.generation, self.ranks, self.fresh = generation, tuple(ranks), fresh
        self.first_update = first_update

    @property
    def removed(self) -> bool:
        return self.ranks[0] < 0

    def encode(self) -> str:
        ranks = ",".join(map(str, self.ranks))
        return f"{self.generation} {ranks} {int(self.fresh)} {self.first_update}"

    @classmethod
    def decode(cls, text: str) -> Assignment:
        try:
            gen, ranks, fresh, first_update = text.split(" ")
            values = tuple(int(v) for v in ranks.split(","))
            if len(values) != len(cls.FIELDS):
                raise ValueError
            return cls(int(gen), values, fresh == "1", int(first_update))
        except ValueError:
            raise ValueError(f"bad answer from the elastic driver: {text!r}") from None


# ---- notifications --------------------------------------------------------------------------


class WorkerNotificationManager:
    """Delivers the driver's host updates to the registered states (Horovod's
    ``horovod.runner.elastic.worker.WorkerNotificationManager``): one daemon thread per process
    reads them from the rendezvous store in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: List[Any] = []
        self._thread: Optional[threading.Thread] = None

    def init(self) -> None:
        """Starts the reader once per process; nothing outside an elastic job."""
        if not config.elastic():
            return
        with self._lock:
            if self._thread is not None:
                return
            worker = config.elastic_worker()
            self._thread = threading.Thread(
                target=self._read, args=(worker,), name="bagua_hvd-elastic-updates", daemon=True
            )
            self._thread.start()

    def register_listener(self, listener: Any) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Any) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def handle_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)

    def _read(self, worker: config.ElasticWorker) -> None:
        from bagua_hvd.rendezvous.store import StoreClient, StoreError, StoreTimeoutError

        try:
            client = StoreClient(worker.store_addr, worker.store_port, bytes.fromhex(worker.secret))
        except (StoreError, OSError, ValueError):
            return  # no driver to hear from: the job is ending
        seq = worker.first_update
        with client:
            while True:
                try:
                    text = client.get(update_key(seq), timeout=60.0).decode()
                except StoreTimeoutError:
                    continue
                except (StoreError, OSError):
                    return  # the driver is gone
                number, _, res = text.partition(" ")
                self.handle_hosts_updated(int(number), HostUpdateResult(int(res)))
                seq += 1


notification_manager = WorkerNotificationManager()


# ---- the rendezvous of a reset --------------------------------------------------------------


class HostRemovedError(RuntimeError):
    """This worker's slot is not part of the job any more (its host was removed or
    blacklisted): the process should end."""


_state_lock = threading.Lock()
_inits = 0  # hvd.init() calls that formed a job in this process
_fresh = False  # the last rendezvous's world had workers that the previous one did not
# The first host update that is news to the job formed last (the earlier ones were known when its
# hosts were chosen); None outside an elastic job.
_first_update: Optional[int] = None


def before_init() -> None:
    """Called by ``hvd.init()`` before the core forms a job. In an elastic job, every init after
    the process's first asks the driver for this worker's place in the next generation and
    puts it in the environment the core reads; raises HostRemovedError when the slot is gone."""
    global _fresh, _first_update
    if not config.elastic():
        return
    with _state_lock:
        if _inits == 0:
            try:
                _first_update = config.elastic_worker().first_update
            except ValueError:  # HOROVOD_ELASTIC=1 outside a driver's job: nothing to filter
                _first_update = None
            return
    from bagua_hvd.rendezvous.store import StoreClient, StoreError

    worker = config.elastic_worker()
    try:
        with StoreClient(
            worker.store_addr, worker.store_port, bytes.fromhex(worker.secret)
        ) as client:
            client.set(ready_key(worker.generation, worker.hostname, worker.local_rank), b"")
            text = client.get(
                next_key(worker.generation, worker.hostname, worker.local_rank),
                timeout=worker.wait_s,
            ).decode()
    except (StoreError, OSError) as e:
        raise HorovodInternalError(
            f"elastic reset: no answer from the driver's rendezvous at "
            f"{worker.store_addr}:{worker.store_port}: {e}"
        ) from e
    answer = Assignment.decode(text)
    if answer.removed:
        raise HostRemovedError(
            f"{worker.hostname}[{worker.local_rank}] has been removed from elastic job"
        )
    env = {f"HOROVOD_{name.upper()}": value for name, value in zip(Assignment.FIELDS, answer.ranks)}
    env[config.ELASTIC_GENERATION_ENV] = answer.generation
    config.set_job(env)
    _fresh = answer.fresh
    _first_update = answer.first_update


def after_init() -> None:
    """Called by ``hvd.init()`` once the core formed a job."""
    global _inits
    with _state_lock:
        _inits += 1


def reset(shutdown: Callable[[], None], init: Callable[[], None]) -> None:
    """A framework's elastic reset (Horovod's ``_reset``: shutdown, then init without
    arguments). An init that fails because the new job could not form (a peer lost meanwhile)
    raises HorovodInternalError: the run loop resets again, into the generation after."""
    shutdown()
    try:
        init()
    except (HostRemovedError, HorovodInternalError):
        raise
    except ValueError as e:  # the core could not form the job (basics.init's error)
        raise HorovodInternalError(f"elastic reset: {e}") from e


def world_has_newcomers() -> bool:
    """Whether the job formed at the last reset has workers that were not in the one before."""
    return _fresh


# ---- states ---------------------------------------------------------------------------------


class State:
    """State of a training loop that survives a reset (``horovod.common.elastic.State``).

    Args:
        bcast_object: the framework's ``broadcast_object(obj, root_rank=0)``.
        get_rank: the framework's ``rank()``.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        # Horovod's names and types: its test scripts read and reset these.
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Adds functions called (in order, without arguments) after each reset, once the job
        was re-formed at its new size and before the state is synchronised."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        # Updates the driver published before it chose the new world's hosts are part of that
        # world: drop them. Later ones (published while this worker was still joining the new
        # job) are news to it and stay queued, else the change would be lost for good (the
        # driver announces each change once per generation). Outside a driver's job, every
        # queued update is dropped, as Horovod does.
        first = _first_update
        queued = []
        while True:  # the same queue: the reader thread may put into it meanwhile
            try:
                queued.append(self._host_messages.get_nowait())
            except queue.Empty:
                break
        for timestamp, res in queued:
            if first is not None and timestamp >= first:
                self._host_messages.put((timestamp, res))
        if first is not None:
            # An older update still on its way from the reader thread must not count either.
            self._last_updated_timestamp = max(self._last_updated_timestamp, first - 1)
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Saves the state (the point a failure rolls back to), then checks for host updates:
        may raise HostsUpdatedInterrupt, on every rank at once. A collective: every rank must
        commit at the same points."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank when rank 0 heard of a host update since
        the last check (a collective: rank 0's view is broadcast)."""
        previous = newest = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, res = self._host_messages.get()
            if timestamp > newest:
                newest = timestamp
                update |= res
        previous, self._last_updated_timestamp, update = self._bcast_object(
            (previous, newest, update)
        )
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def save(self) -> None:
        """Keeps a copy of the state in memory (what restore() returns to)."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Returns the state to the last save()."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Makes every rank's state rank 0's."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Called at each reset, before the reset callbacks."""


class ObjectState(State):
    """State made of picklable attributes given as keyword arguments
    (``horovod.common.elastic.ObjectState``): ``save()`` copies their current values, ``sync()``
    broadcasts the saved values from rank 0."""

    def __init__(
        self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        self._saved_state: Dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


# ---- the run loop -------------------------------------------------------------------------


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """``func(state, *args, **kwargs)`` made elastic (``horovod.common.elastic.run_fn``).

    The state is synchronised from rank 0, then ``func`` runs. HorovodInternalError (a peer was
    lost): the state is restored to its last commit, the job re-formed (``reset``: the
    framework's shutdown and init), the reset callbacks run, the state is synchronised, and
    ``func`` runs again. HostsUpdatedInterrupt: the same without the restore, and without the
    sync when hosts were only removed and no worker is new. Other exceptions propagate.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        needs_reset = False
        try:
            while True:
                try:
                    if needs_reset:
                        needs_reset = False
                        reset()
                        if world_has_newcomers():
                            skip_sync = False
                        state.on_reset()
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    skip_sync = e.skip_sync
                needs_reset = True
        finally:
            notification_manager.remove_listener(state)

    return wrapper
