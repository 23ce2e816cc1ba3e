"""The elastic driver's workers as Ray actors (a bagua_hvd.runner.elastic.launcher.WorkerLauncher).

Each worker is an actor (bagua_hvd.ray.worker.RayWorker) pinned to its host's Ray node
(NodeAffinitySchedulingStrategy, not soft: a worker must run where the driver counted its
slot). The actor gets the launcher's contract through ``set_env``, builds the executable, then
runs the function; a driver-side thread waits on that call and reports the worker's end to the
driver: returned -> 0 (its value kept), raised or the actor died -> 1. Either way the actor is
then killed, as a bagua-run worker's process ends: it still holds its connections to the
others, who must see it gone (Horovod's elastic Ray executor kills one that raised). Stopping a
worker kills its actor.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bagua_hvd.ray.worker import RayWorker
from bagua_hvd.runner.elastic.hosts import SlotInfo
from bagua_hvd.runner.elastic.launcher import WorkerLauncher, slot_of

logger = logging.getLogger(__name__)

SlotKey = Tuple[str, int]
# How long ending the job waits for each killed actor's waiting thread (seconds).
_JOIN_S = 10.0
# How long a worker that returned may take to end its job (its shutdown's wait for the peers is
# bounded by HOROVOD_GLOO_TIMEOUT_SECONDS, 30 s by default).
_END_JOB_S = 120.0


@dataclasses.dataclass(eq=False)
class RayWorkerHandle:
    key: SlotKey
    actor: Any = None
    thread: Optional[threading.Thread] = None
    stopped: bool = False  # the driver stopped it: its end is no error of its own


class RayActorLauncher(WorkerLauncher):
    """Runs ``fn(executable)`` in one actor per worker.

    Args:
        fn: what each worker runs; its argument is the executable (None without one).
        cpus_per_slot: CPUs each actor reserves.
        gpus_per_slot: GPUs each actor reserves (0: none).
        env: set in every actor besides the driver's contract (``extra_env_vars``).
        executable: ``(cls, args, kwargs)`` built in every actor before ``fn`` runs.
        log_queue: handed to every actor for bagua_hvd.ray.ray_logger (None: no callbacks).
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        cpus_per_slot: float = 1,
        gpus_per_slot: float = 0,
        env: Optional[Dict[str, str]] = None,
        executable: Tuple[Any, tuple, dict] = (None, (), {}),
        log_queue: Any = None,
    ) -> None:
        self.fn = fn
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.env = dict(env or {})
        self.executable = executable
        self.log_queue = log_queue
        self.results: Dict[SlotKey, Any] = {}  # the value of each slot's worker that returned
        self.errors: List[Tuple[SlotKey, str]] = []  # why workers failed, in order
        self._handles: List[RayWorkerHandle] = []
        self._lock = threading.Lock()
        self._actor_cls: Any = None

    def address(self, first_hosts: Sequence[str]) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(
        self, info: SlotInfo, generation: int, env: Dict[str, str], events: queue.Queue
    ) -> RayWorkerHandle:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        key = (info.hostname, info.local_rank)
        handle = RayWorkerHandle(key)
        with self._lock:
            self.results.pop(key, None)  # a value of an earlier worker of this slot is stale
            self._handles.append(handle)
        node = node_of(info.hostname, {"CPU": self.cpus_per_slot, "GPU": self.gpus_per_slot})
        if node is None:
            self._fail(handle, f"host {info.hostname} is not a live Ray node", events)
            return handle
        if self._actor_cls is None:
            self._actor_cls = ray.remote(RayWorker)
        handle.actor = self._actor_cls.options(
            num_cpus=self.cpus_per_slot,
            num_gpus=self.gpus_per_slot,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote()
        # Calls on one actor run in order: no need to wait for each.
        handle.actor.set_env.remote(dict(env, **self.env, **slot_of(info).env()))
        if self.log_queue is not None:
            handle.actor.set_queue.remote(self.log_queue)
        cls, args, kwargs = self.executable
        handle.actor.start_executable.remote(cls, tuple(args), dict(kwargs))
        ref = handle.actor.execute.remote(self.fn)
        handle.thread = threading.Thread(
            target=self._wait,
            args=(handle, ref, events),
            name=f"bagua_hvd-ray-{info.hostname[:8]}-{info.local_rank}",
            daemon=True,
        )
        handle.thread.start()
        return handle

    def _wait(self, handle: RayWorkerHandle, ref: Any, events: queue.Queue) -> None:
        import ray

        try:
            value = ray.get(ref)
        except BaseException as e:  # noqa: BLE001 - the function's error, or the actor's death
            if handle.stopped:
                events.put(("gone", handle, 1))
                return
            # A RayTaskError carries the function's own exception (its text: the traceback).
            cause = getattr(e, "cause", None) or e
            self._fail(handle, f"{type(cause).__name__}: {cause}", events)
            return
        with self._lock:
            self.results[handle.key] = value
        # As a process that ends: the job ends as at its exit (a bye to the peers), then its
        # connections close, so peers still waiting on it fail (and reset) instead of waiting
        # for the operation timeout.
        end_jobs([handle.actor])
        self.stop(handle)
        events.put(("gone", handle, 0))

    def _fail(self, handle: RayWorkerHandle, why: str, events: queue.Queue) -> None:
        logger.error("%s[%s]: %s", handle.key[0], handle.key[1], why.splitlines()[0])
        with self._lock:
            self.errors.append((handle.key, why))
        self.stop(handle)  # its process holds connections the others must see closed
        events.put(("gone", handle, 1))

    def stop(self, handle: RayWorkerHandle) -> None:
        import ray

        handle.stopped = True
        if handle.actor is not None:
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone (its node removed)
                pass

    def end(self, handles: Sequence[RayWorkerHandle]) -> None:
        for h in handles:
            self.stop(h)
        for h in handles:
            if h.thread is not None:
                h.thread.join(timeout=_JOIN_S)

    def close(self) -> None:
        # Every actor this launcher started, those that returned included (they stay alive
        # after their function, holding their resources).
        with self._lock:
            handles, self._handles = self._handles, []
        for h in handles:
            self.stop(h)


def end_jobs(actors: Sequence[Any]) -> None:
    """The actors' bagua_hvd job ends as at their processes' exit (RayWorker.end_job), all
    together (each rank's shutdown waits for the others'), bounded."""
    import ray

    try:
        ray.get([a.end_job.remote() for a in actors], timeout=_END_JOB_S)
    except Exception as e:  # noqa: BLE001 - the actors are killed next either way
        logger.warning("ending the job in the workers' actors failed: %s", e)


def node_of(host: str, demand: Dict[str, float]) -> Optional[str]:
    """The live Ray node that ``host`` names: its node id (as RayHostDiscovery names hosts),
    else its IP or hostname (as Horovod's discovery and a user's may): the first such node
    whose resources can hold a worker's ``demand`` (one machine may run several nodes)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive", n.get("alive"))]
    for n in alive:
        if n["NodeID"] == host:
            return n["NodeID"]
    for n in alive:
        if host in (n.get("NodeManagerAddress"), n.get("NodeManagerHostname")):
            have = n.get("Resources", {})
            if all(have.get(k, 0) >= v for k, v in demand.items() if v):
                return n["NodeID"]
    return None
