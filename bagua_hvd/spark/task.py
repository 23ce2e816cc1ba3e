"""One Spark task of :func:`bagua_hvd.spark.run`: runs on an executor, never on the driver.

The task connects to the driver's rendezvous store (its address and the job's secret come in
the task's pickled closure, shipped by Spark), reports the host it runs on, waits for the
variables of the rank the driver gives it, then starts the rank as a fresh process,
``executable -m bagua_hvd.runner.task`` (the one-rank body of ``bagua_hvd.run``), under a guard
(bagua_hvd.runner.guard) that stops the rank when this Python worker goes away: Spark kills the
worker of a cancelled task, so a cancelled job leaves no rank behind. The rank's output lines go
to the driver through the store; its exit status too, once its outcome (result or traceback) is
stored under the rank's key.

Why a process per rank rather than ``fn`` in the Python worker: Spark reuses its Python workers
between tasks (``spark.python.worker.reuse``), which would keep a rank's environment, imports
and runtime from one job to the next; a fresh process is what ``bagua-run`` gives each rank and
what Horovod's Spark tasks start too (the ``executable`` parameter).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
from typing import IO, Any, Iterator, Optional, Tuple

from bagua_hvd.common import config
from bagua_hvd.rendezvous.store import SECRET_ENV, StoreClient
from bagua_hvd.runner.job import DRAIN_TIMEOUT_S, end_groups, guard_report, start_guarded

PREFIX = "bagua_hvd.spark"
# Output lines are sent in batches of at most this many bytes (below the store's frame cap).
_BATCH_BYTES = 1 << 20


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
        code = proc.wait()
        end_groups([proc.pid])  # what the rank left running in its group
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for t in pumps:
            t.join(max(0.0, deadline - time.monotonic()))
        for s in stores:
            s.close()
    finally:
        os.close(watch_r)
        os.close(watch_w)
    why = None if error is None else f"cannot start {command[0]!r}: {error[1]}"
    with StoreClient(addr, port, secret, timeout=start_timeout) as store:
        store.set(exit_key(index), json.dumps({"code": code, "error": why}))
    return code


def mapper(
    addr: str, port: int, secret_hex: str, start_timeout: float, executable: Optional[str]
) -> Any:
    """The function of ``mapPartitionsWithIndex`` that runs one task per partition."""

    def run_partition(index: int, _rows: Iterator[Any]) -> Iterator[Tuple[int, int]]:
        yield index, run_task(index, addr, port, secret_hex, start_timeout, executable)

    return run_partition
