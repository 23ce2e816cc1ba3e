"""Elastic training on Ray: ``ElasticRayExecutor`` (Horovod's ``horovod.ray.ElasticRayExecutor``)
and the elastic mode of ``RayExecutor(min_workers=...)`` (Horovod's ``ElasticAdapter``).

Both run bagua_hvd's elastic driver (bagua_hvd.runner.elastic.driver, the one behind
``bagua-run --min-np``) with two Ray parts plugged in: the hosts are the live Ray nodes
(bagua_hvd.ray.discovery.RayHostDiscovery, or the settings' own discovery) and each worker is an
actor pinned to its node (bagua_hvd.ray.launcher.RayActorLauncher). So the generations, the
blacklist, the reset limit and the host-update notifications are those of bagua-run's elastic
jobs: a node removed ends its actors, the others reset into a smaller job; a node added is
announced to the workers (``HostsUpdatedInterrupt`` at their next commit) and gets new actors.
``run`` returns the values of the last generation's workers in rank order.
"""

from __future__ import annotations

import logging
import threading
import warnings
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bagua_hvd.ray.discovery import RayHostDiscovery
from bagua_hvd.ray.launcher import RayActorLauncher
from bagua_hvd.ray.worker import contract_env
from bagua_hvd.runner.elastic.driver import ElasticDriver, ElasticSettings
from bagua_hvd.runner.elastic.hosts import check_cooldown_range

logger = logging.getLogger(__name__)

# BaseSettings' keywords that Horovod's create_settings passes on through **kwargs.
_SETTINGS_KWARGS = (
    "cooldown_range",
    "verbose",
    "ssh_port",
    "extra_mpi_args",
    "tcp_flag",
    "binding_args",
    "output_filename",
    "run_func_mode",
    "prefix_output_with_timestamp",
)
_NO_REFS = "ObjectRefs cannot be returned from Elastic runs as the workers are ephemeral"
_NO_SINGLE = "Elastic mode does not support execute_single. Please use the execute method instead"


class ElasticRayExecutor:
    """Executor for elastic jobs on a Ray cluster (``ray.init()`` first), with Horovod's
    parameters and defaults. Takes the whole cluster: every live node's resources are slots.

    Args:
        settings: from :meth:`create_settings` (its ``discovery`` is set by the executor unless
            ``override_discovery`` is False).
        use_gpu: reserve ``gpus_per_slot`` GPUs per worker (default False).
        cpus_per_slot: CPUs per worker (default 1).
        gpus_per_slot: GPUs per worker (default 1 with use_gpu; ValueError without it).
        env_vars: environment variables set in every worker's actor (default None).
        override_discovery: give ``settings`` a RayHostDiscovery of the live nodes (default
            True); False keeps the discovery the caller put in ``settings.discovery`` (its
            hosts named by Ray node id, IP or hostname).

    Example::

        ray.init(address="auto")
        settings = ElasticRayExecutor.create_settings(verbose=True)
        executor = ElasticRayExecutor(settings, cpus_per_slot=2)
        executor.start()
        results = executor.run(train_fn)
    """

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: Optional[int] = None,
        reset_limit: Optional[int] = None,
        elastic_timeout: int = 600,
        timeout_s: int = 30,
        ssh_identity_file: Optional[str] = None,
        nics: Optional[set] = None,
        min_np: Optional[int] = None,
        max_np: Optional[int] = None,
        **kwargs: Any,
    ) -> SimpleNamespace:
        """Horovod's ElasticSettings for Ray.

        Args:
            min_num_proc: the fewest workers training goes on with; the job starts with at
                least as many, and waits (at most elastic_timeout) when fewer are left.
            max_num_proc: the most workers (default: no bound).
            reset_limit: the most resets (scale-ups/downs, failures) before the job fails.
            elastic_timeout: seconds to wait for min_num_proc slots at the start and after a
                reset (default 600).
            timeout_s: the rendezvous timeout of each generation (default 30 s).
            ssh_identity_file: accepted for compatibility (the actors need no ssh).
            nics: network interfaces for the workers' TCP (the first one, sorted).
            min_np, max_np: deprecated names of min_num_proc and max_num_proc.
            kwargs: Horovod's other settings (``verbose``, ``cooldown_range``, ...).
        """
        if min_np is not None:
            min_num_proc = min_np
            warnings.warn(
                "min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2
            )
        if max_np is not None:
            max_num_proc = max_np
            warnings.warn(
                "max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2
            )
        unknown = sorted(set(kwargs) - set(_SETTINGS_KWARGS))
        if unknown:
            raise TypeError(f"create_settings() got an unexpected keyword argument {unknown[0]!r}")
        return SimpleNamespace(
            discovery=None,
            min_num_proc=min_num_proc,
            max_num_proc=max_num_proc,
            elastic_timeout=elastic_timeout,
            reset_limit=reset_limit,
            num_proc=min_num_proc,
            timeout_s=timeout_s,
            start_timeout=timeout_s,
            ssh_identity_file=ssh_identity_file,
            nics=nics,
            **dict({"cooldown_range": None, "verbose": 0}, **kwargs),
        )

    def __init__(
        self,
        settings: Any,
        use_gpu: bool = False,
        cpus_per_slot: int = 1,
        gpus_per_slot: Optional[int] = None,
        env_vars: Optional[Dict[str, str]] = None,
        override_discovery: bool = True,
    ) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError(
                "gpus_per_slot is set, but use_gpu is False. "
                "use_gpu must be True if gpus_per_slot is set. "
            )
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_slot}.")
        _check_positive("cpus_per_slot", cpus_per_slot)
        if override_discovery:
            settings.discovery = RayHostDiscovery(
                use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, gpus_per_slot=gpus_per_slot
            )
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.env_vars = dict(env_vars or {})
        self._started = False

    def start(self) -> None:
        """Checks the settings and the cluster connection; the workers start in :meth:`run`,
        once ``num_proc`` slots are there (waiting at most the elastic timeout)."""
        _check_settings(self.settings)
        _check_ray()
        self._started = True

    def run(
        self, worker_fn: Callable[[], Any], callbacks: Optional[List[Callable]] = None
    ) -> List[Any]:
        """Runs ``worker_fn()`` as an elastic job to its end.

        Args:
            worker_fn: what every worker runs (``hvd.init()``, then ``hvd.elastic.run``).
            callbacks: called in the driver with every record that a worker gives
                ``bagua_hvd.ray.ray_logger.log``.

        Returns:
            The return values of the last generation's workers, in rank order. RuntimeError
            when the job failed (Horovod's message, and the workers' errors).
        """
        if not self._started:
            raise RuntimeError("ElasticRayExecutor: call start() first")
        return run_elastic(
            self.settings,
            lambda _executable: worker_fn(),
            cpus=self.cpus_per_slot,
            gpus=self.gpus_per_slot if self.use_gpu else 0,
            env=self.env_vars,
            callbacks=callbacks,
        )


class ElasticAdapter:
    """``RayExecutor``'s elastic mode (``min_workers`` given): Horovod's ``ElasticAdapter``.
    ``start`` records the executable and environment; each ``run``/``execute`` is one elastic
    job whose workers are new actors. ``run_remote`` and ``execute_single`` raise
    NotImplementedError, as Horovod's do."""

    def __init__(
        self,
        settings: Any,
        min_workers: int,
        max_workers: Optional[int] = None,
        use_gpu: bool = False,
        cpus_per_worker: int = 1,
        gpus_per_worker: Optional[int] = None,
        override_discovery: bool = True,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[Tuple[int, int]] = None,
        elastic_timeout: int = 600,
    ) -> None:
        _check_positive("cpus_per_worker", cpus_per_worker)
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        if override_discovery:
            settings.discovery = RayHostDiscovery(
                use_gpu=use_gpu,
                cpus_per_slot=cpus_per_worker,
                gpus_per_slot=self.gpus_per_worker or 1,
            )
        self.user_settings = settings  # its discovery may still be set before start()
        self.params = dict(
            min_num_proc=min_workers,
            max_num_proc=max_workers,
            num_proc=min_workers,
            reset_limit=reset_limit,
            cooldown_range=cooldown_range,
            elastic_timeout=elastic_timeout,
        )
        self.settings: Any = None
        self.cpus_per_worker = cpus_per_worker
        self.executable: Optional[Tuple[Any, tuple, dict]] = None
        self.env: Dict[str, str] = {}

    def start(
        self,
        executable_cls: Optional[type] = None,
        executable_args: Optional[List[Any]] = None,
        executable_kwargs: Optional[Dict[str, Any]] = None,
        extra_env_vars: Optional[Dict[str, str]] = None,
    ) -> None:
        # The job's settings: Horovod's ElasticSettings' names over RayExecutor's settings.
        self.settings = SimpleNamespace(**dict(vars(self.user_settings), **self.params))
        _check_settings(self.settings)
        _check_ray()
        self.executable = (executable_cls, tuple(executable_args or ()), executable_kwargs or {})
        self.env = dict(extra_env_vars or {})

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[list] = None) -> List[Any]:
        return self._run(fn, callbacks)

    def run(
        self,
        fn: Callable[..., Any],
        args: Optional[list] = None,
        kwargs: Optional[dict] = None,
        callbacks: Optional[list] = None,
    ) -> List[Any]:
        a, k = list(args or []), dict(kwargs or {})
        return self._run(lambda _executable: fn(*a, **k), callbacks)

    def run_remote(self, *args: Any, **kwargs: Any) -> List[Any]:
        raise NotImplementedError(_NO_REFS)

    def execute_single(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(_NO_SINGLE)

    def shutdown(self) -> None:
        self.executable = None  # each job's actors ended with it

    def _run(self, fn: Callable[[Any], Any], callbacks: Optional[list]) -> List[Any]:
        if self.executable is None:
            raise RuntimeError("RayExecutor: call start() first")
        return run_elastic(
            self.settings,
            fn,
            cpus=self.cpus_per_worker,
            gpus=self.gpus_per_worker,
            env=self.env,
            callbacks=callbacks,
            executable=self.executable,
        )


def run_elastic(
    settings: Any,
    fn: Callable[[Any], Any],
    cpus: float,
    gpus: float,
    env: Dict[str, str],
    callbacks: Optional[Sequence[Callable]] = None,
    executable: Tuple[Any, tuple, dict] = (None, (), {}),
) -> List[Any]:
    """One elastic job of ``fn(executable)`` on actors; the last generation's values in rank
    order, or RuntimeError with why the job failed."""
    logs = _CallbackPump(callbacks) if callbacks else None
    launcher = RayActorLauncher(
        fn,
        cpus_per_slot=cpus,
        gpus_per_slot=gpus,
        env=env,
        executable=executable,
        log_queue=logs.queue if logs else None,
    )
    driver = ElasticDriver(
        [],
        _driver_settings(settings),
        settings.discovery,
        contract_env(settings),
        launcher=launcher,
    )
    driver.log_name = "bagua_hvd.ray"
    try:
        result = driver.run()
    finally:
        if logs is not None:
            logs.close()
    if result.exit_code != 0:
        message = (result.message or f"elastic job failed with code {result.exit_code}").rstrip()
        if launcher.errors:
            message += "\nWorker errors:\n" + "\n".join(
                f"  {host}[{local_rank}]: {why}" for (host, local_rank), why in launcher.errors[:8]
            )
        raise RuntimeError(message)
    ranked = sorted(driver.assignment.items(), key=lambda kv: kv[1].rank)
    return [launcher.results[key] for key, _ in ranked if key in launcher.results]


def _driver_settings(settings: Any) -> ElasticSettings:
    return ElasticSettings(
        num_proc=settings.num_proc,
        min_num_proc=settings.min_num_proc,
        max_num_proc=settings.max_num_proc,
        elastic_timeout=settings.elastic_timeout,
        reset_limit=settings.reset_limit,
        cooldown_range=tuple(settings.cooldown_range) if settings.cooldown_range else None,
        verbose=bool(getattr(settings, "verbose", 0)),
    )


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _check_settings(settings: Any) -> None:
    """The settings' elastic values, checked before any actor starts (ValueError naming them)."""
    if getattr(settings, "discovery", None) is None:
        raise ValueError(
            "settings.discovery is None: give override_discovery=True, or set "
            "settings.discovery to a HostDiscovery (e.g. bagua_hvd.ray.RayHostDiscovery)"
        )
    low, high = settings.min_num_proc, settings.max_num_proc
    if isinstance(low, bool) or not isinstance(low, int) or low < 1:
        raise ValueError(f"min_num_proc (min_workers) must be a positive integer, got {low!r}")
    if not isinstance(settings.num_proc, int) or settings.num_proc < low:
        raise ValueError(f"num_proc {settings.num_proc!r} is less than min_num_proc {low}")
    if high is not None and (not isinstance(high, int) or high < settings.num_proc):
        raise ValueError(
            f"max_num_proc (max_workers) {high!r} is less than min_num_proc {settings.num_proc}"
        )
    if settings.reset_limit is not None and settings.reset_limit < 0:
        raise ValueError(f"reset_limit must be >= 0, got {settings.reset_limit}")
    if settings.elastic_timeout is not None and settings.elastic_timeout < 0:
        raise ValueError(f"elastic_timeout must be >= 0 seconds, got {settings.elastic_timeout}")
    check_cooldown_range(settings.cooldown_range)


def _check_ray() -> None:
    import ray

    if not ray.is_initialized():
        raise RuntimeError("bagua_hvd.ray: connect to a Ray cluster first (ray.init())")


class _CallbackPump:
    """Calls ``callbacks`` in the driver with the workers' ray_logger records (a queue actor
    on the driver's node, read by a thread)."""

    def __init__(self, callbacks: Sequence[Callable]) -> None:
        import ray
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.callbacks = list(callbacks)
        here = ray.get_runtime_context().get_node_id()
        self.queue = Queue(
            actor_options={
                "num_cpus": 0,
                # On the driver's node, not soft: Ray would place an actor of no CPU elsewhere
                # (on a node that may go away with its workers).
                "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False),
            }
        )
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="bagua_hvd-ray-log", daemon=True)
        self._thread.start()

    def _call(self, record: Any) -> None:
        for c in self.callbacks:
            try:
                c(record)
            except Exception:  # noqa: BLE001 - a callback's bug must not end the job
                logger.exception("bagua_hvd.ray: a callback raised")

    def _pump(self) -> None:
        from ray.util.queue import Empty

        while not self._done.is_set():
            try:
                record = self.queue.get(timeout=0.2)
            except Empty:
                continue
            except Exception:  # noqa: BLE001 - the queue's actor is gone
                return
            self._call(record)

    def close(self) -> None:
        from ray.util.queue import Empty

        self._done.set()
        self._thread.join(timeout=10)
        # What the workers logged before they ended: puts are synchronous, so it is all there.
        try:
            while True:
                self._call(self.queue.get_nowait())
        except Empty:
            pass
        except Exception:  # noqa: BLE001 - the queue's actor is gone
            pass
        self.queue.shutdown()
