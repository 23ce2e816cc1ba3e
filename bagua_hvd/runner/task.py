"""One rank of ``bagua_hvd.run``: ``python -m bagua_hvd.runner.task``.

Reads ``(func, args, kwargs)`` (cloudpickle) from the job's rendezvous store, calls it and puts
``("ok", result)`` or ``("error", traceback text)`` back under the rank's key; a failure also exits
with status 1 so that the launcher stops the other ranks.

Why the store and not files or the agent's pipes: the store is already there for every job, on
one host or many; every rank reaches it (hvd.init() does) and it admits only who knows the job's
secret, which the ranks already hold in their environment. So no directory shared between hosts
is needed, nothing travels on a command line, and a result never mixes with the ranks' output
lines (the agents' stdout, where a multi-MB pickle would have to be encoded into one line). The
launcher holds the results in memory until the job is over, as horovod.run's key-value store
does. Values go in chunks below the store's frame limit, so their size is bounded only by memory.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Optional, Protocol

FUNC_KEY = "bagua_hvd.run/func"
# Below the store's frame limit (store.DEFAULT_MAX_FRAME_BYTES, 16 MiB) with room for the key.
CHUNK_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 30.0


class KeyValue(Protocol):
    """What both ends of the rendezvous store offer (StoreServer locally, StoreClient remotely)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> bytes: ...


# Where a launcher tells its workers apart by something else than their rank (bagua_hvd.spark's
# elastic workers, whose ranks change from one generation to the next), it names in this
# variable the key of each worker's outcome.
RESULT_KEY_ENV = "BAGUA_HVD_RESULT_KEY"


def result_key(rank: int) -> str:
    """The key under which rank ``rank`` puts its outcome (unless RESULT_KEY_ENV names one)."""
    return f"bagua_hvd.run/result/{rank}"


def put_blob(store: KeyValue, key: str, data: bytes) -> None:
    """Stores ``data`` under ``key`` in chunks (``key/0``, ``key/1``...), then ``key`` itself:
    whoever sees ``key`` finds every chunk."""
    count = max(1, -(-len(data) // CHUNK_BYTES))
    view = memoryview(data)
    for i in range(count):
        store.set(f"{key}/{i}", bytes(view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]))
    store.set(key, f"{count} {len(data)}".encode())


def get_blob(store: KeyValue, key: str, timeout: float) -> bytes:
    """Reads what :func:`put_blob` stored, waiting up to ``timeout`` seconds for ``key``."""
    count, size = (int(x) for x in store.get(key, timeout).split())
    data = b"".join(store.get(f"{key}/{i}", 0.0) for i in range(count))
    if len(data) != size:
        raise RuntimeError(f"{key}: {len(data)} bytes stored, {size} announced")
    return data


def _timeout() -> float:
    try:
        value = float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


# bagua_hvd.run(use_mpi=True): mpirun starts the ranks, which form the job through MPI at
# hvd.init(); the caller's store (func and results) is named here, not in the rendezvous
# variables, which would tell hvd.init() that bagua-run started the job.
RUN_STORE_ENV = "BAGUA_HVD_RUN_STORE"
RUN_SECRET_ENV = "BAGUA_HVD_RUN_SECRET"


def _connect() -> Any:
    """A client of the job's store, from the environment the launcher gives every rank."""
    from bagua_hvd.rendezvous.store import StoreClient, secret_from_env

    if os.environ.get(RUN_STORE_ENV):
        host, _, port_text = os.environ[RUN_STORE_ENV].rpartition(":")
        secret = secret_from_env(os.environ.get(RUN_SECRET_ENV, ""))
        return StoreClient(host, int(port_text), secret, timeout=_timeout())
    host = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"]
    port = int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
    return StoreClient(host, port, secret_from_env(), timeout=_timeout())


def _put_outcome(rank: int, outcome: tuple) -> None:
    import cloudpickle

    data = cloudpickle.dumps(outcome)
    with _connect() as store:
        put_blob(store, os.environ.get(RESULT_KEY_ENV) or result_key(rank), data)


def _report_error(rank: int, text: str) -> None:
    sys.stderr.write(text)
    try:
        _put_outcome(rank, ("error", text))
    except Exception:
        pass  # the traceback is on stderr anyway


def read_outcome(store: KeyValue, rank: int, key: Optional[str] = None) -> Optional[tuple]:
    """Rank ``rank``'s ``("ok", value)`` or ``("error", text)`` (the outcome under ``key``
    when given); None when it left none."""
    from bagua_hvd.rendezvous.store import StoreTimeoutError

    try:
        data = get_blob(store, key or result_key(rank), 0.0)
    except StoreTimeoutError:
        return None
    import cloudpickle

    return cloudpickle.loads(data)


def _rank() -> int:
    # Read when the outcome is put: an elastic job's resets give the worker a new rank (and
    # HOROVOD_RANK with it), as Horovod's run_task reads it after the function.
    rank = os.environ.get("HOROVOD_RANK")
    if rank is None:  # under mpirun, a function that never called hvd.init()
        from bagua_hvd.common import config

        found = config.foreign_launch()
        return found.rank if found is not None else 0
    return int(rank)


def main(argv: list) -> int:
    """Runs the job's function and puts its outcome under this rank (HOROVOD_RANK when the
    function ends); returns the exit status."""
    if argv:
        print("usage: python -m bagua_hvd.runner.task (started by bagua_hvd.run)", file=sys.stderr)
        return 2
    try:
        import cloudpickle

        with _connect() as store:
            payload = get_blob(store, FUNC_KEY, _timeout())
        func, args, kwargs = cloudpickle.loads(payload)
        del payload
        value = func(*args, **kwargs)
    except BaseException:  # noqa: B036 - SystemExit/KeyboardInterrupt in func are failures too
        _report_error(_rank(), traceback.format_exc())
        return 1
    rank = _rank()
    try:
        _put_outcome(rank, ("ok", value))
    except Exception:
        text = traceback.format_exc()
        _report_error(rank, f"the result of rank {rank} could not be pickled or sent:\n{text}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
