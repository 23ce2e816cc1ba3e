"""``bagua-run``: horovodrun's command line for bagua_hvd, and the job starts (one node, hosts over
ssh, elastic) that ``bagua_hvd.run`` shares. Run as ``bagua-run`` or ``python -m
bagua_hvd.runner.launch`` (launch.py: the names Horovod's ``horovod.runner.launch`` has).

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
import ipaddress
import os
import secrets
import shlex
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import bagua_hvd.runner.slurm as slurm
from bagua_hvd.runner.flags import (
    ConfigError,
    _positive_int,
    apply_config,
    load_config,
    make_parser,
    no_effect_warning,
    rank_env,
)
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
from bagua_hvd.runner.job import OUTPUT, JobResult, LaunchError, run_job

if TYPE_CHECKING:
    from bagua_hvd.rendezvous.store import StoreServer

# Called with the job's started rendezvous store before any rank starts (bagua_hvd.run puts its
# function there); the store's values stay readable after the job (StoreServer.stop keeps them).
StoreHook = Callable[["StoreServer"], None]

MIN_SECRET_BYTES = 16


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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and checks the command line (exits with status 2 and a message on bad input)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.config_file is not None:
        try:
            apply_config(args, load_config(args.config_file), args.config_file)
        except ConfigError as e:
            parser.error(str(e))
    if args.check_build:
        return args
    args.elastic = args.min_num_proc is not None or args.host_discovery_script is not None
    if args.jsrun:
        _check_jsrun_args(parser, args)
        return args
    if args.elastic:
        _check_elastic_args(parser, args)
        return args
    if args.mpi and args.num_nodes > 1:
        parser.error("--mpi starts every node's ranks from here: drop --num-nodes")
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if not args.command:
        parser.error("no command given: expected e.g. `bagua-run -np 2 python train.py`")
    if args.start_timeout is None:
        args.start_timeout = _default_start_timeout()
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


def _check_jsrun_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--jsrun: jsrun places -np ranks on the hosts given (-H/--hostfile), one GPU each."""
    if args.elastic:
        parser.error("--jsrun cannot be combined with an elastic job (--min-np, discovery)")
    if args.num_nodes > 1:
        parser.error("--jsrun starts every host's ranks from here: drop --num-nodes")
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if not args.command:
        parser.error("no command given: expected e.g. `bagua-run --jsrun -np 2 python train.py`")
    if args.hosts is None and args.hostfile is None:
        parser.error(
            "--jsrun needs the LSF allocation's compute hosts and their GPUs: -H host1:GPUS,"
            "host2:GPUS or --hostfile"
        )
    try:
        args.host_entries = (
            parse_hostfile(args.hostfile) if args.hostfile is not None else parse_hosts(args.hosts)
        )
        assign_slots(args.host_entries, args.num_proc)
    except (HostError, ValueError) as e:
        parser.error(str(e))


def _check_elastic_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """horovodrun's elastic flags, checked here where Horovod fails late or not at all."""
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if not args.command:
        parser.error("no command given: expected e.g. `bagua-run -np 2 --min-np 1 python train.py`")
    for flag, value in (("--mpi", args.mpi), ("--num-nodes", args.num_nodes > 1)):
        if value:
            parser.error(
                f"{flag} cannot be combined with an elastic job (--min-np or "
                "--host-discovery-script): the elastic driver starts and replaces every "
                "worker itself, over ssh"
            )
    try:
        check_elastic_settings(args)
    except (HostError, ValueError) as e:
        parser.error(str(e))


def check_elastic_settings(args: argparse.Namespace) -> None:
    """Checks and completes the settings of an elastic job (bagua-run's flags, or
    bagua_hvd.run's arguments under the flags' names): min_num_proc defaults to num_proc,
    host_entries gets the fixed hosts (None with a discovery script), start_timeout its
    default. Raises ValueError (HostError for the hosts) naming the flag."""
    from bagua_hvd.runner.elastic.hosts import check_cooldown_range

    if args.min_num_proc is None:
        args.min_num_proc = args.num_proc
    for flag, value in (("-np", args.num_proc), ("--min-np", args.min_num_proc),
                        ("--max-np", args.max_num_proc), ("--slots-per-host", args.slots)):  # fmt: skip
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.min_num_proc > args.num_proc:
        raise ValueError(f"--min-np {args.min_num_proc} is more than -np {args.num_proc}")
    if args.max_num_proc is not None and args.max_num_proc < args.num_proc:
        raise ValueError(f"--max-np {args.max_num_proc} is less than -np {args.num_proc}")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise ValueError(f"--reset-limit must be >= 0, got {args.reset_limit}")
    if args.elastic_timeout is not None and args.elastic_timeout < 0:
        raise ValueError(f"--elastic-timeout must be >= 0 seconds, got {args.elastic_timeout}")
    if args.cooldown_range is not None:
        check_cooldown_range(tuple(args.cooldown_range))
    args.host_entries = None
    if args.host_discovery_script is None:
        if args.hostfile is not None:
            args.host_entries = parse_hostfile(args.hostfile)
        elif args.hosts is not None:
            args.host_entries = parse_hosts(args.hosts)
        else:
            args.host_entries = [("localhost", args.num_proc)]
        if len(args.host_entries) < 2:
            raise ValueError("Cannot run in fault tolerance mode with fewer than 2 hosts.")
    if args.start_timeout is None:
        args.start_timeout = _default_start_timeout()


def run_elastic(args: argparse.Namespace) -> int:
    """Runs an elastic job (bagua_hvd.runner.elastic.driver); returns the exit status."""
    extra_env = rank_env(args)
    try:
        result = elastic_driver(args, args.command, extra_env).run()
    except (LaunchError, HostError, RuntimeError, ValueError) as e:
        print(f"bagua-run: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code if isinstance(e, LaunchError) else 1
    if result.message:
        print(result.message, end="" if result.message.endswith("\n") else "\n",
              file=sys.stderr, flush=True)  # fmt: skip
    return result.exit_code


def elastic_driver(
    args: argparse.Namespace,
    command: Sequence[str],
    extra_env: Dict[str, str],
    on_store: Optional[Callable[[Any], None]] = None,
) -> Any:
    """The driver of an elastic job of ``command`` with the settings that
    :func:`check_elastic_settings` completed (``on_store``: called with the job's store before
    the first worker starts)."""
    from bagua_hvd.runner.elastic.discovery import FixedHosts, HostDiscoveryScript
    from bagua_hvd.runner.elastic.driver import ElasticDriver, ElasticSettings

    if args.host_discovery_script is not None:
        discovery = HostDiscoveryScript(args.host_discovery_script, args.slots)
    else:
        discovery = FixedHosts(dict(args.host_entries))
    settings = ElasticSettings(
        num_proc=args.num_proc,
        min_num_proc=args.min_num_proc,
        max_num_proc=args.max_num_proc,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        cooldown_range=tuple(args.cooldown_range) if args.cooldown_range else None,
        ssh_port=args.ssh_port,
        ssh_identity=args.ssh_identity_file,
        start_timeout=args.start_timeout,
        output_dir=args.output_filename,
        verbose=args.verbose,
        nic=extra_env.get("HOROVOD_GLOO_IFACE"),
    )
    return ElasticDriver(command, settings, discovery, extra_env, on_store=on_store)


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
    from bagua_hvd.rendezvous.store import StoreServer

    return StoreServer


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Where node 0 of a multi-node launch publishes the job id for the other nodes.
JOB_ID_KEY = "bagua-run/job_id"


def wait_for_rendezvous(host: str, port: int, secret: bytes, timeout_s: float) -> str:
    """Waits until node 0's rendezvous server accepts this node's secret (LaunchError after
    timeout_s, or at once when the server rejects the secret); returns the job id node 0
    published there (JOB_ID_KEY)."""
    from bagua_hvd.rendezvous.store import AuthenticationError, StoreClient, StoreError

    try:
        client = StoreClient(host, port, secret, timeout=timeout_s)
        try:
            return client.get(JOB_ID_KEY).decode("ascii")
        finally:
            client.close()
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
        # Made up by node 0 and read from its store by the others once authenticated: the job
        # id travels in cleartext (peer HELLOs), so nothing secret may go into it.
        job_id = secrets.token_hex(8) if node_rank == 0 else ""
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
                    f"the rendezvous server (bagua_hvd.rendezvous.store) cannot be imported: {e}"
                ) from e
            try:
                candidate = server_class(secret, host=bind_host, port=port)
                candidate.start()
            except OSError as e:
                raise LaunchError(f"cannot serve the rendezvous on {bind_host}:{port}: {e}") from e
            server = candidate
            port = server.port
            server.set(JOB_ID_KEY, job_id)
            if on_store is not None:
                on_store(server)
        else:
            addr, port = rendezvous
            job_id = wait_for_rendezvous(addr, port, secret, start_timeout)
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
    import bagua_hvd.runner.ssh as ssh

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


def main(argv: Optional[Sequence[str]] = None, _extra_env: Optional[Dict[str, str]] = None) -> int:
    """Runs bagua-run with ``argv`` (default sys.argv[1:]) and returns its exit status
    (``_extra_env``: more variables for the ranks, from gloo_run / mpi_run)."""
    args = parse_args(argv)
    if args.check_build:
        from bagua_hvd.runner.check_build import check_build_text

        print(check_build_text(), end="")
        return 0
    warning = no_effect_warning(args)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    OUTPUT.timestamp = args.prefix_output_with_timestamp
    if args.elastic:
        return run_elastic(args)
    common = dict(
        start_timeout=args.start_timeout,
        extra_env=dict(_extra_env or {}, **rank_env(args)),
        output_dir=args.output_filename,
        verbose=args.verbose,
    )
    try:
        if args.jsrun:
            from bagua_hvd.runner.js_run import run_jsrun

            return run_jsrun(
                args.command,
                args.num_proc,
                args.host_entries,
                common["extra_env"],
                mpi_args=args.mpi_args or "",
                binding_args=args.binding_args or "",
                output_filename=args.output_filename or "",
                tcp=args.tcp_flag,
                verbose=args.verbose,
            )
        if args.mpi:
            from bagua_hvd.runner.mpi import run_mpi

            return run_mpi(
                args.command,
                args.num_proc,
                args.host_entries,
                common["extra_env"],
                args.mpi_args or "",
                args.verbose,
                binding_args=args.binding_args or "",
                timestamp=args.prefix_output_with_timestamp,
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
