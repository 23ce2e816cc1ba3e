"""``bagua_hvd.spark.run``: horovod.spark.run's interface, ranks in Spark tasks.

The driver (the process with the active SparkContext) serves the job's rendezvous store under a
fresh secret, as bagua-run does, and submits one Spark task per rank (a job of ``num_proc``
partitions, in a job group of its own). Each task (bagua_hvd.spark.task) reports its host through
the store; once all have, the driver numbers the ranks host by host (the host of task 0 first,
so task 0 is rank 0; a host's tasks get consecutive ranks and share memory), computes each
rank's variables as bagua-run does and hands them to the tasks through the store, without the
secret, which the tasks already hold from their closure. Each task then runs its rank as a
process of its own, which reads ``fn`` from the store and leaves its result or traceback there,
as with ``bagua_hvd.run``; the ranks' output comes to the driver.

When a rank fails, the start times out, or Spark fails a task, the driver cancels the job group
(Spark kills the tasks' Python workers, whose guards stop the ranks) and waits, bounded, until
Spark reports no task of the job running before it raises.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import signal
import sys
import threading
import time
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

from bagua_hvd.common import config
from bagua_hvd.spark import task as spark_task

logger = logging.getLogger(__name__)

_POLL_S = 0.05
# After a cancel, how long the driver waits for Spark to report the job's tasks gone.
_CANCEL_WAIT_S = 60.0
_job_ids = itertools.count()

_TIMEOUT_HINT = (
    "Please check that you have enough resources to run all Horovod processes. Each Horovod "
    "process runs in a Spark task. You may need to increase the start_timeout parameter to a "
    "larger value if your Spark resources are allocated on-demand."
)


def _assign(hosts: Sequence[str]) -> List[int]:
    """The task index of each rank, given each task's host: hosts in the order their first
    task comes (task 0's host first), a host's tasks in index order."""
    order = list(dict.fromkeys(hosts))
    return sorted(range(len(hosts)), key=lambda i: (order.index(hosts[i]), i))


class _Output:
    """Writes the ranks' output lines, as bagua-run prefixes them (``[rank]<stdout>:``)."""

    def __init__(self, stdout: Optional[IO[str]], stderr: Optional[IO[str]], timestamp: bool):
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._timestamp = timestamp
        self._lock = threading.Lock()
        self.rank_of: Dict[int, int] = {}  # task index -> rank

    def on_set(self, key: bytes, value: bytes) -> None:
        """The store's hook: a batch of output lines from a task."""
        for kind in ("stdout", "stderr"):
            head = f"{spark_task.PREFIX}/{kind}/".encode()
            if key.startswith(head):
                index = int(key[len(head) :])
                self._write(kind, self.rank_of.get(index, index), value)
                return

    def _write(self, kind: str, rank: int, data: bytes) -> None:
        # Looked up per write so that a redirected sys.stdout (notebooks, pytest) is honoured.
        stream = self._streams[kind] or (sys.stdout if kind == "stdout" else sys.stderr)
        if stream is None:
            return
        prefix = f"[{rank}]<{kind}>:"
        lines = []
        for line in data.decode("utf-8", "replace").splitlines():
            stamp = time.asctime() if self._timestamp else ""
            lines.append(f"{stamp}{prefix}{line}\n")
        with self._lock:
            try:
                stream.write("".join(lines))
                stream.flush()
            except (OSError, ValueError):
                pass  # our own output is gone: the job goes on


class _SparkJob:
    """The Spark job of the tasks, collected in a thread of its own (a job group per run)."""

    def __init__(
        self, sc: Any, group: str, n: int, mapper: Callable, name: str = "bagua_hvd.spark.run"
    ) -> None:
        self.sc = sc
        self.name = name
        self.group = group
        self.error: Optional[BaseException] = None
        self.result: Optional[List[Tuple[int, int]]] = None

        def collect() -> None:
            try:
                # Set in this thread: PySpark pins a Python thread to a JVM thread, and local
                # properties (the job group) belong to the thread that submits the job.
                sc.setJobGroup(group, name, interruptOnCancel=True)
                rdd = sc.parallelize(range(n), n).mapPartitionsWithIndex(mapper)
                self.result = rdd.collect()
            except BaseException as e:  # noqa: B036 - reported by the driver's loop
                self.error = e

        self.thread = threading.Thread(target=collect, name="bagua_hvd-spark-job", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def active_tasks(self) -> int:
        tracker = self.sc.statusTracker()
        count = 0
        for job_id in tracker.getJobIdsForGroup(self.group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    count += stage.numActiveTasks
        return count

    def cancel(self) -> None:
        """Cancels the job and waits (bounded) until Spark reports none of its tasks running."""
        self.sc.cancelJobGroup(self.group)
        deadline = time.monotonic() + _CANCEL_WAIT_S
        self.thread.join(_CANCEL_WAIT_S)
        while time.monotonic() < deadline and self.active_tasks() > 0:
            time.sleep(_POLL_S)
        left = self.active_tasks()
        if left:
            logger.warning(
                "%s: %d Spark task(s) of job group %s still running %gs after the cancel",
                self.name,
                left,
                self.group,
                _CANCEL_WAIT_S,
            )


def _status(code: Optional[int]) -> str:
    if code is None:
        return "did not start"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _nic_address(nics: Sequence[str]) -> str:
    from bagua_hvd.common import network

    address = network.interface_address(nics[0])
    if address is None:
        raise ValueError(f"nics={list(nics)!r}: no IPv4 address on interface {nics[0]!r}")
    return address


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    num_proc: Optional[int] = None,
    start_timeout: Optional[float] = None,
    use_mpi: Optional[bool] = None,
    use_gloo: Optional[bool] = None,
    extra_mpi_args: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    stdout: Optional[IO[str]] = None,
    stderr: Optional[IO[str]] = None,
    verbose: int = 1,
    nics: Optional[Sequence[str]] = None,
    prefix_output_with_timestamp: bool = False,
    executable: Optional[str] = None,
) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` ranks, each in a Spark task of the active
    SparkContext, as one bagua_hvd job (``fn`` may call ``hvd.init()``); returns the results
    by rank. horovod.spark.run's signature and defaults.

    Args:
        fn: the function each rank runs; it, its arguments and its result must be picklable
            with cloudpickle.
        args: positional arguments of ``fn`` (default ``()``).
        kwargs: keyword arguments of ``fn`` (default none).
        num_proc: the number of ranks, one Spark task each (default: the SparkContext's
            ``defaultParallelism``). All tasks must run at once: the cluster needs as many free
            task slots.
        start_timeout: seconds for the tasks to be scheduled, register and receive their
            ranks (default ``HOROVOD_SPARK_START_TIMEOUT``, else 600).
        use_mpi: MPI across Spark tasks is not supported: True raises ValueError.
        use_gloo: bagua_hvd's own rendezvous and transports (Horovod's Gloo mode), which is
            what runs either way; True with use_mpi True is a ValueError, as Horovod.
        extra_mpi_args: accepted for compatibility; no mpirun runs, so it has no effect.
        env: variables set in every rank, over the executor's environment.
        stdout: where the ranks' stdout lines go, prefixed ``[rank]<stdout>:`` (default
            ``sys.stdout``).
        stderr: where the ranks' stderr lines go, prefixed ``[rank]<stderr>:`` (default
            ``sys.stderr``).
        verbose: 0 quiet, 1 (default) the number of processes, 2 also the placement of ranks.
        nics: network interfaces for the job's TCP traffic (the first one; default: the
            address Spark's executors reach the driver at).
        prefix_output_with_timestamp: start each forwarded line with the time (default False).
        executable: the Python that runs each rank on the executors (default: the Python that
            runs the task, Spark's Python worker: ``PYSPARK_PYTHON``).

    Returns:
        ``results[r]`` is what ``fn`` returned on rank r.

    Raises:
        RuntimeError: no active SparkContext; a rank failed (its traceback in the message; the
            Spark job was cancelled, no task of it is left running); Spark failed a task.
        TimeoutError: the tasks did not all start within ``start_timeout``.
        ValueError: bad arguments.
    """
    from bagua_hvd.rendezvous.store import SECRET_ENV, StoreServer
    from bagua_hvd.runner import task as rank_task
    from bagua_hvd.runner.bagua_run import job_env
    from bagua_hvd.runner.hosts import slot_among

    if use_mpi and use_gloo:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    if use_mpi:
        raise ValueError(
            "bagua_hvd.spark.run: use_mpi=True is not supported (no mpirun runs across Spark "
            "tasks); the ranks form the job through bagua_hvd's own rendezvous (use_gloo)"
        )
    sc, timeout, n, nic_list = checked_arguments("run", fn, start_timeout, num_proc, nics)
    if verbose >= 1:
        what = "" if num_proc is not None else " (inferred from spark.default.parallelism)"
        logger.info("Running %d processes%s...", n, what)
    payload = pickled("run", fn, args, kwargs)
    bind, addr = addresses(sc, nic_list)
    secret = secrets.token_bytes(32)
    output = _Output(stdout, stderr, prefix_output_with_timestamp)
    server = StoreServer(secret, host=bind, port=0, on_set=output.on_set)
    server.start()
    job: Optional[_SparkJob] = None
    try:
        rank_task.put_blob(server, rank_task.FUNC_KEY, payload)
        group = f"bagua_hvd.spark.run.{next(_job_ids)}.{secrets.token_hex(4)}"
        mapper = spark_task.mapper(addr, server.port, secret.hex(), timeout, executable)
        job = _SparkJob(sc, group, n, mapper)

        hosts_by_index = _wait_for_hosts(server, job, n, timeout)
        order = _assign(hosts_by_index)  # order[rank] = task index
        hosts = [hosts_by_index[i] for i in order]
        if verbose >= 2:
            logger.info("bagua_hvd.spark.run: ranks by host: %s", hosts)
        common = job_env(secret, secrets.token_hex(8), addr, server.port)
        del common[SECRET_ENV]  # never stored: the tasks have it already
        common.update(rank_env(nic_list, env))
        for rank, index in enumerate(order):
            output.rank_of[index] = rank
            variables = dict(common, **slot_among(hosts, rank).env())
            server.set(spark_task.env_key(index), json.dumps(variables))

        _wait_for_ranks(server, job, order, output.rank_of)
        job.thread.join(_CANCEL_WAIT_S)  # the tasks end as their ranks report
        if not job.done():
            raise RuntimeError(
                f"bagua_hvd.spark.run: every rank exited, but Spark did not finish the job's "
                f"tasks within {_CANCEL_WAIT_S:g}s"
            )
        if job.error is not None:
            raise RuntimeError(f"bagua_hvd.spark.run: the Spark job failed: {job.error}")
        results = []
        for rank in range(n):
            outcome = rank_task.read_outcome(server, rank)
            if outcome is None or outcome[0] != "ok":
                raise RuntimeError(f"bagua_hvd.spark.run: rank {rank} exited but left no result")
            results.append(outcome[1])
        return results
    finally:
        if job is not None and not job.done():
            job.cancel()
        server.stop()


def checked_arguments(
    name: str,
    fn: Callable[..., Any],
    start_timeout: Optional[float],
    num_proc: Optional[int],
    nics: Optional[Sequence[str]],
) -> Tuple[Any, float, int, List[str]]:
    """What ``run`` and ``run_elastic`` (``name``) check before any task: the active
    SparkContext, the start timeout (seconds), the number of processes and the NICs (a list)."""
    from pyspark import SparkContext

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    sc = SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(
            "Could not find an active SparkContext, are you running in a PySpark session?"
        )
    if sc.getConf().get("spark.speculation", "false").strip().lower() == "true":
        # A speculative copy of a task would start a second process for a rank.
        raise ValueError(
            f"bagua_hvd.spark.{name}: spark.speculation=true would run a second copy of a "
            "rank's task; set spark.speculation=false for this SparkContext"
        )
    timeout = config.spark_start_timeout() if start_timeout is None else float(start_timeout)
    if not timeout > 0:
        raise ValueError(f"start_timeout must be a positive number of seconds, got {timeout!r}")
    n = sc.defaultParallelism if num_proc is None else num_proc
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_proc must be an int >= 1, got {n!r}")
    nic_list = sorted(nics) if isinstance(nics, (set, frozenset)) else list(nics or [])
    return sc, timeout, n, nic_list


def pickled(name: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: Any) -> bytes:
    """``(fn, args, kwargs)`` as the ranks read it (cloudpickle); TypeError when it cannot be."""
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(f"bagua_hvd.spark.{name}: fn/args/kwargs cannot be pickled: {e}") from e


def addresses(sc: Any, nic_list: Sequence[str]) -> Tuple[str, str]:
    """Where the driver's store binds and the address the executors reach it at: the first
    NIC's, else where Spark's executors reach the driver and the address Spark binds to."""
    if nic_list:
        address = _nic_address(nic_list)
        return address, address
    conf = sc.getConf()
    addr = conf.get("spark.driver.host") or "127.0.0.1"
    return conf.get("spark.driver.bindAddress") or addr, addr


def rank_env(nic_list: Sequence[str], env: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The variables every rank gets besides the job's contract: the NICs for TCP, ``import
    horovod`` as bagua_hvd when the driver has it, then the caller's ``env``."""
    out: Dict[str, str] = {}
    if nic_list:
        out["HOROVOD_GLOO_IFACE"] = nic_list[0]
        out["NCCL_SOCKET_IFNAME"] = ",".join(nic_list)
    if config.as_horovod():  # the driver imports horovod as bagua_hvd: so do the ranks
        out[config.AS_HOROVOD_ENV] = "1"
    out.update({k: str(v) for k, v in (env or {}).items()})
    return out


def _wait_for_hosts(server: Any, job: _SparkJob, n: int, timeout: float) -> List[str]:
    """Every task's host, in task order, once all have registered."""
    from bagua_hvd.rendezvous.store import StoreTimeoutError

    hosts: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(hosts) < n:
        _check_failures(server, job, range(n), {})
        for index in range(n):
            if index not in hosts:
                try:
                    hosts[index] = json.loads(server.get(spark_task.host_key(index)))["host"]
                except StoreTimeoutError:
                    pass
        if len(hosts) == n:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"bagua_hvd.spark.run: timed out after {timeout:g}s waiting for Spark tasks to "
                f"start: {len(hosts)} of {n} registered. {_TIMEOUT_HINT}"
            )
        time.sleep(_POLL_S)
    return [hosts[i] for i in range(n)]


def _check_failures(
    server: Any, job: _SparkJob, indices: Sequence[int], rank_of: Dict[int, int]
) -> List[Optional[dict]]:
    """Each task's exit report (None while its rank runs); raises for a failed rank or job."""
    from bagua_hvd.rendezvous.store import StoreTimeoutError
    from bagua_hvd.runner import task as rank_task

    failed = job.done() and job.error is not None  # read first: the reports come before it
    exits: List[Optional[dict]] = []
    for index in indices:
        try:
            exits.append(json.loads(server.get(spark_task.exit_key(index))))
        except StoreTimeoutError:
            exits.append(None)
    for index, report in zip(indices, exits):
        if report is None or report["code"] == 0:
            continue
        rank = rank_of.get(index)
        outcome = rank_task.read_outcome(server, rank) if rank is not None else None
        if outcome is not None and outcome[0] == "error":
            raise RuntimeError(f"bagua_hvd.spark.run: rank {rank} failed:\n{outcome[1]}")
        what = f"Spark task {index}" if rank is None else f"rank {rank}"
        detail = f": {report['error']}" if report.get("error") else ""
        if report["code"] is None:  # the rank never ran
            raise RuntimeError(f"bagua_hvd.spark.run: {what}{detail}")
        raise RuntimeError(
            f"bagua_hvd.spark.run: {what} {_status(report['code'])} without a Python "
            f"traceback{detail} (its output is above)"
        )
    if failed:
        raise RuntimeError(f"bagua_hvd.spark.run: the Spark job failed: {job.error}")
    return exits


def _wait_for_ranks(
    server: Any, job: _SparkJob, order: Sequence[int], rank_of: Dict[int, int]
) -> None:
    """Until every rank exited with status 0 (no bound: ``fn`` may train for days); raises as
    soon as one fails or Spark fails the job."""
    while True:
        done = job.done()  # before the reports, which every task puts before it ends
        exits = _check_failures(server, job, order, rank_of)
        if all(report is not None for report in exits):
            return
        if done:
            raise RuntimeError(
                "bagua_hvd.spark.run: the Spark job ended before every rank reported its exit"
            )
        time.sleep(_POLL_S)
