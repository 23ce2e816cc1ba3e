"""``bagua_hvd.run``: horovod.run's Python API (run a function on every rank, collect results)."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import bagua_hvd.runner.task as task
from bagua_hvd.runner.bagua_run import check_elastic_settings, elastic_driver, launch, launch_hosts
from bagua_hvd.runner.hosts import (
    assign_slots,
    only_this_machine,
    parse_hostfile,
    parse_hosts,
)

# The directory holding the bagua_hvd package this process uses; the ranks import the same one.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _resolve_num_proc(num_proc: Optional[int], np: Optional[int]) -> int:
    value = _either("num_proc", num_proc, "np", np)
    return 1 if value is None else value


def _start_timeout(value: Optional[float]) -> float:
    """``start_timeout``, else HOROVOD_START_TIMEOUT, else 30 seconds (horovod.run's order)."""
    if value is None:
        text = os.environ.get("HOROVOD_START_TIMEOUT", "").strip()
        if not text:
            return 30.0
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        what = f"HOROVOD_START_TIMEOUT={text!r}"
    else:
        what = f"start_timeout={value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what}: the start timeout must be a positive number of seconds")
    return float(value)


def _host_entries(n: int, hosts: Optional[str], hostfile: Optional[str]) -> List[Tuple[str, int]]:
    """The (host, slots) list: from ``hosts``, else ``hostfile``, else ``localhost:n``."""
    if hosts is not None and hostfile is not None:
        raise ValueError("bagua_hvd.run: pass hosts or hostfile, not both")
    if hosts is not None:
        if not isinstance(hosts, str):
            raise TypeError(f"hosts must be a string 'host1:2,host2:2', got {hosts!r}")
        return parse_hosts(hosts)
    if hostfile is not None:
        return parse_hostfile(os.fspath(hostfile))
    return [("localhost", n)]


def _either(
    name: str, value: Optional[int], old_name: str, old_value: Optional[int]
) -> Optional[int]:
    """One of horovod.run's two spellings of a process count (num_proc / np, min_num_proc /
    min_np, ...): an int >= 1, or None when neither is given."""
    if value is not None and old_value is not None and value != old_value:
        raise ValueError(
            f"{name}={value} and {old_name}={old_value} disagree; pass only one of them"
        )
    chosen = value if value is not None else old_value
    if chosen is not None and (not _is_int(chosen) or chosen < 1):
        raise ValueError(f"{name} must be an int >= 1, got {chosen!r}")
    return chosen


def _outcome(store: Any, rank: int) -> Optional[tuple]:
    """Rank ``rank``'s outcome in the job's store (task.py), or None."""
    try:
        return task.read_outcome(store, rank)
    except Exception as e:
        raise RuntimeError(
            f"bagua_hvd.run: the result of rank {rank} cannot be unpickled here: {e}"
        ) from e


def _run_elastic(
    settings: argparse.Namespace,
    command: List[str],
    env: Dict[str, str],
    seed: Callable[[Any], None],
    stores: List[Any],
) -> List[Any]:
    """An elastic job of the function (bagua-run's elastic driver); Horovod's results: those
    of ranks 0 .. min_num_proc - 1 of the job as it ended."""
    result = elastic_driver(settings, command, env, on_store=seed).run()
    if result.exit_code != 0:
        detail = ""
        for rank in range(settings.max_num_proc or settings.num_proc):
            failure = _outcome(stores[0], rank) if stores else None
            if failure is not None and failure[0] == "error":
                detail = f"\nrank {rank} failed:\n{failure[1]}"
                break
        raise RuntimeError(f"bagua_hvd.run: the elastic job failed: {result.message}{detail}")
    results = []
    for rank in range(settings.min_num_proc):
        outcome = _outcome(stores[0], rank) if stores else None
        if outcome is None or outcome[0] != "ok":
            raise RuntimeError(f"bagua_hvd.run: rank {rank} of the job as it ended left no result")
        results.append(outcome[1])
    return results


def _run_mpi(
    payload: bytes,
    command: List[str],
    n: int,
    entries: List[Tuple[str, int]],
    env: Dict[str, str],
    mpi_args: str,
    verbose: bool,
) -> List[Any]:
    """``use_mpi=True``: the ranks are started by the system's mpirun (as ``bagua-run --mpi``;
    ``mpi_args`` passed on) and form the job through MPI at ``hvd.init()``; this process serves
    a store of its own for the function and the results (task.RUN_STORE_ENV), under a fresh
    secret that reaches the ranks through mpirun's environment, never its command line."""
    from bagua_hvd.common import network
    from bagua_hvd.rendezvous.store import StoreServer
    from bagua_hvd.runner.job import LaunchError
    from bagua_hvd.runner.mpi import run_mpi

    if only_this_machine(entries):
        bind, addr = "127.0.0.1", "127.0.0.1"
    else:
        remote = next(h for h, _ in entries if not only_this_machine([(h, 1)]))
        try:
            bind, addr = "0.0.0.0", network.address_toward(remote, 1)
        except OSError as e:
            raise RuntimeError(f"bagua_hvd.run: no route from here to {remote}: {e}") from None
    secret = secrets.token_bytes(32)
    server = StoreServer(secret, host=bind, port=0)
    server.start()
    try:
        task.put_blob(server, task.FUNC_KEY, payload)
        env = dict(env)
        env[task.RUN_STORE_ENV] = f"{addr}:{server.port}"
        env[task.RUN_SECRET_ENV] = secret.hex()
        try:
            code = run_mpi(command, n, entries, env, mpi_args, verbose)
        except LaunchError as e:
            raise RuntimeError(f"bagua_hvd.run: {e}") from None
        outcomes = [_outcome(server, rank) for rank in range(n)]
    finally:
        server.stop()
    for rank, outcome in enumerate(outcomes):
        if outcome is not None and outcome[0] == "error":
            raise RuntimeError(f"bagua_hvd.run: rank {rank} failed:\n{outcome[1]}")
    if code != 0:
        raise RuntimeError(f"bagua_hvd.run: mpirun exited with status {code}")
    missing = [rank for rank, o in enumerate(outcomes) if o is None]
    if missing:
        raise RuntimeError(f"bagua_hvd.run: ranks {missing} exited under mpirun but left no result")
    return [o[1] for o in outcomes]


def _nics(
    network_interface: Optional[str], network_interfaces: Union[None, str, Sequence[str]]
) -> List[str]:
    nics: List[str] = []
    for value in (network_interfaces, network_interface):
        if value is None:
            continue
        items = value.split(",") if isinstance(value, str) else list(value)
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"network interfaces must be strings, got {item!r}")
            if item.strip() and item.strip() not in nics:
                nics.append(item.strip())
    return nics


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    num_proc: Optional[int] = None,
    min_num_proc: Optional[int] = None,
    max_num_proc: Optional[int] = None,
    slots: Optional[int] = None,
    reset_limit: Optional[int] = None,
    cooldown_range: Optional[Sequence[int]] = None,
    hosts: Optional[str] = None,
    hostfile: Optional[str] = None,
    host_discovery_script: Optional[str] = None,
    start_timeout: Optional[float] = None,
    ssh_port: Optional[int] = None,
    ssh_identity_file: Optional[str] = None,
    disable_cache: Optional[bool] = None,
    output_filename: Optional[str] = None,
    verbose: Optional[Union[bool, int]] = None,
    use_gloo: Optional[bool] = None,
    use_mpi: Optional[bool] = None,
    mpi_args: Optional[str] = None,
    network_interface: Optional[str] = None,
    network_interfaces: Union[None, str, Sequence[str]] = None,
    executable: Optional[str] = None,
    np: Optional[int] = None,
    min_np: Optional[int] = None,
    max_np: Optional[int] = None,
    _env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Runs ``func(*args, **kwargs)`` on every rank of a new job; returns the results by rank.

    horovod.run's signature and semantics. Each rank is a fresh ``executable -m
    bagua_hvd.runner.task`` process started as ``bagua-run`` starts its ranks (same placement,
    environment, output prefixes and failure handling), on this machine or, for other hosts, over
    ssh as ``bagua-run -H`` does; so ``func`` may call ``hvd.init()``. ``func``, ``args`` and
    ``kwargs`` are sent to the ranks with cloudpickle, and the results come back the same way,
    through the job's rendezvous store (authenticated with the job's secret, which never appears
    on a command line): no directory shared between hosts is needed.

    Args:
        func: the function each rank runs; it and its return value must be picklable with
            cloudpickle.
        args: positional arguments of ``func`` (default ``()``).
        kwargs: keyword arguments of ``func`` (default none).
        num_proc: the number of ranks (default 1). ``np`` is its older name; pass one of them.
        hosts: ``"host1:slots,host2:slots"`` (slots default to 1); ranks fill the hosts in the
            order given. Default ``localhost:<num_proc>``. Hosts other than this machine are
            reached over ssh and must run the same Python (``sys.executable``) with bagua_hvd.
        hostfile: a file of ``host slots=N`` lines, instead of ``hosts``.
        start_timeout: seconds for the ssh checks of the hosts and for the job to start
            (default ``HOROVOD_START_TIMEOUT``, else 30).
        ssh_port: ssh port of the other hosts (default: ssh's own, usually 22).
        ssh_identity_file: ssh private key for the other hosts (default: ssh's own).
        disable_cache: accepted; nothing is cached (the hosts are checked on every call).
        output_filename: a directory on this machine that also receives every rank's output in
            ``rank.<rank>/stdout`` and ``rank.<rank>/stderr`` (ranks zero-padded).
        verbose: print what the launcher does (default off).
        use_gloo: run the ranks with bagua_hvd's own launcher and controller (Horovod's Gloo
            mode). Default None.
        use_mpi: run the ranks with the system's mpirun (Open MPI or MPICH, as ``bagua-run
            --mpi``); each rank's ``hvd.init()`` forms the job through MPI (needs mpi4py).
            Default None. With neither ``use_gloo`` nor ``use_mpi`` True, bagua_hvd chooses:
            its own launcher (Horovod chooses MPI when it was built with it; bagua_hvd's own
            launcher needs nothing more). Both True: ValueError, as Horovod.
        mpi_args: extra arguments for mpirun, one string (e.g. ``"--bind-to none"``); used
            only with ``use_mpi=True``, as Horovod.
        network_interface: comma-separated network interfaces for the job's TCP traffic (the
            first one is used; ``network_interfaces`` may also be a list); default: the
            address this machine reaches the other hosts from.
        executable: the interpreter of the ranks (default ``sys.executable``).

        min_num_proc: with it (or ``host_discovery_script``) the job is elastic, as
            ``bagua-run --min-np`` makes it (docs/elastic.md): ``func`` uses
            ``hvd.elastic.run``, workers that fail are replaced or dropped down to this many
            ranks (default ``num_proc``). ``min_np`` is its older name.
        max_num_proc: elastic: at most this many ranks as hosts appear (default: no limit).
            ``max_np`` is its older name.
        slots: elastic, with ``host_discovery_script``: slots of hosts the script lists
            without a count.
        reset_limit: elastic: the job fails after this many resets (default: no limit).
        cooldown_range: elastic: ``(min, max)`` seconds a failing host stays blacklisted,
            growing between them with each failure (default: for good).
        host_discovery_script: elastic: an executable that prints the available
            ``host:slots`` lines; polled every second. Without it, ``hosts``/``hostfile`` (at
            least two hosts) are the fixed hosts of the elastic job.

    Elastic jobs run under bagua_hvd's own driver: ``use_mpi=True`` with them is a ValueError.

    Returns:
        A list with one entry per rank, ``results[r]`` being what ``func`` returned on rank r.
        Elastic jobs, as Horovod's: the results of ranks ``0 .. min_num_proc - 1`` of the job
        as it ended.

    Raises:
        RuntimeError: a rank failed (its traceback and Horovod's text naming the first rank that
            exited non-zero are in the message; the other ranks were stopped), or the job could
            not start (e.g. a host that ssh cannot reach, named in the message).
        ValueError: bad arguments (HostError, a ValueError, for host lists and slots).
    """
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    n = _resolve_num_proc(num_proc, np)
    min_n = _either("min_num_proc", min_num_proc, "min_np", min_np)
    max_n = _either("max_num_proc", max_num_proc, "max_np", max_np)
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    if mpi_args is not None and not isinstance(mpi_args, str):
        raise TypeError(f"mpi_args must be a string of mpirun arguments, got {mpi_args!r}")
    if ssh_port is not None and not (_is_int(ssh_port) and 1 <= ssh_port <= 65535):
        raise ValueError(f"ssh_port must be a port number in 1..65535, got {ssh_port!r}")
    timeout = _start_timeout(start_timeout)
    # Horovod's rule: a discovery script or a minimum makes the job elastic.
    elastic = host_discovery_script is not None or min_n is not None
    if elastic:
        settings = argparse.Namespace(
            num_proc=n, min_num_proc=min_n, max_num_proc=max_n, slots=slots,
            reset_limit=reset_limit, elastic_timeout=None,
            cooldown_range=None if cooldown_range is None else tuple(cooldown_range),
            host_discovery_script=None if host_discovery_script is None
            else os.fspath(host_discovery_script),
            hosts=hosts, hostfile=None if hostfile is None else os.fspath(hostfile),
            start_timeout=timeout, ssh_port=ssh_port,
            ssh_identity_file=None if ssh_identity_file is None else os.fspath(ssh_identity_file),
            output_filename=None if output_filename is None else os.fspath(output_filename),
            verbose=bool(verbose),
        )  # fmt: skip
        if hosts is not None and hostfile is not None:
            raise ValueError("bagua_hvd.run: pass hosts or hostfile, not both")
        if use_mpi:
            raise ValueError(
                "bagua_hvd.run: an elastic job (min_num_proc or host_discovery_script) runs "
                "under bagua_hvd's own driver, not mpirun: drop use_mpi"
            )
        check_elastic_settings(settings)  # ValueError / HostError naming the argument
    else:
        entries = _host_entries(n, hosts, hostfile)
        assign_slots(entries, n)  # HostError (a ValueError) for too few slots or a repeated host

    import cloudpickle

    try:
        payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(
            f"bagua_hvd.run: func/args/kwargs cannot be pickled with cloudpickle: {e}"
        ) from e
    env: Dict[str, str] = dict(_env or {})  # launch._run: the settings as bagua-run's flags
    nics = _nics(network_interface, network_interfaces)
    if nics:
        env["HOROVOD_GLOO_IFACE"] = nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    # The ranks must import the bagua_hvd that this process uses, also from a source checkout
    # (an installed one is found anyway: site-packages is not pushed ahead of PYTHONPATH).
    if Path(_PACKAGE_ROOT).name not in ("site-packages", "dist-packages"):
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")

    stores: List[task.KeyValue] = []

    def seed(server: task.KeyValue) -> None:  # before any rank starts
        task.put_blob(server, task.FUNC_KEY, payload)
        stores.append(server)

    command = [executable or sys.executable, "-m", "bagua_hvd.runner.task"]
    if elastic:
        return _run_elastic(settings, command, env, seed, stores)
    if use_mpi:
        return _run_mpi(payload, command, n, entries, env, mpi_args or "", bool(verbose))
    common: Dict[str, Any] = dict(
        extra_env=env,
        output_dir=None if output_filename is None else os.fspath(output_filename),
        verbose=bool(verbose),
        start_timeout=timeout,
        on_store=seed,
    )
    if only_this_machine(entries):
        result = launch(command, n, **common)
    else:
        result = launch_hosts(
            command,
            n,
            entries,
            ssh_port=ssh_port,
            ssh_identity=None if ssh_identity_file is None else os.fspath(ssh_identity_file),
            **common,
        )

    def outcome(rank: int) -> Optional[tuple]:
        return _outcome(stores[0], rank) if stores else None

    if result.failed_rank is not None:
        rank = result.failed_rank
        failure = outcome(rank)
        if failure is not None and failure[0] == "error":
            raise RuntimeError(
                f"bagua_hvd.run: rank {rank} failed:\n{failure[1]}\n{result.failure_message()}"
            )
        raise RuntimeError(
            f"bagua_hvd.run: rank {rank} failed without a Python traceback.\n"
            f"{result.failure_message()}"
        )
    if result.signal is not None:
        if result.signal == signal.SIGINT:
            raise KeyboardInterrupt
        raise RuntimeError(f"bagua_hvd.run: stopped by signal {result.signal}")
    outcomes = [outcome(rank) for rank in range(n)]
    missing = [rank for rank, o in enumerate(outcomes) if o is None or o[0] != "ok"]
    if missing:
        raise RuntimeError(
            f"bagua_hvd.run: ranks {missing} exited with status 0 but left no result"
        )
    return [o[1] for o in outcomes]
