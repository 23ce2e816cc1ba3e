"""``RayExecutor``: a bagua_hvd job whose ranks are Ray actors, with horovod.ray's interface.

The driver (the process that builds the executor) serves the rendezvous store, as bagua-run
does; ``start()`` places one actor per rank through a placement group, learns which Ray node
each landed on, numbers the ranks node by node (a node's actors get consecutive ranks and share
memory; nodes talk TCP) and hands each actor the launcher's contract (its rank variables, the
store's address and the job's secret) through a method call, never a command line. Functions
given to ``run``/``execute`` then call ``hvd.init()`` in the actors as in any bagua_hvd job.

With ``min_workers`` the job is elastic (Horovod's elastic_v2 adapter): bagua_hvd.ray.elastic
runs it on bagua_hvd's elastic driver, one actor per worker pinned to its Ray node; each
``run``/``execute`` is one elastic job to its end.
"""

from __future__ import annotations

import secrets
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

from bagua_hvd.ray.worker import RayWorker, contract_env
from bagua_hvd.runner.hosts import slot_among


class RayExecutor:
    """A job of ``num_workers`` ranks (or ``num_hosts`` x ``num_workers_per_host``) on a Ray
    cluster (``ray.init()`` first), with horovod.ray's parameters and defaults.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: ranks, packed onto as few nodes as fit (exclusive with num_hosts).
        num_hosts: nodes, each running ``num_workers_per_host`` ranks.
        num_workers_per_host: ranks per node with num_hosts (default 1).
        cpus_per_worker: CPUs Ray reserves per rank (default 1).
        use_gpu: reserve ``gpus_per_worker`` (default 1) GPUs per rank.
        gpus_per_worker: GPUs per rank when use_gpu.
        use_current_placement_group: place the ranks in the placement group this code runs in,
            if any (default True).
        min_workers: elastic mode: the fewest workers training goes on with (exclusive with
            num_workers and num_hosts). The job starts once that many slots are there, with
            every slot of the cluster up to max_workers.
        max_workers: the most workers of an elastic job (default: no bound).
        reset_limit: the most resets of an elastic job before it fails (default: no bound).
        cooldown_range: ``(min, max)`` seconds a failed node stays blacklisted (default:
            forever).
        elastic_timeout: seconds an elastic job waits for min_workers slots (default 600).
        override_discovery: the elastic job's hosts are the live Ray nodes, cpus_per_worker
            (and with use_gpu gpus_per_worker) per slot (default True); False keeps
            ``settings.discovery``.

    In elastic mode ``start`` records the executable and environment, ``run``/``execute``
    each run one elastic job on new actors and return the last generation's values in rank
    order; ``run_remote`` and ``execute_single`` raise NotImplementedError, as Horovod's do.
    """

    @staticmethod
    def create_settings(
        timeout_s: float = 30,
        ssh_identity_file: Optional[str] = None,
        ssh_str: Optional[str] = None,
        placement_group_timeout_s: float = 100,
        nics: Optional[set] = None,
    ) -> SimpleNamespace:
        """The settings object of horovod.ray: ``timeout_s`` bounds the rendezvous
        (HOROVOD_GLOO_TIMEOUT_SECONDS), ``placement_group_timeout_s`` the wait for the ranks'
        resources, ``nics`` names the interface for TCP (the first one); the ssh settings are
        accepted for compatibility (the actors need no ssh)."""
        return SimpleNamespace(
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            ssh_str=ssh_str,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
        )

    def __init__(
        self,
        settings: Any,
        num_workers: Optional[int] = None,
        num_hosts: Optional[int] = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: int = 1,
        use_gpu: bool = False,
        gpus_per_worker: Optional[int] = None,
        use_current_placement_group: bool = True,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[tuple] = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
    ) -> None:
        # Horovod's checks and texts.
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError(
                "`max_workers` provided without any positive `min_workers`"
                "Elastic workloads require a positive `min_workers`"
            )
        if min_workers and num_workers:
            raise ValueError(
                "Both `min_workers` and `num_workers` provided.Only one of the above is allowed "
                "as workloads cannot be elastic and non-elastic."
            )
        self._elastic: Any = None
        if min_workers is not None:
            from bagua_hvd.ray.elastic import ElasticAdapter

            if num_hosts is not None:
                raise ValueError("RayExecutor: num_hosts is for fixed jobs; min_workers is elastic")
            self.settings = settings
            self._elastic = ElasticAdapter(
                settings,
                min_workers=min_workers,
                max_workers=max_workers,
                use_gpu=use_gpu,
                cpus_per_worker=cpus_per_worker,
                gpus_per_worker=gpus_per_worker,
                override_discovery=override_discovery,
                reset_limit=reset_limit,
                cooldown_range=cooldown_range,
                elastic_timeout=elastic_timeout,
            )
            return
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give exactly one of num_workers and num_hosts")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host),
                            ("cpus_per_worker", cpus_per_worker)):  # fmt: skip
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive integer, got {value!r}")
        self.settings = settings
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: List[Any] = []  # actor handles, in rank order
        self._server: Any = None
        self._pg: Any = None

    @property
    def size(self) -> int:
        if self.num_workers is not None:
            return self.num_workers
        return self.num_hosts * self.num_workers_per_host

    # -- lifecycle ----------------------------------------------------------------------------

    def start(
        self,
        executable_cls: Optional[type] = None,
        executable_args: Optional[List[Any]] = None,
        executable_kwargs: Optional[Dict[str, Any]] = None,
        extra_env_vars: Optional[Dict[str, str]] = None,
    ) -> None:
        """Places the ranks' actors, wires them into one job and builds
        ``executable_cls(*executable_args, **executable_kwargs)`` in each (``execute`` passes
        it to its function). ``extra_env_vars`` are set in every actor. Elastic: records them
        for the actors of each run."""
        if self._elastic is not None:
            return self._elastic.start(
                executable_cls, executable_args, executable_kwargs, extra_env_vars
            )
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from bagua_hvd.rendezvous.store import StoreServer
        from bagua_hvd.runner.bagua_run import job_env

        if self.workers:
            raise RuntimeError("RayExecutor.start() was called already; shutdown() first")
        resources = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            resources["GPU"] = self.gpus_per_worker
        pg = get_current_placement_group() if self.use_current_placement_group else None
        if pg is None:
            if self.num_hosts is not None:
                per_host = {k: v * self.num_workers_per_host for k, v in resources.items()}
                bundles, strategy = [per_host] * self.num_hosts, "STRICT_SPREAD"
            else:
                bundles, strategy = [resources] * self.size, "PACK"
            pg = self._pg = placement_group(bundles, strategy=strategy)
            timeout = getattr(self.settings, "placement_group_timeout_s", 100)
            ready, _ = ray.wait([pg.ready()], timeout=timeout)
            if not ready:
                self._remove_pg()
                raise TimeoutError(
                    f"RayExecutor: the cluster could not place {len(bundles)} bundle(s) of "
                    f"{bundles[0]} ({strategy}) within placement_group_timeout_s={timeout:g}"
                )
        actor_cls = ray.remote(RayWorker)
        per_bundle = self.num_workers_per_host if self.num_hosts is not None else 1
        actors = []
        for i in range(self.size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=i // per_bundle if self._pg is not None else -1,
            )
            actors.append(
                actor_cls.options(
                    num_cpus=self.cpus_per_worker,
                    num_gpus=self.gpus_per_worker,
                    scheduling_strategy=strategy,
                ).remote()
            )
        nodes = ray.get([a.node.remote() for a in actors])
        # Ranks node by node, in the order the nodes first appear.
        order = list(dict.fromkeys(nodes))
        ranked = sorted(range(self.size), key=lambda i: (order.index(nodes[i]), i))
        self.workers = [actors[i] for i in ranked]
        hosts = [nodes[i] for i in ranked]

        addr = ray.util.get_node_ip_address()
        secret = secrets.token_bytes(32)
        self._server = StoreServer(secret, host=addr, port=0)
        self._server.start()
        env = job_env(secret, secrets.token_hex(8), addr, self._server.port)
        env.update(contract_env(self.settings))
        env.update(extra_env_vars or {})
        ray.get(
            [
                w.set_env.remote(dict(env, **slot_among(hosts, rank).env()))
                for rank, w in enumerate(self.workers)
            ]
        )
        ray.get(
            [
                w.start_executable.remote(
                    executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {})
                )
                for w in self.workers
            ]
        )

    def shutdown(self) -> None:
        """Ends the actors and the rendezvous."""
        if self._elastic is not None:
            return self._elastic.shutdown()
        import ray

        from bagua_hvd.ray.launcher import end_jobs

        end_jobs(self.workers)
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._remove_pg()

    def _remove_pg(self) -> None:
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None

    # -- running functions -------------------------------------------------------------------

    def _check_started(self) -> None:
        if not self.workers:
            raise RuntimeError("RayExecutor: call start() first")

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[list] = None) -> List[Any]:
        """``fn(executable)`` on every rank; the results in rank order."""
        if self._elastic is not None:
            return self._elastic.execute(fn, callbacks)
        import ray

        return ray.get(self._remote(fn))

    def run(
        self,
        fn: Callable[..., Any],
        args: Optional[list] = None,
        kwargs: Optional[dict] = None,
        callbacks: Optional[list] = None,
    ) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order (elastic: of the
        last generation; ``callbacks`` get the workers' ray_logger records)."""
        if self._elastic is not None:
            return self._elastic.run(fn, args, kwargs, callbacks)
        import ray

        return ray.get(self.run_remote(fn, args, kwargs))

    def run_remote(
        self, fn: Callable[..., Any], args: Optional[list] = None, kwargs: Optional[dict] = None
    ) -> List[Any]:
        """As :meth:`run`, but returns the Ray object refs of the results (not elastic)."""
        if self._elastic is not None:
            return self._elastic.run_remote(fn, args, kwargs)
        a, k = list(args or []), dict(kwargs or {})
        return self._remote(lambda _executable: fn(*a, **k))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only (not elastic)."""
        if self._elastic is not None:
            return self._elastic.execute_single(fn)
        import ray

        self._check_started()
        return ray.get(self.workers[0].execute.remote(fn))

    def _remote(self, fn: Callable[[Any], Any]) -> List[Any]:
        self._check_started()
        return [w.execute.remote(fn) for w in self.workers]
