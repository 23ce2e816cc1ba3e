"""``bagua-run --jsrun``: the job started by LSF's jsrun (IBM Job Step Manager), as horovodrun
builds it (horovod/runner/js_run.py): an explicit resource file (ERF) splitting each host's
logical CPUs among its ranks, one GPU each (or ``--binding-args`` instead), mpirun's
implementation flags and ``--mpi-args`` through ``--smpiargs``, ``--output-filename`` through
``--stdio_stdout``/``--stdio_stderr``. Each rank's ``hvd.init()`` then forms the job through MPI
(bagua_hvd.common.bootstrap: jsrun's MPI sets the rank variables), as under mpirun.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from bagua_hvd.runner.job import LaunchError, shell_exit_code

NO_LSF_ERROR = (
    "bagua-run --jsrun: no LSF job here (LSB_JOBID is not set): jsrun runs only inside an LSF "
    "allocation (bsub); elsewhere use -H/--hostfile or --mpi"
)
NO_JSRUN_ERROR = (
    "bagua-run --jsrun: jsrun is not on PATH: run inside an LSF allocation with jsrun, or use "
    "-H/--hostfile or --mpi"
)


def using_lsf() -> bool:
    """True inside an LSF job (LSB_JOBID set), as Horovod's LSFUtils.using_lsf."""
    return "LSB_JOBID" in os.environ


def is_jsrun_installed() -> bool:
    return shutil.which("jsrun") is not None


def mpi_implementation_flags(version_text: str, tcp: bool = False) -> Optional[List[str]]:
    """horovodrun's MPI flags for ``mpirun --version``'s text: Open MPI's ``-mca pml ob1 -mca
    btl ^openib``, Spectrum MPI's ``-tcp`` with ``--tcp``, none for MPICH and Intel MPI; None
    for no known MPI."""
    # In Horovod's order (mpi_run._get_mpi_implementation): Open MPI is recognized first.
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return ["-mca pml ob1", "-mca btl ^openib"]
    if "IBM Spectrum MPI" in version_text:
        return ["-tcp"] if tcp else []
    if "HYDRA" in version_text or "MPICH" in version_text or "Intel(R) MPI" in version_text:
        return []
    return None


def generate_jsrun_rankfile(
    num_proc: int,
    hosts: Sequence[Tuple[str, int]],
    num_gpus: int,
    cpus_per_host: int,
    path: Optional[str] = None,
) -> str:
    """Writes jsrun's explicit resource file for ``num_proc`` ranks over ``hosts`` (host,
    slots), in host order: each rank gets one GPU and ``cpus_per_host // num_gpus``
    consecutive logical CPUs of its host (horovodrun's split). Returns the path (a new
    temporary file unless ``path``; the caller removes it). ValueError for a host with more
    slots than GPUs or too few slots in all."""
    if num_gpus < 1:
        raise ValueError(f"jsrun: {num_gpus} GPUs per host: at least one is needed")
    cpu_per_gpu = cpus_per_host // num_gpus
    chosen: List[Tuple[str, int]] = []
    remaining = num_proc
    for host, slots in hosts:
        if slots > num_gpus:
            raise ValueError(
                f"Invalid host input, slot count for host '{host}:{slots}' is greater than "
                f"number of GPUs per host '{num_gpus}'."
            )
        take = min(slots, remaining)
        chosen.append((host, take))
        remaining -= take
        if remaining == 0:
            break
    if remaining != 0:
        raise ValueError(f"Not enough slots on the hosts to fulfill the {num_proc} requested.")
    if path is None:
        fd, path = tempfile.mkstemp(prefix="bagua_hvd-jsrun-", suffix=".erf")
        os.close(fd)
    lines = ["overlapping_rs: allow", "cpu_index_using: logical"]
    rank = 0
    for host, slots in chosen:
        lines.append("")
        for i in range(slots):
            first = i * cpu_per_gpu
            lines.append(
                f"rank: {rank}: {{ hostname: {host}; cpu: {{{first}-{first + cpu_per_gpu - 1}}} "
                "; gpu: * ; mem: * }"
            )
            rank += 1
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def jsrun_command(
    command: Sequence[str],
    mpi_flags: Sequence[str],
    extra_mpi_args: str = "",
    binding_args: str = "",
    rankfile: str = "",
    output_filename: str = "",
) -> str:
    """jsrun's shell command line, as horovodrun writes it: ``--binding-args`` if given, else
    ``--erf_input RANKFILE``; the output file for both streams; the MPI flags and extra
    arguments as one ``--smpiargs`` word; then the command, quoted."""
    smpiargs = " ".join(mpi_flags)
    if extra_mpi_args:
        smpiargs += " " + extra_mpi_args
    binding = binding_args or f"--erf_input {rankfile}"
    output = (
        f"--stdio_stderr {output_filename} --stdio_stdout {output_filename}"
        if output_filename
        else ""
    )
    smpi = f"--smpiargs {shlex.quote(smpiargs)}" if smpiargs else ""
    return f"jsrun {binding} {output} {smpi} " + " ".join(shlex.quote(word) for word in command)


def run_jsrun(
    command: Sequence[str],
    np: int,
    hosts: Sequence[Tuple[str, int]],
    extra_env: Dict[str, str],
    mpi_args: str = "",
    binding_args: str = "",
    output_filename: str = "",
    tcp: bool = False,
    verbose: bool = False,
) -> int:
    """Runs the job with jsrun; returns its exit status. Each host's logical CPUs are this
    machine's (the hosts of an LSF allocation are alike), its GPUs the most slots any host
    has (one GPU per rank)."""
    if not using_lsf():
        raise LaunchError(NO_LSF_ERROR)
    if not is_jsrun_installed():
        raise LaunchError(NO_JSRUN_ERROR)
    from bagua_hvd.runner.mpi import find_mpirun, version_text

    mpirun = find_mpirun()
    version = version_text(mpirun)
    flags = mpi_implementation_flags(version, tcp)
    if flags is None:
        raise LaunchError(
            f"bagua-run --jsrun: {mpirun} is no MPI horovodrun knows (Open MPI, Spectrum MPI, "
            f"MPICH, Intel MPI): {version.strip()[:200]!r}"
        )
    rankfile = ""
    try:
        if not binding_args:
            gpus = max(slots for _, slots in hosts)
            try:
                rankfile = generate_jsrun_rankfile(np, hosts, gpus, os.cpu_count() or 1)
            except ValueError as e:
                raise LaunchError(f"bagua-run --jsrun: {e}") from None
        cmd = jsrun_command(command, flags, mpi_args, binding_args, rankfile, output_filename)
        if verbose:
            print(f"bagua-run: {cmd}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(["/bin/sh", "-c", cmd], env=dict(os.environ, **extra_env))
        except OSError as e:
            raise LaunchError(f"cannot run jsrun: {e.strerror or e}") from None
        return shell_exit_code(proc.returncode)
    finally:
        if rankfile:
            os.unlink(rankfile)
