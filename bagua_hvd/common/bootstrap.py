"""Jobs started by mpirun (Open MPI, MPICH, Intel MPI) or srun, without bagua-run.

Without MPI, srun's tasks can still meet when they share ``BAGUA_HVD_SECRET`` (srun passes the
caller's environment on): task 0 serves the store on the step's first node at a port derived
from the job and step ids (:func:`slurm_port`). An srun task that has the secret takes that
path without touching MPI: an Open MPI built for Slurm (Debian's, for one) aborts the process in
``MPI_Init`` when srun started it without ``--mpi=pmix``, before any message of ours, and one
that does not only finds itself alone, after a second of start-up.

``hvd.init()`` calls :func:`prepare` first. A process that bagua-run started has the launcher's
contract in its environment and nothing happens here. A process that mpirun or srun started as one
of N > 1 has only their variables: it then forms the job through MPI itself (mpi4py), as
bagua-run would have: rank 0 serves the rendezvous store (a thread of its process, needed only
while the ranks connect) and broadcasts its address and a fresh secret over MPI_COMM_WORLD, and
every rank derives its local and cross ranks from the host names gathered over MPI. The core
then starts as under bagua-run, with its own transports (shared memory, TCP), or with Horovod's
collectives through MPI itself when ``HOROVOD_CPU_OPERATIONS=mpi``.

A process that sees another launcher's variables but cannot join the job raises
:data:`JOIN_ERROR` on every rank instead of running alone as a job of size 1 (which would
train N unrelated replicas, each believing it is rank 0).
"""

from __future__ import annotations

import secrets
import socket
import sys
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


def prepare(comm: Any = None) -> bool:
    """Sets up the launcher's contract when another launcher started this process (see the
    module docstring); ValueError with :data:`JOIN_ERROR` when it cannot.

    ``comm``: ``hvd.init(comm=...)`` under mpirun, an mpi4py communicator or a list of
    MPI_COMM_WORLD ranks: as Horovod's global communicator, the job is formed over those ranks
    only (job rank i is the communicator's rank i, or the list's i-th rank), and the other ranks
    are not part of it. Returns True when the job was formed over ``comm``."""
    if config.launched_by_bagua_run():
        return False
    found = config.foreign_launch()
    if found is None or found.size <= 1:
        return False

    def fail(why: str) -> ValueError:
        return ValueError(JOIN_ERROR.format(why=why, **found._asdict()))

    srun = found.launcher.startswith("srun")
    if srun and config.shared_secret() and comm is None:
        config.set_job(_slurm_job(found))
        return False
    try:
        _mpi_thread_level()
        from mpi4py import MPI
    except ImportError as e:
        MPI, why = None, f"mpi4py cannot be imported ({e})"
    if MPI is not None:
        world = MPI.COMM_WORLD
        if world.Get_size() == found.size and world.Get_rank() == found.rank:
            job = world if comm is None else _job_comm(MPI, comm)
            if job.Get_size() > 1:
                config.set_job(_form_job(job, MPI.Get_processor_name()))
            return comm is not None
        why = (
            f"MPI (mpi4py, {MPI.Get_library_version().split(',')[0].strip()}) sees rank "
            f"{world.Get_rank()} of {world.Get_size()}: "
            + (
                "srun did not start it (srun --mpi=pmix does, for an MPI built with PMIx)"
                if srun
                else "mpi4py is built for another MPI than the one that started the job"
            )
        )
    if srun:
        why += (
            "; without MPI, srun's tasks can also meet on their first node when they share "
            "a secret: export BAGUA_HVD_SECRET=$(python -c 'import secrets; "
            "print(secrets.token_hex(32))') before srun"
        )
    raise fail(why)


def _job_comm(MPI: Any, comm: Any) -> Any:  # noqa: N803 - the mpi4py module
    """The communicator ``init(comm=...)`` names: itself, or the group of the listed
    MPI_COMM_WORLD ranks in the order given (created by those ranks only)."""
    if isinstance(comm, MPI.Comm):
        return comm
    world = MPI.COMM_WORLD
    size, me = world.Get_size(), world.Get_rank()
    ranks = [int(r) for r in comm]
    bad = [r for r in ranks if not 0 <= r < size]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ValueError(
            f"init(comm={ranks}): comm must list distinct ranks of MPI_COMM_WORLD "
            f"(0..{size - 1}), at least one"
        )
    if me not in ranks:
        raise ValueError(
            f"init(comm={ranks}): this process is rank {me} of MPI_COMM_WORLD, which is not in "
            "comm: the job runs on the listed ranks only, and only they call hvd.init(comm=...)"
        )
    return world.Create_group(world.Get_group().Incl(ranks))


def _mpi_thread_level() -> None:
    """HOROVOD_MPI_THREADS_DISABLE=1, as Horovod: MPI is initialized with MPI_THREAD_SINGLE
    (only this thread calls MPI, to form the job), unless the core's background thread runs the
    collectives through MPI (HOROVOD_CPU_OPERATIONS=mpi; init() warns then). No effect once the
    script has imported mpi4py.MPI itself (MPI is initialized then)."""
    if config.flag("HOROVOD_MPI_THREADS_DISABLE") and config.cpu_operations() != "mpi":
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.thread_level = "single"


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
    jsm = config.jsm_placement()
    launched = config.foreign_launch()
    if jsm is not None and launched is not None and comm.Get_size() == launched.size:
        # Under LSF's jsrun, the job step manager knows each task's node: the host names MPI
        # reports must group the ranks the same way, or shared memory would join tasks of
        # different nodes (or miss tasks of one).
        if jsm != (local_rank, local_size):
            raise ValueError(
                f"bagua_hvd: jsrun (LSF) placed rank {rank} as task {jsm[0]} of {jsm[1]} on its "
                f"node (JSM_NAMESPACE_LOCAL_RANK/JSM_NAMESPACE_LOCAL_SIZE), but the host names "
                f"MPI reports make it local rank {local_rank} of {local_size} on {names[rank]}: "
                "each node needs a host name (MPI_Get_processor_name) of its own"
            )
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": config.cpu_operations(),
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


# srun without MPI: task 0 serves the store on its node at a port derived from the job and step
# ids (every task computes the same one), within [base, base + span).
SLURM_PORT_BASE = 21000
SLURM_PORT_SPAN = 8000


def slurm_port(job_id: int, step_id: int) -> int:
    return SLURM_PORT_BASE + (job_id * 97 + step_id) % SLURM_PORT_SPAN


def _slurm_job(found: Any) -> dict:
    """The launcher's variables of an srun task that has no MPI (the secret from the
    environment, shared through srun); task 0 serves the store on the step's first node."""
    from bagua_hvd.rendezvous.hostlist import expand_counts, expand_nodelist

    step = config.slurm_step()
    try:
        nodes = expand_nodelist(step["nodelist"])
        counts = expand_counts(step["tasks_per_node"])
        node, local = int(step["node_id"]), int(step["local_id"])
        port = slurm_port(int(step["job_id"] or 0), int(step["step_id"] or 0))
    except (ValueError, KeyError) as e:
        raise ValueError(f"bagua_hvd: srun's variables do not describe the job step: {e}") from e
    if len(counts) != len(nodes) or not 0 <= node < len(nodes):
        raise ValueError(
            f"bagua_hvd: srun's node list {step['nodelist']!r} and tasks per node "
            f"{step['tasks_per_node']!r} do not fit node index {node}"
        )
    first = nodes[0]
    if len(nodes) == 1:
        addr = "127.0.0.1"
    elif node == 0:
        # This node's name may resolve to loopback here: the address peers reach it at.
        try:
            addr = network.address_toward(nodes[1], 1)
        except OSError as e:
            raise ValueError(f"bagua_hvd: no route from {first} to node {nodes[1]}: {e}") from e
    else:
        addr = first
    secret = bytes.fromhex(config.shared_secret())
    if found.rank == 0:
        global _server
        from bagua_hvd.rendezvous.store import StoreServer

        try:
            server = StoreServer(secret, host="0.0.0.0" if len(nodes) > 1 else addr, port=port)
            server.start()
        except OSError as e:
            raise ValueError(
                f"bagua_hvd: task 0 cannot serve the rendezvous on {first} port {port} "
                f"(derived from the job and step ids): {e}"
            ) from e
        _server = server
    having = [n for n, c in zip(nodes, counts) if c > local]
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": config.cpu_operations(),
        "BAGUA_HVD_JOB_ID": f"slurm-{step['job_id']}-{step['step_id']}",
        "HOROVOD_RANK": found.rank,
        "HOROVOD_SIZE": found.size,
        "HOROVOD_LOCAL_RANK": local,
        "HOROVOD_LOCAL_SIZE": counts[node],
        "HOROVOD_CROSS_RANK": having.index(nodes[node]),
        "HOROVOD_CROSS_SIZE": len(having),
        "HOROVOD_HOSTNAME": nodes[node],
    }


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
    from bagua_hvd.rendezvous.store import StoreServer

    addr = _reachable_address(hosts)
    secret = secrets.token_bytes(32)
    server = StoreServer(secret, host=addr, port=0)
    server.start()
    _server = server
    return addr, server.port, secret.hex(), secrets.token_hex(8)


def _reachable_address(hosts: List[Tuple[str, List[str]]]) -> str:
    """Rank 0's address for the others: HOROVOD_GLOO_IFACE's when set; loopback when every rank
    is on this host; else the address its traffic to another host's leaves from."""
    addr = network.iface_address()
    if addr is not None:
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
