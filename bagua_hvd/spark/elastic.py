"""``bagua_hvd.spark.run_elastic``: horovod.spark.run_elastic's interface, on bagua_hvd's elastic
driver (bagua_hvd.runner.elastic.driver, the one behind ``bagua-run --min-np``).

The driver serves the job's store under a fresh secret, as ``run`` does, and submits a Spark job
of ``max_num_proc`` tasks (a job group of its own). Each task (bagua_hvd.spark.task
.run_elastic_task) registers its host, beats every ``BEAT_S`` seconds and waits for commands.
Two parts plug the tasks into the elastic driver, as bagua_hvd.ray plugs in its actors:

- :class:`SparkTaskDiscovery`: the hosts are those of the live registered tasks, each with as
  many slots as it has live tasks (Horovod's SparkDriverHostDiscovery). A task is lost when it
  has not beaten for ``LOST_AFTER_S`` seconds (its Python worker or its executor is gone) or
  when Spark started another attempt of its partition; a new attempt registers as a fresh task.
- :class:`SparkTaskLauncher`: the driver's worker for slot (host, local rank) runs in an idle
  live task on that host (its rank as a guarded process, as ``run``'s tasks run theirs); the
  worker's exit, or the loss of its task, reaches the driver as ``("gone", worker, code)``.

So the generations, the blacklist, the reset limit and the host-update notifications are those of
bagua-run's elastic jobs: a lost executor takes its tasks' workers with it, the others reset into
a smaller job (the host of the failure is blacklisted), and tasks that register later are
announced to the workers and get workers of their own. Results are those of the last
generation's workers, in rank order (each worker puts its outcome under a key of its own, so
ranks that moved between generations never mix). When the job ends, every task is told so
(:data:`~bagua_hvd.spark.task.OVER_KEY`); the job group is cancelled if Spark has not finished its
tasks shortly after, so no task or rank is left behind.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import queue
import secrets
import threading
import time
import warnings
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

from bagua_hvd.runner import task as rank_task
from bagua_hvd.runner.elastic.discovery import HostDiscovery
from bagua_hvd.runner.elastic.hosts import SlotInfo
from bagua_hvd.runner.elastic.launcher import WorkerLauncher
from bagua_hvd.spark import runner
from bagua_hvd.spark import task as spark_task

logger = logging.getLogger(__name__)

# A task not heard from for this long (seconds) is lost: its Python worker or executor is gone.
LOST_AFTER_S = 5.0
# Once the job is over, how long the tasks have to end before the job group is cancelled.
_END_WAIT_S = 10.0
_POLL_S = 0.05

SlotKey = Tuple[str, int]


@dataclasses.dataclass(eq=False)
class _Task:
    """A registered Spark task (one attempt of a partition)."""

    name: str  # <partition>.<attempt>
    host: str
    heard: float  # when it last beat (monotonic)
    commands: int = 0  # the number of the next command to it
    worker: Optional[SparkWorker] = None  # the worker it runs
    lost: bool = False


@dataclasses.dataclass(eq=False)
class SparkWorker:
    """The launcher's handle of one worker of the elastic driver."""

    key: SlotKey
    number: int  # unique in the job: names its output, exit and outcome keys
    env: Dict[str, str]
    since: float  # when the driver started it (monotonic)
    task: Optional[_Task] = None
    stopped: bool = False
    code: Optional[int] = None  # once its "gone" is posted
    error: Optional[str] = None  # why it failed, when not its own traceback


class SparkTaskLauncher(WorkerLauncher):
    """Runs the elastic driver's workers in the registered tasks of a Spark job (see the module
    docstring); ``on_set`` must receive the SETs of the job's store."""

    def __init__(self, server: Any, addr: str, start_timeout: float, rank_of: Dict[int, int]):
        self.server = server
        self.addr = addr
        self.start_timeout = start_timeout
        self.rank_of = rank_of  # worker number -> rank at its start, for the output's prefix
        self.events: Optional[queue.Queue] = None  # the driver's
        self.job: Optional[runner._SparkJob] = None
        self.tasks: Dict[str, _Task] = {}
        self.workers: List[SparkWorker] = []
        self.latest: Dict[SlotKey, SparkWorker] = {}  # each slot's newest worker
        self.pending: List[SparkWorker] = []  # started, waiting for an idle task on its host
        self.lock = threading.RLock()
        self.numbers = itertools.count()
        self.aborted = False

    # ---- what the tasks say (the store's hook, on its client threads) -------------------

    def on_set(self, key: bytes, value: bytes) -> None:
        head = spark_task.ELASTIC_PREFIX.encode()
        if not key.startswith(head):
            return
        what, _, name = key[len(head) :].decode("utf-8", "replace").partition("/")
        now = time.monotonic()
        with self.lock:
            if what == "beat":
                task = self.tasks.get(name)
                if task is not None:
                    task.heard = now
            elif what == "task":
                self._register(name, json.loads(value)["host"], now)
            elif what == "exit":
                worker = next((w for w in self.workers if str(w.number) == name), None)
                if worker is not None and worker.code is None:
                    report = json.loads(value)
                    worker.error = report.get("error")
                    self._gone(worker, report["code"])
                    self._bind_pending(now)

    def _register(self, name: str, host: str, now: float) -> None:
        partition = name.split(".")[0]
        for other in self.tasks.values():
            if other.name.split(".")[0] == partition and not other.lost:
                self._lose(other, f"Spark started task {name} in its place")
        self.tasks[name] = _Task(name, host, now)
        self._bind_pending(now)

    def _lose(self, task: _Task, why: str) -> None:
        task.lost = True
        logger.warning("bagua_hvd.spark.run_elastic: Spark task %s on %s is lost: %s",
                       task.name, task.host, why)  # fmt: skip
        worker = task.worker
        if worker is not None:
            worker.error = f"its Spark task {task.name} on {task.host} was lost: {why}"
            self._command(task, {"stop": worker.number})  # in case it still runs after all
            self._gone(worker, 1)

    def _gone(self, worker: SparkWorker, code: int) -> None:
        worker.code = code
        if worker.task is not None and worker.task.worker is worker:
            worker.task.worker = None
        if self.events is not None:
            self.events.put(("gone", worker, code))

    def _command(self, task: _Task, command: Dict[str, Any]) -> None:
        key = spark_task.elastic_key("command", f"{task.name}/{task.commands}")
        task.commands += 1
        self.server.set(key, json.dumps(command))

    def _bind_pending(self, now: float) -> None:
        """Starts pending workers in idle live tasks of their hosts (one may still be ending a
        removed worker); those whose host has no live task left, or that waited longer than
        the start timeout, fail."""
        for worker in list(self.pending):
            host = worker.key[0]
            live = [t for t in self.tasks.values() if t.host == host and not t.lost]
            idle = next((t for t in live if t.worker is None), None)
            if idle is not None:
                self.pending.remove(worker)
                idle.worker, worker.task = worker, idle
                self._command(idle, {"start": worker.env, "worker": worker.number})
            elif not live or now - worker.since > self.start_timeout:
                self.pending.remove(worker)
                worker.error = f"no idle Spark task on host {host}" + (
                    f" within {self.start_timeout:g}s" if live else " (none is left)"
                )
                self._gone(worker, 1)

    def live_slots(self) -> Dict[str, int]:
        """``{host: live tasks}``; first loses the tasks that stopped beating, and ends the job
        when its Spark job ended."""
        now = time.monotonic()
        with self.lock:
            for task in self.tasks.values():
                if not task.lost and now - task.heard > LOST_AFTER_S:
                    self._lose(task, f"not heard from for {LOST_AFTER_S:g}s (its executor or "
                                     "Python worker is gone)")  # fmt: skip
            self._bind_pending(now)
            slots = collections.Counter(t.host for t in self.tasks.values() if not t.lost)
        job = self.job
        if job is not None and job.done() and self.events is not None and not self.aborted:
            self.aborted = True
            self.events.put(("abort", _ended(job), None))
        return dict(slots)

    # ---- the WorkerLauncher -------------------------------------------------------------

    def address(self, first_hosts: Sequence[str]) -> str:
        return self.addr

    def start(
        self, info: SlotInfo, generation: int, env: Dict[str, str], events: queue.Queue
    ) -> SparkWorker:
        from bagua_hvd.rendezvous.store import SECRET_ENV

        number = next(self.numbers)
        given = {k: v for k, v in env.items() if k != SECRET_ENV}  # the tasks hold it already
        given[rank_task.RESULT_KEY_ENV] = spark_task.elastic_key("result", number)
        worker = SparkWorker((info.hostname, info.local_rank), number, given, time.monotonic())
        self.rank_of[number] = info.rank
        with self.lock:
            self.events = events
            self.workers.append(worker)
            self.latest[worker.key] = worker
            self.pending.append(worker)
            self._bind_pending(worker.since)
        return worker

    def stop(self, handle: SparkWorker) -> None:
        with self.lock:
            handle.stopped = True
            if handle.code is not None:
                return
            if handle in self.pending:
                self.pending.remove(handle)
                self._gone(handle, 1)
            elif handle.task is not None:
                self._command(handle.task, {"stop": handle.number})

    def end(self, handles: Sequence[SparkWorker]) -> None:
        for h in handles:
            self.stop(h)
        # A stopped rank ends within KILL_AFTER_S; a lost task is noticed within LOST_AFTER_S.
        deadline = time.monotonic() + LOST_AFTER_S + 10.0
        while any(h.code is None for h in handles) and time.monotonic() < deadline:
            self.live_slots()
            time.sleep(_POLL_S)

    # ---- the outcome --------------------------------------------------------------------

    def outcome(self, worker: SparkWorker, rank: int) -> Optional[tuple]:
        return rank_task.read_outcome(
            self.server, rank, spark_task.elastic_key("result", worker.number)
        )

    def results(self, assignment: Dict[SlotKey, SlotInfo]) -> List[Any]:
        """The values of the workers of ``assignment`` (the last generation), in rank order."""
        values = []
        for key, info in sorted(assignment.items(), key=lambda kv: kv[1].rank):
            worker = self.latest.get(key)
            outcome = self.outcome(worker, info.rank) if worker is not None else None
            if outcome is None or outcome[0] != "ok":
                raise RuntimeError(
                    f"bagua_hvd.spark.run_elastic: rank {info.rank} of the last generation "
                    "exited but left no result"
                )
            values.append(outcome[1])
        return values

    def errors(self) -> List[str]:
        """Why workers failed (their tracebacks, or what happened to their tasks), in order."""
        out = []
        for w in self.workers:
            if w.code in (None, 0) or (w.stopped and w.error is None):
                continue
            outcome = self.outcome(w, -1)
            why = outcome[1] if outcome is not None and outcome[0] == "error" else w.error
            if why:
                out.append(f"  {w.key[0]}[{w.key[1]}] (worker {w.number}): {why.rstrip()}")
        return out


class SparkTaskDiscovery(HostDiscovery):
    """The hosts of the live registered tasks of a run_elastic job, each with as many slots as
    it has live tasks (Horovod's SparkDriverHostDiscovery)."""

    def __init__(self, launcher: SparkTaskLauncher) -> None:
        self.launcher = launcher

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        return self.launcher.live_slots()


def _ended(job: runner._SparkJob) -> str:
    why = f"it failed: {job.error}" if job.error is not None else "its tasks all returned"
    return f"bagua_hvd.spark.run_elastic: the Spark job of the tasks ended ({why})"


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    num_proc: Optional[int] = None,
    min_num_proc: Optional[int] = None,
    max_num_proc: Optional[int] = None,
    start_timeout: Optional[float] = None,
    elastic_timeout: Optional[float] = None,
    reset_limit: Optional[int] = None,
    env: Optional[Dict[str, str]] = None,
    stdout: Optional[IO[str]] = None,
    stderr: Optional[IO[str]] = None,
    verbose: int = 1,
    nics: Optional[Sequence[str]] = None,
    prefix_output_with_timestamp: bool = False,
    min_np: Optional[int] = None,
    max_np: Optional[int] = None,
) -> List[Any]:
    """Runs Elastic Horovod on Spark: ``fn(*args, **kwargs)`` on ``num_proc`` ranks to start
    with, each in a Spark task of the active SparkContext, going on with between
    ``min_num_proc`` and ``max_num_proc`` ranks as tasks are lost or added (``fn`` uses
    ``hvd.elastic.run`` and a state object). horovod.spark.run_elastic's signature and defaults.

    Args:
        fn: the function each rank runs; it, its arguments and its result must be picklable
            with cloudpickle.
        args: positional arguments of ``fn`` (default ``()``).
        kwargs: keyword arguments of ``fn`` (default none).
        num_proc: the number of ranks to start with (default: the SparkContext's
            ``defaultParallelism``).
        min_num_proc: the fewest ranks training goes on with; with fewer, the job waits (at
            most ``elastic_timeout``) for more tasks (default: ``num_proc``).
        max_num_proc: the most ranks; this many Spark tasks are submitted (default:
            ``num_proc``).
        start_timeout: seconds for ``num_proc`` tasks to be scheduled and register, and for a
            worker to find an idle task on its host (default ``HOROVOD_SPARK_START_TIMEOUT``,
            else 600).
        elastic_timeout: seconds to wait for ``min_num_proc`` slots after a reset, and for the
            other workers to reset once one did (default ``HOROVOD_ELASTIC_TIMEOUT``, else 600).
        reset_limit: the most resets before the job fails (default: no limit).
        env: variables set in every rank, over the executor's environment.
        stdout: where the ranks' stdout lines go, prefixed ``[rank]<stdout>:`` with the rank a
            worker started with (default ``sys.stdout``).
        stderr: the same for stderr (default ``sys.stderr``).
        verbose: 0 quiet, 1 (default) the number of processes, 2 also the elastic driver's log.
        nics: network interfaces for the job's TCP traffic (the first one; default: the
            address Spark's executors reach the driver at).
        prefix_output_with_timestamp: start each forwarded line with the time (default False).
        min_np: deprecated name of ``min_num_proc`` (DeprecationWarning).
        max_np: deprecated name of ``max_num_proc`` (DeprecationWarning).

    Returns:
        ``results[r]`` is what ``fn`` returned on rank r of the last generation.

    Raises:
        RuntimeError: no active SparkContext; the elastic job failed (Horovod's message and the
            workers' errors; no task of the job is left running); the Spark job failed.
        TimeoutError: ``num_proc`` tasks did not register within ``start_timeout``.
        ValueError: bad arguments.
    """
    from bagua_hvd.rendezvous.store import StoreServer
    from bagua_hvd.runner.elastic.driver import ElasticDriver, ElasticSettings

    if min_np is not None:
        min_num_proc = min_np
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
    if max_np is not None:
        max_num_proc = max_np
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
    sc, timeout, n, nic_list = runner.checked_arguments("run_elastic", fn, start_timeout,
                                                        num_proc, nics)  # fmt: skip
    low = n if min_num_proc is None else min_num_proc
    high = n if max_num_proc is None else max_num_proc
    for name, value in (("min_num_proc", low), ("max_num_proc", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not low <= n <= high:
        raise ValueError(
            f"min_num_proc ({low}) <= num_proc ({n}) <= max_num_proc ({high}) does not hold"
        )
    if reset_limit is not None and reset_limit < 0:
        raise ValueError(f"reset_limit must be >= 0, got {reset_limit}")
    if verbose >= 1:
        what = "" if num_proc is not None else " (inferred from spark.default.parallelism)"
        logger.info("Running %d processes%s...", n, what)
    payload = runner.pickled("run_elastic", fn, args, kwargs)
    bind, addr = runner.addresses(sc, nic_list)
    secret = secrets.token_bytes(32)
    output = runner._Output(stdout, stderr, prefix_output_with_timestamp)
    hooks: List[Callable[[bytes, bytes], None]] = [output.on_set]

    def on_set(key: bytes, value: bytes) -> None:
        for hook in hooks:
            hook(key, value)

    server = StoreServer(secret, host=bind, port=0, on_set=on_set)
    server.start()
    launcher = SparkTaskLauncher(server, addr, timeout, output.rank_of)
    hooks.append(launcher.on_set)
    job: Optional[runner._SparkJob] = None
    succeeded = False
    try:
        rank_task.put_blob(server, rank_task.FUNC_KEY, payload)
        group = f"bagua_hvd.spark.run_elastic.{next(runner._job_ids)}.{secrets.token_hex(4)}"
        mapper = spark_task.mapper(addr, server.port, secret.hex(), timeout, None, elastic=True)
        job = runner._SparkJob(sc, group, high, mapper, name="bagua_hvd.spark.run_elastic")
        launcher.job = job
        _wait_for_tasks(launcher, job, n, timeout)
        settings = ElasticSettings(
            num_proc=n,
            min_num_proc=low,
            max_num_proc=high,
            elastic_timeout=elastic_timeout,
            reset_limit=reset_limit,
            start_timeout=timeout,
            verbose=verbose >= 2,
            nic=nic_list[0] if nic_list else None,
        )
        driver = ElasticDriver(
            [],
            settings,
            SparkTaskDiscovery(launcher),
            runner.rank_env(nic_list, env),
            launcher=launcher,
            store=(server, secret),
        )
        driver.log_name = "bagua_hvd.spark.run_elastic"
        launcher.events = driver.events
        hooks.append(driver.on_set)
        result = driver.run()
        if result.exit_code != 0:
            message = (result.message or f"the job failed with code {result.exit_code}").rstrip()
            errors = launcher.errors()
            if errors:
                message += "\nWorker errors:\n" + "\n".join(errors[:8])
            raise RuntimeError(f"bagua_hvd.spark.run_elastic: {message}")
        values = launcher.results(driver.assignment)
        succeeded = True
        return values
    finally:
        server.set(spark_task.OVER_KEY, b"1")
        if job is not None:
            if succeeded:  # the tasks end as they read OVER_KEY
                job.thread.join(_END_WAIT_S)
            if not job.done():
                job.cancel()
        server.stop()


def _wait_for_tasks(launcher: SparkTaskLauncher, job: runner._SparkJob, n: int, timeout: float):
    """Until ``n`` live tasks registered; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        live = sum(launcher.live_slots().values())
        if live >= n:
            return
        if job.done():
            raise RuntimeError(_ended(job))
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"bagua_hvd.spark.run_elastic: timed out after {timeout:g}s waiting for Spark "
                f"tasks to start: {live} of {n} registered. {runner._TIMEOUT_HINT}"
            )
        time.sleep(_POLL_S)
