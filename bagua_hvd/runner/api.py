"""``bagua_hvd.run``: horovod.run's Python API (run a function on every rank, collect results)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from bagua_hvd.runner import task
from bagua_hvd.runner.hosts import REMOTE_HOSTS_HINT, local_slots
from bagua_hvd.runner.launch import launch

# The directory holding the bagua_hvd package this process uses; the ranks import the same one.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _resolve_num_proc(num_proc: Optional[int], np: Optional[int]) -> int:
    if num_proc is not None and np is not None and num_proc != np:
        raise ValueError(f"num_proc={num_proc} and np={np} disagree; pass only one of them")
    value = num_proc if num_proc is not None else np
    if value is None:
        return 1
    if not _is_int(value) or value < 1:
        raise ValueError(f"num_proc must be an int >= 1, got {value!r}")
    return value


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
) -> List[Any]:
    """Runs ``func(*args, **kwargs)`` on ``num_proc`` (or ``np``) ranks; returns results by rank.

    Takes horovod.run's signature. Each rank is a fresh ``executable -m bagua_hvd.runner.task``
    process started like ``bagua-run`` starts its ranks (same environment, output prefixes and
    failure handling), so ``func`` may call ``hvd.init()``. ``func``, ``args`` and ``kwargs`` are
    sent with cloudpickle, and so are the results.

    Supported: ``hosts`` naming this machine (``"localhost:N"``), ``start_timeout``,
    ``output_filename``, ``verbose``, ``network_interface(s)``, ``executable``, ``use_gloo``
    (True or None). ``disable_cache`` is accepted and ignored. Elastic mode (``min_num_proc``,
    ``max_num_proc``, ``min_np``, ``max_np``, ``slots``, ``reset_limit``, ``cooldown_range``,
    ``host_discovery_script``), ``hostfile``, ssh options and MPI raise ValueError.

    Raises RuntimeError carrying the traceback of the first rank that failed.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    n = _resolve_num_proc(num_proc, np)
    elastic = {
        "min_num_proc": min_num_proc,
        "max_num_proc": max_num_proc,
        "min_np": min_np,
        "max_np": max_np,
        "slots": slots,
        "reset_limit": reset_limit,
        "cooldown_range": cooldown_range,
        "host_discovery_script": host_discovery_script,
    }
    given = [name for name, value in elastic.items() if value is not None]
    if given:
        raise ValueError(
            f"bagua_hvd.run: elastic mode is not supported yet ({', '.join(given)} "
            "given); use a fixed num_proc"
        )
    if hostfile is not None:
        raise ValueError(
            f"bagua_hvd.run: hostfile is not supported yet; pass hosts='localhost:{n}'"
        )
    if ssh_port is not None or ssh_identity_file is not None:
        raise ValueError(
            f"bagua_hvd.run: ssh_port/ssh_identity_file given, but {REMOTE_HOSTS_HINT}"
        )
    if use_mpi or mpi_args is not None:
        raise ValueError(
            "bagua_hvd.run: there is no MPI mode (use_mpi/mpi_args); bagua_hvd "
            "always uses its own Gloo-style controller"
        )
    if use_gloo is False:
        raise ValueError(
            "bagua_hvd.run: use_gloo=False asks for MPI, which bagua_hvd does not "
            "have; leave use_gloo as None or True"
        )
    if start_timeout is not None and not (
        isinstance(start_timeout, (int, float)) and start_timeout > 0
    ):
        raise ValueError(
            f"start_timeout must be a positive number of seconds, got {start_timeout!r}"
        )
    local_slots(n, hosts)  # HostError (a ValueError) for remote hosts or too few slots

    import cloudpickle

    env: Dict[str, str] = {}
    nics = _nics(network_interface, network_interfaces)
    if nics:
        env["HOROVOD_GLOO_IFACE"] = nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    # The ranks must import the bagua_hvd that this process uses, also from a source checkout
    # (an installed one is found anyway: site-packages is not pushed ahead of PYTHONPATH).
    if Path(_PACKAGE_ROOT).name not in ("site-packages", "dist-packages"):
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")

    with tempfile.TemporaryDirectory(prefix="bagua_hvd_run_") as job_dir:
        try:
            payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
        except Exception as e:
            raise TypeError(
                f"bagua_hvd.run: func/args/kwargs cannot be pickled with cloudpickle: {e}"
            ) from e
        with open(Path(job_dir) / task.FUNC_FILE, "wb") as f:
            f.write(payload)
        command = [executable or sys.executable, "-m", "bagua_hvd.runner.task", job_dir]
        result = launch(
            command,
            n,
            hosts=hosts,
            extra_env=env,
            output_dir=output_filename,
            verbose=bool(verbose),
            start_timeout=start_timeout if start_timeout is not None else 30,
        )
        outcomes = {}
        for rank in range(n):
            path_r = task.result_path(job_dir, rank)
            if path_r.exists():
                with open(path_r, "rb") as f:
                    outcomes[rank] = cloudpickle.load(f)

    if result.failed_rank is not None:
        rank = result.failed_rank
        outcome = outcomes.get(rank)
        if outcome is not None and outcome[0] == "error":
            raise RuntimeError(f"bagua_hvd.run: rank {rank} failed:\n{outcome[1]}")
        raise RuntimeError(
            f"bagua_hvd.run: rank {rank} failed without a Python traceback.\n"
            f"{result.failure_message()}"
        )
    if result.signal is not None:
        if result.signal == signal.SIGINT:
            raise KeyboardInterrupt
        raise RuntimeError(f"bagua_hvd.run: stopped by signal {result.signal}")
    missing = [rank for rank in range(n) if outcomes.get(rank, ("",))[0] != "ok"]
    if missing:
        raise RuntimeError(
            f"bagua_hvd.run: ranks {missing} exited with status 0 but left no result"
        )
    return [outcomes[rank][1] for rank in range(n)]
