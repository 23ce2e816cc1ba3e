"""``bagua-run``: horovodrun's command line for bagua_hvd (``python -m bagua_hvd.runner.launch``).

One node::

    bagua-run -np 4 [-H localhost:4] python train.py

Several hosts, over ssh, as horovodrun (bagua_hvd.runner.ssh; ranks fill the hosts in order)::

    bagua-run -np 8 -H host1:4,host2:4 [-p PORT] [-i KEY] python train.py
    bagua-run -np 8 --hostfile FILE python train.py        # lines "host1 slots=4"

Or one launcher per node, without ssh (node 0 serves the rendezvous on ADDR:PORT; every node needs
the same ``BAGUA_HVD_SECRET``, e.g. from ``python -c "import secrets; print(secrets.token_hex(32))"``)::

    bagua-run -np 8 --num-nodes 2 --node-rank I --rendezvous-addr ADDR:PORT python train.py

Exit status: 0 when every rank succeeded; otherwise the exit code of the first rank that failed
(128 + N for a rank killed by signal N), 128 + N when the launcher got signal N, 1 for launcher
errors (127/126 when the command cannot be found/executed) and 2 for usage errors. See
``bagua_hvd.runner.job`` for how ranks are started, their output forwarded and failures handled.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import os
import secrets
import shlex
import sys
from typing import TYPE_CHECKING, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from bagua_hvd import __version__
from bagua_hvd.runner import slurm
from bagua_hvd.runner.hosts import (
    HostError,
    assign_slots,
    is_local_host,
    local_slots,
    only_this_machine,
    parse_hostfile,
    parse_hosts,
    place_ranks,
)
from bagua_hvd.runner.job import JobResult, LaunchError, run_job

if TYPE_CHECKING:
    from bagua_hvd.runner.store import StoreServer

# Called with the job's started rendezvous store before any rank starts (bagua_hvd.run puts its
# function there); the store's values stay readable after the job (StoreServer.stop keeps them).
StoreHook = Callable[["StoreServer"], None]

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
TRANSPORTS = ("auto", "shm", "tcp")
MIN_SECRET_BYTES = 16


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535, got {value}")
    return value


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(LOG_LEVELS)})"
        )
    return level


def _default_start_timeout() -> int:
    text = os.environ.get("HOROVOD_START_TIMEOUT")
    if not text:
        return 30
    try:
        return _positive_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise SystemExit(
            f"bagua-run: error: HOROVOD_START_TIMEOUT must be a positive integer "
            f"number of seconds, got {text!r}"
        ) from None


def make_parser() -> argparse.ArgumentParser:
    """The argument parser (unknown flags are errors; the command starts at the first word)."""
    parser = argparse.ArgumentParser(
        prog="bagua-run",
        allow_abbrev=False,
        description="Launch a bagua_hvd (Horovod-compatible) job: runs COMMAND once per rank.",
    )
    parser.add_argument(
        "-v",
        "--version",
        action="version",
        version=__version__,
        help="print the bagua_hvd version and exit",
    )
    parser.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=_positive_int,
        help="total number of ranks (processes) of the job",
    )
    parser.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="show the frameworks, controllers, transports and GPU support "
        "this installation has, and exit",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        help="host list HOST1:SLOTS,HOST2:SLOTS (default localhost:NP); other hosts are "
        "started over ssh, ranks fill the hosts in the order given",
    )
    hosts.add_argument(
        "-hostfile",
        "--hostfile",
        metavar="FILE",
        help="file with one 'HOST slots=N' per line, instead of -H",
    )
    parser.add_argument(
        "-p", "--ssh-port", type=_port, help="ssh port of the other hosts (default: ssh's)"
    )
    parser.add_argument(
        "-i",
        "--ssh-identity-file",
        metavar="FILE",
        help="ssh private key for the other hosts (default: ssh's)",
    )
    parser.add_argument(
        "--start-timeout",
        type=_positive_int,
        default=None,
        help="seconds to wait for the job to start (the rendezvous server of "
        "node 0); default 30 or HOROVOD_START_TIMEOUT",
    )
    parser.add_argument("--verbose", action="store_true", help="log what the launcher does")
    parser.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each rank's output to DIR/rank.<rank>/stdout|stderr",
    )
    parser.add_argument(
        "--disable-cache",
        action="store_true",
        help="accepted for horovodrun compatibility (nothing is cached)",
    )

    tuning = parser.add_argument_group("tuning (environment variables of the ranks)")
    tuning.add_argument(
        "--fusion-threshold-mb",
        type=_non_negative_int,
        help="tensor fusion buffer in MB, 0 disables fusion "
        "(HOROVOD_FUSION_THRESHOLD; default 128)",
    )
    tuning.add_argument(
        "--cycle-time-ms",
        type=_non_negative_float,
        help="fusion cycle time in ms (HOROVOD_CYCLE_TIME; default 1)",
    )
    tuning.add_argument(
        "--cache-capacity",
        type=_non_negative_int,
        help="response cache entries, 0 disables it (HOROVOD_CACHE_CAPACITY; default 1024)",
    )
    tuning.add_argument(
        "--hierarchical-allreduce",
        dest="hierarchical_allreduce",
        action="store_true",
        default=None,
        help="allreduce within each host, among one rank per host, then within the host "
        "again (HOROVOD_HIERARCHICAL_ALLREDUCE=1; no effect on one host)",
    )
    tuning.add_argument(
        "--no-hierarchical-allreduce",
        dest="hierarchical_allreduce",
        action="store_false",
        help="a flat allreduce over all ranks (HOROVOD_HIERARCHICAL_ALLREDUCE=0, the default)",
    )
    tuning.add_argument(
        "--log-level",
        type=_log_level,
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="core log level (HOROVOD_LOG_LEVEL; default WARNING)",
    )
    tuning.add_argument(
        "--gloo-timeout-seconds",
        type=_positive_int,
        help="timeout of rendezvous and connection set-up "
        "(HOROVOD_GLOO_TIMEOUT_SECONDS; default 30)",
    )
    tuning.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="auto: shared memory within a host, TCP between hosts; tcp: TCP "
        "everywhere (BAGUA_HVD_TRANSPORT)",
    )
    tuning.add_argument(
        "--algorithm",
        choices=ALGORITHM_NAMES,
        help="one of BAGUA's algorithms, with default arguments, for every "
        "DistributedOptimizer built without algorithm= (BAGUA_HVD_ALGORITHM; "
        "docs/algorithms.md)",
    )
    tuning.add_argument(
        "--network-interfaces",
        metavar="NICS",
        help="comma-separated interfaces for TCP traffic; the first one is used "
        "(HOROVOD_GLOO_IFACE, NCCL_SOCKET_IFNAME)",
    )
    tuning.add_argument(
        "--network-interface",
        dest="network_interface",
        action="append",
        metavar="NIC",
        help="deprecated form of --network-interfaces (repeatable)",
    )

    controller = parser.add_argument_group("controller")
    controller.add_argument(
        "--gloo", action="store_true", help="bagua-run starts the ranks itself (the default)"
    )
    controller.add_argument(
        "--mpi",
        action="store_true",
        help="start the ranks with the system's mpirun (Open MPI or MPICH); each rank joins "
        "the job through MPI (needs mpi4py)",
    )
    controller.add_argument(
        "--mpi-args", metavar="ARGS", help="extra arguments for mpirun (with --mpi), as one string"
    )
    controller.add_argument("--jsrun", action="store_true", help=argparse.SUPPRESS)

    nodes = parser.add_argument_group("several nodes (one bagua-run per node)")
    nodes.add_argument(
        "--num-nodes",
        type=_positive_int,
        default=1,
        help="number of nodes, each running -np/num-nodes ranks (default 1)",
    )
    nodes.add_argument(
        "--node-rank",
        type=_non_negative_int,
        default=0,
        help="index of this node, 0..num-nodes-1 (node 0 serves the rendezvous)",
    )
    nodes.add_argument(
        "--rendezvous-addr",
        metavar="ADDR:PORT",
        help="address of node 0's rendezvous server (required with --num-nodes "
        "> 1; node 0 listens on PORT)",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the command each rank runs, e.g. python train.py"
    )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and checks the command line (exits with status 2 and a message on bad input)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.check_build:
        return args
    if args.jsrun:
        parser.error(
            "bagua_hvd has no jsrun (LSF) launch mode: use --mpi, or bagua-run's own launch "
            "with -H/--hostfile"
        )
    if args.mpi and args.gloo:
        parser.error("--gloo and --mpi cannot be combined: choose one way to start the ranks")
    if args.mpi_args is not None and not args.mpi:
        parser.error("--mpi-args needs --mpi")
    if args.mpi and args.num_nodes > 1:
        parser.error("--mpi starts every node's ranks from here: drop --num-nodes")
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if not args.command:
        parser.error("no command given: expected e.g. `bagua-run -np 2 python train.py`")
    if args.start_timeout is None:
        args.start_timeout = _default_start_timeout()
    if args.network_interface and not args.network_interfaces:
        args.network_interfaces = ",".join(args.network_interface)
    if args.num_nodes > 1:
        if args.hosts is not None or args.hostfile is not None:
            parser.error(
                "-H/--hosts (or --hostfile) and --num-nodes > 1 cannot be combined: with "
                "--num-nodes each node's bagua-run starts its own -np/--num-nodes ranks"
            )
        if args.rendezvous_addr is None:
            parser.error(
                "--num-nodes > 1 needs --rendezvous-addr ADDR:PORT (node 0's address "
                "and a free port on it)"
            )
    try:
        place_ranks(args.num_proc, args.num_nodes, args.node_rank)
        args.host_entries = None
        if args.hostfile is not None:
            args.host_entries = parse_hostfile(args.hostfile)
        elif args.hosts is not None:
            args.host_entries = parse_hosts(args.hosts)
        elif args.num_nodes == 1:
            args.host_entries = slurm.allocation()  # inside a Slurm allocation: its nodes
        if args.host_entries is not None and not only_this_machine(args.host_entries):
            assign_slots(args.host_entries, args.num_proc)
        elif args.num_nodes == 1:
            local_slots(args.num_proc, args.hosts)
        if args.rendezvous_addr is not None:
            args.rendezvous = parse_rendezvous_addr(args.rendezvous_addr)
        else:
            args.rendezvous = None
    except (HostError, ValueError) as e:
        parser.error(str(e))
    return args


def parse_rendezvous_addr(text: str) -> Tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); the port must be given (1..65535)."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ValueError(f"--rendezvous-addr {text!r} must be HOST:PORT, e.g. 10.0.0.1:29500")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--rendezvous-addr {text!r}: bad port {port_text!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"--rendezvous-addr {text!r}: port must be in 1..65535")
    return host, port


# bagua_hvd.torch.algorithms.from_name's names (QAdam needs its own optimizer: code only). Kept
# here so that the launcher does not import torch.
ALGORITHM_NAMES = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "async",
)


def tuning_env(args: argparse.Namespace) -> Dict[str, str]:
    """The environment variables set by tuning flags (only those given)."""
    env: Dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(args.fusion_threshold_mb * 1024 * 1024)
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
    if args.cache_capacity is not None:
        env["HOROVOD_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.log_level is not None:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    if args.hierarchical_allreduce is not None:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1" if args.hierarchical_allreduce else "0"
    if args.gloo_timeout_seconds is not None:
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(args.gloo_timeout_seconds)
    if args.transport is not None:
        env["BAGUA_HVD_TRANSPORT"] = args.transport
    if args.algorithm is not None:
        env["BAGUA_HVD_ALGORITHM"] = args.algorithm
    if args.network_interfaces:
        nics = [n.strip() for n in args.network_interfaces.split(",") if n.strip()]
        if nics:
            env["HOROVOD_GLOO_IFACE"] = nics[0]
            env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    return env


def job_env(secret: bytes, job_id: str, addr: str, port: int) -> Dict[str, str]:
    """The per-job part of the launcher -> worker contract (docs/design-core.md)."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "BAGUA_HVD_SECRET": secret.hex(),
        "BAGUA_HVD_JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",
    }


def shared_secret() -> bytes:
    """The secret of a several-node job, from BAGUA_HVD_SECRET (hex), with a clear error."""
    text = os.environ.get("BAGUA_HVD_SECRET", "").strip()
    hint = (
        "set the same secret on every node, e.g. "
        "export BAGUA_HVD_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')"
    )
    if not text:
        raise LaunchError(f"--num-nodes > 1 needs BAGUA_HVD_SECRET in the environment: {hint}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise LaunchError(f"BAGUA_HVD_SECRET is not hex: {hint}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise LaunchError(
            f"BAGUA_HVD_SECRET has {len(secret)} bytes, at least "
            f"{MIN_SECRET_BYTES} are needed: {hint}"
        )
    return secret


def _store_server_class():
    # Imported lazily: --version/--check-build and argument errors need no server.
    from bagua_hvd.runner.store import StoreServer

    return StoreServer


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def wait_for_rendezvous(host: str, port: int, secret: bytes, timeout_s: float) -> None:
    """Waits until node 0's rendezvous server accepts this node's secret (LaunchError after
    timeout_s, or at once when the server rejects the secret)."""
    from bagua_hvd.runner.store import AuthenticationError, StoreClient, StoreError

    try:
        StoreClient(host, port, secret, timeout=timeout_s).close()
    except AuthenticationError as e:
        raise LaunchError(
            f"node 0's rendezvous server at {host}:{port} rejected this node's "
            f"BAGUA_HVD_SECRET ({e}); every node needs the same secret"
        ) from e
    except (StoreError, OSError) as e:
        raise LaunchError(
            f"could not reach the rendezvous server at {host}:{port} within {timeout_s:g} s "
            f"({e}); start node 0's bagua-run (it serves the rendezvous) or raise "
            "--start-timeout"
        ) from e


def launch(
    command: Sequence[str],
    np: int,
    *,
    hosts: Optional[str] = None,
    num_nodes: int = 1,
    node_rank: int = 0,
    rendezvous: Optional[Tuple[str, int]] = None,
    start_timeout: float = 30,
    extra_env: Optional[Dict[str, str]] = None,
    output_dir: Optional[str] = None,
    verbose: bool = False,
    cwd: Optional[str] = None,
    on_store: Optional[StoreHook] = None,
) -> JobResult:
    """Runs this node's share of an ``np``-rank job of ``command`` (see the module docstring).

    Serves the rendezvous store when this is node 0 (``on_store`` is called with it), and returns
    once every local rank is gone. Raises LaunchError (or HostError, a ValueError) when the job
    cannot start.
    """
    slots = place_ranks(np, num_nodes, node_rank)
    if num_nodes == 1:
        local_slots(np, hosts)
        secret = secrets.token_bytes(32)
        job_id = secrets.token_hex(8)
    else:
        if rendezvous is None:
            raise LaunchError("--num-nodes > 1 needs --rendezvous-addr ADDR:PORT")
        secret = shared_secret()
        # Equal on every node without talking: derived from what all nodes share.
        job_id = hashlib.sha256(
            b"bagua_hvd-job\0" + secret + f"{rendezvous[0]}:{rendezvous[1]}".encode()
        ).hexdigest()[:16]
    server = None
    try:
        if node_rank == 0:
            if rendezvous is None:
                bind_host, port, addr = "127.0.0.1", 0, "127.0.0.1"
            else:
                addr, port = rendezvous
                bind_host = addr if _is_loopback(addr) else "0.0.0.0"
            try:
                server_class = _store_server_class()
            except ImportError as e:
                raise LaunchError(
                    f"the rendezvous server (bagua_hvd.runner.store) cannot be imported: {e}"
                ) from e
            try:
                candidate = server_class(secret, host=bind_host, port=port)
                candidate.start()
            except OSError as e:
                raise LaunchError(f"cannot serve the rendezvous on {bind_host}:{port}: {e}") from e
            server = candidate
            port = server.port
            if on_store is not None:
                on_store(server)
        else:
            addr, port = rendezvous
            wait_for_rendezvous(addr, port, secret, start_timeout)
        env = job_env(secret, job_id, addr, port)
        env.update(extra_env or {})
        if verbose:
            print(
                f"bagua-run: node {node_rank}/{num_nodes}: ranks {slots[0].rank}.."
                f"{slots[-1].rank} of {np}, rendezvous {addr}:{port}, job {job_id}: "
                f"{shlex.join(command)}",
                file=sys.stderr,
                flush=True,
            )
        return run_job(command, slots, env, output_dir=output_dir, verbose=verbose, cwd=cwd)
    finally:
        if server is not None:
            server.stop()


def launch_hosts(
    command: Sequence[str],
    np: int,
    entries: List[Tuple[str, int]],
    *,
    ssh_port: Optional[int] = None,
    ssh_identity: Optional[str] = None,
    start_timeout: float = 30,
    extra_env: Optional[Dict[str, str]] = None,
    output_dir: Optional[str] = None,
    verbose: bool = False,
    on_store: Optional[StoreHook] = None,
) -> JobResult:
    """Runs an ``np``-rank job over the hosts ``entries`` ((host, slots), in order): the
    rendezvous served here (``on_store`` is called with it), other hosts started over ssh
    (bagua_hvd.runner.ssh)."""
    from bagua_hvd.runner import ssh

    placement = assign_slots(entries, np)
    remote = [host for host, _ in placement if not is_local_host(host)]
    if remote:
        agents_env = dict(os.environ, **(extra_env or {}))  # their PYTHONPATH
        ssh.check_hosts(remote, ssh_port, ssh_identity, start_timeout, agents_env)
    nic = (extra_env or {}).get("HOROVOD_GLOO_IFACE")
    if nic:
        addr = ssh.interface_address(nic)
    elif remote:
        # What the other hosts reach us at; this host's ranks use it too, so that the address
        # their store connection leaves from (which they listen on) is one peers can reach.
        addr = ssh.address_toward(remote[0], ssh_port or 22)
    else:
        addr = "127.0.0.1"
    secret = secrets.token_bytes(32)
    job_id = secrets.token_hex(8)
    try:
        server = _store_server_class()(secret, host=addr, port=0)
        server.start()
    except OSError as e:
        raise LaunchError(f"cannot serve the rendezvous on {addr}: {e}") from e
    try:
        if on_store is not None:
            on_store(server)
        env = job_env(secret, job_id, addr, server.port)
        env.update(extra_env or {})
        if verbose:
            print(
                f"bagua-run: {np} ranks on {', '.join(h for h, _ in placement)}; rendezvous "
                f"{addr}:{server.port}, job {job_id}: {shlex.join(command)}",
                file=sys.stderr,
                flush=True,
            )
        return ssh.run_hosts(
            command,
            placement,
            env,
            ssh_port=ssh_port,
            ssh_identity=ssh_identity,
            start_timeout=start_timeout,
            output_dir=output_dir,
            verbose=verbose,
        )
    finally:
        server.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs bagua-run with ``argv`` (default sys.argv[1:]) and returns its exit status."""
    args = parse_args(argv)
    if args.check_build:
        from bagua_hvd.runner.check_build import check_build_text

        print(check_build_text(), end="")
        return 0
    common = dict(
        start_timeout=args.start_timeout,
        extra_env=tuning_env(args),
        output_dir=args.output_filename,
        verbose=args.verbose,
    )
    try:
        if args.mpi:
            from bagua_hvd.runner.mpi import run_mpi

            return run_mpi(
                args.command,
                args.num_proc,
                args.host_entries,
                common["extra_env"],
                args.mpi_args or "",
                args.verbose,
            )
        if args.host_entries is not None and not only_this_machine(args.host_entries):
            result = launch_hosts(
                args.command,
                args.num_proc,
                args.host_entries,
                ssh_port=args.ssh_port,
                ssh_identity=args.ssh_identity_file,
                **common,
            )
        else:
            result = launch(
                args.command,
                args.num_proc,
                hosts=args.hosts,
                num_nodes=args.num_nodes,
                node_rank=args.node_rank,
                rendezvous=args.rendezvous,
                **common,
            )
    except (LaunchError, HostError) as e:
        print(f"bagua-run: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code if isinstance(e, LaunchError) else 1
    if result.failed_rank is not None:
        print(result.failure_message(), end="", file=sys.stderr, flush=True)
    elif result.signal is not None:
        print(
            f"bagua-run: stopped all ranks after signal {result.signal}",
            file=sys.stderr,
            flush=True,
        )
    return result.exit_code


def run_commandline(argv: Optional[List[str]] = None) -> NoReturn:
    """Console entry point of ``bagua-run``."""
    sys.exit(main(argv))


if __name__ == "__main__":
    run_commandline()
