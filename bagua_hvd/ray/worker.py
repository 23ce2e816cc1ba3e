"""The body of a rank's Ray actor, shared by RayExecutor and the elastic executors (Horovod's
``horovod.ray.worker.BaseHorovodWorker``): the launcher's contract arrives through
:meth:`RayWorker.set_env`, never a command line."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Dict

from bagua_hvd.common import config


class RayWorker:
    """One rank's actor (wrapped by ``ray.remote`` where it is started)."""

    def __init__(self) -> None:
        self.executable: Any = None

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def set_env(self, env: Dict[str, str]) -> None:
        os.environ.update(env)
        if config.as_horovod():
            # The actor's interpreter started before the variable reached it (a Ray cluster's
            # environment is its own): the start-up hook's work, done now.
            from bagua_hvd import as_horovod

            as_horovod.install()

    def set_queue(self, queue: Any) -> None:
        """Where :func:`bagua_hvd.ray.ray_logger.log` sends its records in this actor."""
        from bagua_hvd.ray import ray_logger

        ray_logger.configure(queue)

    def start_executable(self, cls: Any, args: tuple, kwargs: dict) -> None:
        if cls is not None:
            self.executable = cls(*args, **kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.executable)

    def end_job(self) -> None:
        """What a rank's process does as it exits (the shutdown bagua_hvd registers with
        atexit), which ``ray.kill`` skips: a job still running here ends with the negotiated
        shutdown, so its peers see this rank finish (its bye, native/src/core/farewell.cc)
        rather than vanish under a collective they are still in. Nothing when no frontend was
        used."""
        import sys

        frontend = sys.modules.get("bagua_hvd.common.frontend")
        if frontend is not None:
            frontend.basics.shutdown()


def contract_env(settings: Any) -> Dict[str, str]:
    """What every rank's actor gets from the executor's settings besides the job's store and
    rank variables: the rendezvous timeout (``timeout_s``), the interface for TCP (``nics``:
    the first one; NCCL may use them all), and ``import horovod`` as bagua_hvd when the driver
    has it."""
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(getattr(settings, "timeout_s", 30)))}
    nics = getattr(settings, "nics", None)
    if nics:
        first = sorted(nics)[0] if isinstance(nics, set) else list(nics)[0]
        env["HOROVOD_GLOO_IFACE"] = first
        env["NCCL_SOCKET_IFNAME"] = ",".join(sorted(nics))
    if config.as_horovod():  # the driver imports horovod as bagua_hvd: so do the ranks
        env[config.AS_HOROVOD_ENV] = "1"
    return env
