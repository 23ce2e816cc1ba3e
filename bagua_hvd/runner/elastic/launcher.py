"""How the elastic driver starts and stops its workers (bagua_hvd.runner.elastic.driver).

The driver decides which slot runs a worker and when; a :class:`WorkerLauncher` does the
starting and stopping, and reports each worker's end on the driver's event queue as
``("gone", handle, returncode)`` (Popen's convention: 0 success, non-zero failure, -N killed by
signal N); a launcher that cannot go on may put ``("abort", message, None)``, which ends the job
as failed with that message. :class:`AgentLauncher`, the default, runs each worker's command as a process under
its own agent (bagua_hvd.runner.agent, over ssh for other machines), as bagua-run always did;
bagua_hvd.ray.launcher runs a function in a Ray actor instead.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shlex
import sys
import time
from typing import Callable, Dict, Sequence

import bagua_hvd.runner.ssh as ssh
from bagua_hvd.runner.elastic.hosts import SlotInfo
from bagua_hvd.runner.hosts import Slot, is_local_host


class WorkerLauncher:
    """Starts and stops the workers of an elastic job for the driver."""

    def address(self, first_hosts: Sequence[str]) -> str:
        """The address on which the driver serves its rendezvous store, reachable from the
        workers (``first_hosts``: the hosts of the first generation)."""
        raise NotImplementedError

    def start(self, info: SlotInfo, generation: int, env: Dict[str, str], events: queue.Queue):
        """Starts the worker of slot ``info`` (in the driver's ``generation``) with the
        launcher's contract ``env``; returns its handle. Its end must reach ``events`` as
        ``("gone", handle, returncode)``, once."""
        raise NotImplementedError

    def stop(self, handle: object) -> None:
        """Asks the worker to end (its "gone" event follows)."""
        raise NotImplementedError

    def end(self, handles: Sequence[object]) -> None:
        """Stops ``handles`` and waits, bounded, until they are gone."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the launcher holds once the job is over."""


class AgentLauncher(WorkerLauncher):
    """bagua-run's workers: ``command`` as a process under an agent per worker; closing the
    agent's stdin stops the worker, as for fixed jobs."""

    def __init__(
        self,
        command: Sequence[str],
        settings: object,  # driver.ElasticSettings (ssh, output and nic flags)
        log: Callable[[str], None],
    ) -> None:
        self.command = list(command)
        self.settings = settings
        self.log = log
        self.copies = ssh.OutputCopies(
            settings.output_dir, settings.max_num_proc or settings.num_proc
        )

    def address(self, first_hosts: Sequence[str]) -> str:
        if self.settings.nic:
            return ssh.interface_address(self.settings.nic)
        remote = [h for h in first_hosts if not is_local_host(h)]
        if remote:
            return ssh.address_toward(remote[0], self.settings.ssh_port or 22)
        return "127.0.0.1"

    def start(
        self, info: SlotInfo, generation: int, env: Dict[str, str], events: queue.Queue
    ) -> ssh.Agent:
        slot = slot_of(info)
        spec = {
            "command": self.command,
            "env": dict(ssh.forwarded_env(os.environ), **env),
            "cwd": os.getcwd(),
            "verbose": False,
            "slots": [dataclasses.asdict(slot)],
        }
        if is_local_host(info.hostname):
            argv = [sys.executable, *ssh.AGENT]
        else:
            argv = ssh.ssh_command(
                info.hostname,
                self.settings.ssh_port,
                self.settings.ssh_identity,
                self.settings.start_timeout,
            )
            argv.append(ssh.agent_command(spec["env"]))
        self.log(
            f"generation {generation}: starting rank {info.rank} on {info.hostname}"
            f"[{info.local_rank}]: {shlex.join(argv)}"
        )
        return ssh.start_agent(info.hostname, [slot], spec, argv, self.copies, events)

    def stop(self, handle: ssh.Agent) -> None:
        handle.close_stdin()

    def end(self, handles: Sequence[ssh.Agent]) -> None:
        ssh.end_agents(list(handles), time.monotonic())

    def close(self) -> None:
        self.copies.close()


def slot_of(info: SlotInfo) -> Slot:
    """The rank variables of ``info`` as the launchers hand them to a worker."""
    return Slot(
        rank=info.rank,
        size=info.size,
        local_rank=info.local_rank,
        local_size=info.local_size,
        cross_rank=info.cross_rank,
        cross_size=info.cross_size,
        hostname=info.hostname,
    )
