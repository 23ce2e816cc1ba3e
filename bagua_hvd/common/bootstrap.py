"""Jobs started by mpirun (Open MPI, MPICH, Intel MPI) or srun, without bagua-run.

``hvd.init()`` calls :func:`prepare` first. A process that bagua-run started has the launcher's
contract in its environment and nothing happens here. A process that mpirun or srun started as one
of N > 1 has only their variables: it then forms the job through MPI itself (mpi4py), as
bagua-run would have: rank 0 serves the rendezvous store (a thread of its process, needed only
while the ranks connect) and broadcasts its address and a fresh secret over MPI_COMM_WORLD, and
every rank derives its local and cross ranks from the host names gathered over MPI. The core
then starts as under bagua-run, with its own transports (shared memory, TCP).

A process that sees another launcher's variables but cannot join the job raises
:data:`JOIN_ERROR` on every rank instead of running alone as a job of size 1 (which would
train N unrelated replicas, each believing it is rank 0).
"""

from __future__ import annotations

import secrets
import socket
from typing import Any, List, Optional, Sequence, Tuple

from bagua_hvd.common import config, network

JOIN_ERROR = (
    "bagua_hvd: this process was started by {launcher} as rank {rank} of {size}, but it cannot "
    "join the other ranks: {why}. Install mpi4py (`pip install mpi4py`, for the MPI that "
    "started the job), or start the job with bagua-run (e.g. `bagua-run -np {size} -H "
    "host1:N,host2:N python train.py`)."
)

# Rank 0's rendezvous server under mpirun: kept for the life of the process (init, shutdown and
# init again reuse it, as they reuse bagua-run's).
_server: Any = None


def prepare() -> None:
    """Sets up the launcher's contract when another launcher started this process (see the
    module docstring); ValueError with :data:`JOIN_ERROR` when it cannot."""
    if config.launched_by_bagua_run():
        return
    found = config.foreign_launch()
    if found is None or found.size <= 1:
        return

    def fail(why: str) -> ValueError:
        return ValueError(JOIN_ERROR.format(why=why, **found._asdict()))

    try:
        from mpi4py import MPI
    except ImportError as e:
        raise fail(f"mpi4py cannot be imported ({e})") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != found.size or comm.Get_rank() != found.rank:
        raise fail(
            f"MPI (mpi4py, {MPI.Get_library_version().split(',')[0].strip()}) sees rank "
            f"{comm.Get_rank()} of {comm.Get_size()}: mpi4py is built for another MPI than "
            "the one that started the job"
        )
    variables = _form_job(comm, MPI.Get_processor_name())
    config.set_job(variables)


def _form_job(comm: Any, host: str) -> dict:
    """The launcher's variables of this rank, agreed on over MPI (collective: every rank)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts: List[Tuple[str, List[str]]] = comm.allgather((host, network.local_addresses()))
    names = host_names(hosts)
    reply: Any = None
    if rank == 0:
        try:
            reply = _serve(hosts)
        except (OSError, ValueError) as e:
            reply = f"rank 0 cannot serve the rendezvous: {e}"
    reply = comm.bcast(reply, root=0)
    if isinstance(reply, str):
        raise ValueError(f"bagua_hvd: {reply}")
    addr, port, secret, job_id = reply
    local_rank, local_size, cross_rank, cross_size = placement(names, rank)
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "BAGUA_HVD_SECRET": secret,
        "BAGUA_HVD_JOB_ID": job_id,
        "HOROVOD_RANK": rank,
        "HOROVOD_SIZE": size,
        "HOROVOD_LOCAL_RANK": local_rank,
        "HOROVOD_LOCAL_SIZE": local_size,
        "HOROVOD_CROSS_RANK": cross_rank,
        "HOROVOD_CROSS_SIZE": cross_size,
        "HOROVOD_HOSTNAME": names[rank],
    }


def host_names(hosts: Sequence[Tuple[str, Sequence[str]]]) -> List[str]:
    """Each rank's host name, made distinct where one name covers machines with different
    addresses (containers or network namespaces that share a host name but not memory)."""
    kinds: dict = {}
    for name, addrs in hosts:
        kinds.setdefault(name, set()).add(tuple(addrs))
    return [
        name if len(kinds[name]) == 1 else f"{name}@{addrs[0] if addrs else 'no-address'}"
        for name, addrs in hosts
    ]


def placement(hostnames: Sequence[str], rank: int) -> Tuple[int, int, int, int]:
    """(local rank, local size, cross rank, cross size) of ``rank`` given every rank's host:
    local ranks count within a host in rank order; the cross rank is the index of the host
    among the hosts that have this local rank, hosts ordered by their first rank."""
    mine = hostnames[rank]
    local_rank = hostnames[:rank].count(mine)
    order = list(dict.fromkeys(hostnames))
    having = [h for h in order if hostnames.count(h) > local_rank]
    return local_rank, hostnames.count(mine), having.index(mine), len(having)


def _serve(hosts: List[Tuple[str, List[str]]]) -> Tuple[str, int, str, str]:
    """Rank 0: starts the store where every rank can reach it; (addr, port, secret, job)."""
    global _server
    from bagua_hvd.runner.store import StoreServer

    addr = _reachable_address(hosts)
    secret = secrets.token_bytes(32)
    server = StoreServer(secret, host=addr, port=0)
    server.start()
    _server = server
    return addr, server.port, secret.hex(), secrets.token_hex(8)


def _reachable_address(hosts: List[Tuple[str, List[str]]]) -> str:
    """Rank 0's address for the others: HOROVOD_GLOO_IFACE's when set; loopback when every rank
    is on this host; else the address its traffic to another host's leaves from."""
    iface = config.network_interface()
    if iface:
        addr = network.interface_address(iface)
        if addr is None:
            raise ValueError(f"HOROVOD_GLOO_IFACE={iface}: no IPv4 address on that interface")
        return addr
    names = host_names(hosts)
    other: Optional[List[str]] = next((a for (_, a), n in zip(hosts, names) if n != names[0]), None)
    if other is None:
        return "127.0.0.1"
    for candidate in other:
        try:
            return network.address_toward(candidate, 1)
        except (OSError, socket.gaierror):
            continue
    raise ValueError(
        f"no route from {hosts[0][0]} to the addresses of the other hosts ({other}); set "
        "HOROVOD_GLOO_IFACE to the interface they share"
    )
