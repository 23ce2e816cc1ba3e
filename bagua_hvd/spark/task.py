"""One Spark task of :func:`bagua_hvd.spark.run` (and of ``run_elastic``, below): runs on an
executor, never on the driver.

The task connects to the driver's rendezvous store (its address and the job's secret come in
the task's pickled closure, shipped by Spark), reports the host it runs on, waits for the
variables of the rank the driver gives it, then starts the rank as a fresh process,
``executable -m bagua_hvd.runner.task`` (the one-rank body of ``bagua_hvd.run``), under a guard
(bagua_hvd.runner.guard) that stops the rank when this Python worker goes away: Spark kills the
worker of a cancelled task, so a cancelled job leaves no rank behind. The rank's output lines go
to the driver through the store; its exit status too, once its outcome (result or traceback) is
stored under the rank's key.

A task of ``run_elastic`` (:func:`run_elastic_task`) registers its host and then beats every
``BEAT_S`` while it waits for the driver's commands: start a worker (a rank, as above, with the
variables the elastic driver gives it), stop it; it reports each worker's exit and runs workers
until the job is over. When the driver cannot be reached, it stops its worker and ends.

Why a process per rank rather than ``fn`` in the Python worker: Spark reuses its Python workers
between tasks (``spark.python.worker.reuse``), which would keep a rank's environment, imports
and runtime from one job to the next; a fresh process is what ``bagua-run`` gives each rank and
what Horovod's Spark tasks start too (the ``executable`` parameter).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Dict, Iterator, Optional, Tuple

from bagua_hvd.common import config
from bagua_hvd.rendezvous.store import SECRET_ENV, StoreClient, StoreError, StoreTimeoutError
from bagua_hvd.runner.job import (
    DRAIN_TIMEOUT_S,
    KILL_AFTER_S,
    _signal_group,
    _terminate_group,
    end_groups,
    guard_report,
    start_guarded,
)

PREFIX = "bagua_hvd.spark"
# Output lines are sent in batches of at most this many bytes (below the store's frame cap).
_BATCH_BYTES = 1 << 20
_POLL_S = 0.1


def host_key(index: int) -> str:
    """The key under which task ``index`` reports its host (JSON)."""
    return f"{PREFIX}/host/{index}"


def env_key(index: int) -> str:
    """The key under which the driver gives task ``index`` its rank's variables (JSON)."""
    return f"{PREFIX}/env/{index}"


def exit_key(index: int) -> str:
    """The key under which task ``index`` puts its rank's exit status (JSON)."""
    return f"{PREFIX}/exit/{index}"


def output_key(kind: str, index: int) -> str:
    """The key task ``index`` overwrites with each batch of its rank's ``kind`` lines (the
    driver hears every SET: one key per stream keeps the store's memory bounded)."""
    return f"{PREFIX}/{kind}/{index}"


def host_name() -> str:
    """The host a task's ranks are grouped by: ``BAGUA_HVD_SPARK_HOST``, else the machine's
    hostname."""
    return config.spark_host() or socket.gethostname()


def _pump(pipe: IO[bytes], kind: str, store: StoreClient, index: int) -> None:
    """Sends the rank's ``kind`` lines to the driver, as many as are ready per SET."""
    key = output_key(kind, index)
    try:
        while True:
            line = pipe.readline(_BATCH_BYTES)
            if not line:
                break
            batch = [line]
            size = len(line)
            while size < _BATCH_BYTES and select.select([pipe], [], [], 0)[0]:
                more = pipe.readline(_BATCH_BYTES - size)
                if not more:
                    break
                batch.append(more)
                size += len(more)
            try:
                store.set(key, b"".join(batch))
            except Exception:
                pass  # the driver is gone: keep draining so that the rank never blocks
    except (OSError, ValueError):
        pass
    finally:
        pipe.close()


def run_task(
    index: int,
    addr: str,
    port: int,
    secret_hex: str,
    start_timeout: float,
    executable: Optional[str],
) -> int:
    """The body of Spark task ``index``; returns the rank's exit status."""
    from pyspark import TaskContext

    secret = bytes.fromhex(secret_hex)
    context = TaskContext.get()
    attempt = context.attemptNumber() if context is not None else 0
    with StoreClient(addr, port, secret, timeout=start_timeout) as store:
        if attempt > 0:
            # A rank that started once cannot rejoin its job: fail the whole run instead.
            message = (
                f"Spark restarted task {index} (attempt {attempt}; why its first attempt "
                "failed is in the executor's log): a rank cannot rejoin its job"
            )
            store.set(exit_key(index), json.dumps({"code": None, "error": message}))
            raise RuntimeError(f"bagua_hvd.spark.run: {message}")
        store.set(host_key(index), json.dumps({"host": host_name(), "pid": os.getpid()}))
        given = json.loads(store.get(env_key(index), start_timeout))
    code, why = run_rank(index, given, addr, port, secret_hex, start_timeout, executable)
    with StoreClient(addr, port, secret, timeout=start_timeout) as store:
        store.set(exit_key(index), json.dumps({"code": code, "error": why}))
    return code


def run_rank(
    index: int,
    given: Dict[str, str],
    addr: str,
    port: int,
    secret_hex: str,
    start_timeout: float,
    executable: Optional[str],
    should_stop: Optional[Callable[[], bool]] = None,
) -> Tuple[int, Optional[str]]:
    """Runs a rank with the variables ``given`` over this worker's environment, as a guarded
    process whose output goes to the driver under ``index``; with ``should_stop``, stops it
    (SIGTERM, then SIGKILL) once that returns True. Returns its exit status (Popen's) and why
    it could not start (None when it did)."""
    secret = bytes.fromhex(secret_hex)
    env = dict(os.environ)
    env.update(given)
    # The secret is never stored (store traffic is authenticated, not encrypted): it reached
    # this task in its closure and reaches the rank through its environment, not argv.
    env[SECRET_ENV] = secret_hex
    command = [executable or sys.executable, "-m", "bagua_hvd.runner.task"]
    # The guard watches watch_r: only this process holds watch_w, so the guard sees end of
    # file (and stops the rank) exactly when this Python worker exits or is killed.
    watch_r, watch_w = os.pipe()
    try:
        proc, status_fd = start_guarded(command, env, watch_r)
        error = guard_report(status_fd)[1]
        stores = [StoreClient(addr, port, secret, timeout=start_timeout) for _ in range(2)]
        pumps = [
            threading.Thread(target=_pump, args=(pipe, kind, s, index), daemon=True)
            for pipe, kind, s in zip((proc.stdout, proc.stderr), ("stdout", "stderr"), stores)
        ]
        for t in pumps:
            t.start()
        code = proc.wait() if should_stop is None else _wait(proc, should_stop)
        end_groups([proc.pid])  # what the rank left running in its group
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for t in pumps:
            t.join(max(0.0, deadline - time.monotonic()))
        for s in stores:
            s.close()
    finally:
        os.close(watch_r)
        os.close(watch_w)
    return code, (None if error is None else f"cannot start {command[0]!r}: {error[1]}")


def _wait(proc: subprocess.Popen, should_stop: Callable[[], bool]) -> int:
    """The guard's exit status; SIGTERM to its group once ``should_stop()``, SIGKILL
    KILL_AFTER_S later."""
    kill_at: Optional[float] = None
    while True:
        try:
            return proc.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if kill_at is None and should_stop():
            _terminate_group(proc.pid)
            kill_at = time.monotonic() + KILL_AFTER_S
        elif kill_at is not None and time.monotonic() >= kill_at:
            _signal_group(proc.pid, signal.SIGKILL)
            kill_at = float("inf")


# ---- run_elastic's tasks -------------------------------------------------------------------

# How often an elastic task tells the driver it is alive (seconds).
BEAT_S = 0.5
ELASTIC_PREFIX = f"{PREFIX}/elastic/"
# The key whose presence tells every elastic task that the job is over.
OVER_KEY = f"{ELASTIC_PREFIX}over"


def elastic_key(what: str, name: object) -> str:
    """The keys of run_elastic: ``task/<task>`` (a task registers: its host, JSON), ``beat/<task>``
    (its heartbeat), ``command/<task>/<n>`` (the driver's n-th command to it, JSON: start a
    worker, stop it), ``exit/<worker>`` (a worker's exit status, JSON), ``result/<worker>`` (its
    outcome). A task is named ``<partition>.<attempt>``, a worker by the number the driver
    gives it."""
    return f"{ELASTIC_PREFIX}{what}/{name}"


def run_elastic_task(
    index: int,
    addr: str,
    port: int,
    secret_hex: str,
    start_timeout: float,
    executable: Optional[str],
) -> str:
    """The body of one task of ``run_elastic``: registers (its host), beats every BEAT_S and
    runs the workers the driver starts in it, one at a time, until the job is over or the
    driver is gone. Returns the task's name."""
    from pyspark import TaskContext

    context = TaskContext.get()
    task = f"{index}.{context.attemptNumber() if context is not None else 0}"
    secret = bytes.fromhex(secret_hex)

    def connect() -> StoreClient:
        return StoreClient(addr, port, secret, timeout=start_timeout)

    with connect() as store:
        if _is_set(store, OVER_KEY):  # scheduled after the job ended (a queued attempt)
            return task
        store.set(elastic_key("task", task), json.dumps({"host": host_name(), "pid": os.getpid()}))
    done = threading.Event()
    commands: queue.Queue = queue.Queue()
    helpers = [
        threading.Thread(target=_beat, args=(connect, task, done, commands), daemon=True),
        threading.Thread(target=_read_commands, args=(connect, task, done, commands), daemon=True),
    ]
    for t in helpers:
        t.start()
    try:
        while True:
            command = commands.get()
            if command.get("over"):
                return task
            if "start" not in command:
                continue  # the stop of a worker that ended already
            worker = int(command["worker"])
            ending: list = []

            def should_stop(worker: int = worker, ending: list = ending) -> bool:
                while not ending:
                    try:
                        c = commands.get_nowait()
                    except queue.Empty:
                        return False
                    if c.get("stop") == worker or c.get("over"):
                        ending.append(c)
                return True

            code, why = run_rank(worker, command["start"], addr, port, secret_hex,
                                 start_timeout, executable, should_stop)  # fmt: skip
            try:
                with connect() as store:
                    store.set(elastic_key("exit", worker), json.dumps({"code": code, "error": why}))
            except (OSError, StoreError):
                return task  # the driver is gone
            if any(c.get("over") for c in ending):
                return task
    finally:
        done.set()


def _is_set(store: StoreClient, key: str) -> bool:
    try:
        store.get(key, 0.0)
        return True
    except StoreTimeoutError:
        return False


def _beat(connect: Callable[[], StoreClient], task: str, done: threading.Event,
          commands: queue.Queue) -> None:  # fmt: skip
    """Tells the driver every BEAT_S that this task lives; when the driver cannot be reached,
    the task ends (its worker stopped)."""
    try:
        with connect() as store:
            beat = 0
            while not done.wait(BEAT_S):
                store.set(elastic_key("beat", task), str(beat))
                beat += 1
    except (OSError, StoreError):
        commands.put({"over": True})


def _read_commands(connect: Callable[[], StoreClient], task: str, done: threading.Event,
                   commands: queue.Queue) -> None:  # fmt: skip
    """Hands the driver's commands to the task in order; ``over`` once the job is over or the
    driver cannot be reached."""
    number = 0
    try:
        with connect() as store:
            while not done.is_set():
                try:
                    text = store.get(elastic_key("command", f"{task}/{number}"), BEAT_S)
                except StoreTimeoutError:
                    if _is_set(store, OVER_KEY):
                        break
                    continue
                commands.put(json.loads(text))
                number += 1
    except (OSError, StoreError):
        pass
    commands.put({"over": True})


def mapper(
    addr: str,
    port: int,
    secret_hex: str,
    start_timeout: float,
    executable: Optional[str],
    elastic: bool = False,
) -> Any:
    """The function of ``mapPartitionsWithIndex`` that runs one task per partition (of
    ``run_elastic`` with ``elastic``)."""
    body = run_elastic_task if elastic else run_task

    def run_partition(index: int, _rows: Iterator[Any]) -> Iterator[Tuple[int, Any]]:
        yield index, body(index, addr, port, secret_hex, start_timeout, executable)

    return run_partition
