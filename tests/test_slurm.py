"""Jobs under a real Slurm on this machine: slurmctld, slurmd and munged from the distribution's
packages (Debian: slurmctld, slurmd, slurm-client, munge; libpmix-dev for ``srun --mpi=pmix``),
started by hand for this module with their own key, sockets, ports, spool and state in a
temporary directory, and stopped at its end.

Two slurmd run when this machine has a host name other than localhost: nodes ``localhost`` and
``$(hostname)``, both this machine (Debian's slurmd is built without --enable-multiple-slurmd, so
each node needs its own NodeHostname; ``-N name`` picks the node, the node's Port its socket).
Both names resolve, as real node names do, and bagua_hvd takes them for two hosts.

Every check is against Slurm's own account of the step (SLURM_PROCID, SLURMD_NODENAME) and
numpy's sum of what each rank contributed.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "sinfo", "squeue", "scancel")
START_TIMEOUT = 40  # seconds for the daemons to come up and the nodes to be idle
JOB_TIMEOUT = 100  # seconds for one srun/salloc/sbatch command, start-up included

# A rank's program: joins the job with hvd.init() and reports what it sees, Slurm's view of the
# same task, and an allreduce of values every rank can recompute (numpy, seeded by rank), in a
# file of $RESULT_DIR (srun interleaves long lines of several tasks).
PROG = r"""
import json, os, sys
import numpy as np
import torch
import bagua_hvd.torch as hvd
from bagua_hvd.common._native import ffi, lib

hvd.init()
rank, size = hvd.rank(), hvd.size()
mine = np.random.default_rng(1000 + rank).standard_normal(1000)
total = hvd.allreduce(torch.from_numpy(mine), op=hvd.Sum, name="slurm.sum")
ranks = hvd.allgather(torch.tensor([rank]), name="slurm.ranks")
env = os.environ
result = json.dumps({
    "rank": rank, "size": size,
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "host": env.get("HOROVOD_HOSTNAME"),
    "transports": [ffi.string(lib().bhvd_transport_name(p)).decode() for p in range(size)],
    "sum": total.tolist(), "ranks": ranks.tolist(),
    "mpi": "mpi4py.MPI" in sys.modules,
    "procid": env.get("SLURM_PROCID"), "slurm_node": env.get("SLURMD_NODENAME"),
    "slurm_job": env.get("SLURM_JOB_ID"),
})
with open(os.path.join(env["RESULT_DIR"], f"rank-{rank}.json"), "x") as f:
    f.write(result)
print("rank", rank, "of", size, "done", flush=True)
hvd.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"({path}: {e})"
    return "\n".join(text[-lines:])


@dataclass
class Slurm:
    """A running single-machine cluster: its directory, nodes and the clients' environment."""

    root: Path
    nodes: List[str]
    env: Dict[str, str]
    procs: Dict[str, subprocess.Popen] = field(default_factory=dict)

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").iterdir()):
            out.append(f"---- {path.name}\n{_tail(path)}")
        return "\n".join(out)

    def client(self, *argv: str, timeout: float = 15) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    def result_dir(self) -> Path:
        """The current test's directory for the ranks' reports (made by the first call)."""
        test = os.environ.get("PYTEST_CURRENT_TEST", "test").split(" ")[0]
        path = self.root / "results" / re.sub(r"[^A-Za-z0-9_.-]", "_", test)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def cancel_all(self) -> None:
        """Cancels every job of this cluster and waits (bounded) until none is left."""
        try:
            self.client("scancel", "--user", getpass.getuser())
        except (OSError, subprocess.TimeoutExpired):
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                left = self.client("squeue", "-h", "-o", "%i").stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                return
            if not left:
                return
            time.sleep(0.2)

    def run(self, argv: List[str], *, secret: Optional[str] = None,
            timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:  # fmt: skip
        """Runs a Slurm client command (srun, salloc, sbatch) to its end, bounded: past the
        timeout every job is cancelled and the test fails with the output so far."""
        env = dict(self.env, RESULT_DIR=str(self.result_dir()))
        if secret is not None:
            env["BAGUA_HVD_SECRET"] = secret
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cancel_all()
            proc.kill()
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"{argv} ran past {timeout} s\n{out}\n{err}\n{self.logs()}")
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _check_binaries() -> Dict[str, str]:
    found = {name: shutil.which(name, path=SBIN) for name in DAEMONS + CLIENTS}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        pytest.skip(
            f"needs Slurm and munge from the distribution ({', '.join(missing)} not found; "
            "Debian: apt-get install slurmctld slurmd slurm-client munge)"
        )
    return found  # type: ignore[return-value]


def _conf(root: Path, nodes: List[str], munge_socket: Path, user: str) -> str:
    ports = [_free_port() for _ in range(len(nodes) + 1)]
    lines = [
        "ClusterName=baguatest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'run'}/slurmd-%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
        # No cgroups (a container has none to give): processes tracked through /proc.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        # The nodes declare 4 CPUs whatever this machine has: the declared ones count.
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "KillWait=2",
        # `sbatch --wait` polls after 2 s, then 4x longer while below MinJobAge/2 (up to 32 s):
        # at 17 s it polls every 8 s, well before a finished job's record is purged.
        "MinJobAge=17",
        # Job ids (and with them the srun rendezvous port) differ between runs.
        f"FirstJobId={int.from_bytes(os.urandom(3), 'big') % 900_000 + 1000}",
    ]
    # Debian's slurmd has no --enable-multiple-slurmd: one NodeHostname per node (any name:
    # `slurmd -N` says which node a daemon is), all at 127.0.0.1 on their own ports. The node
    # named localhost comes last (Slurm takes "localhost" for the first node while it is the
    # only one).
    for i, (name, port) in enumerate(zip(nodes, ports[1:])):
        lines.append(f"NodeName={name} NodeHostname=bagua-slurm-node{i} NodeAddr=127.0.0.1 "
                     f"Port={port} CPUs=4 State=UNKNOWN")  # fmt: skip
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=10 State=UP")
    return "\n".join(lines) + "\n"


def _nodes() -> List[str]:
    """This machine's names for Slurm's nodes: its host name and localhost when the host name
    resolves and is not localhost itself, else localhost alone."""
    host = socket.gethostname()
    if host.lower() == "localhost" or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", host):
        return ["localhost"]
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return ["localhost"]
    return [host, "localhost"]


def _stop(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm():
    found = _check_binaries()
    user = getpass.getuser()
    root = Path(tempfile.mkdtemp(prefix="bagua-slurm-", dir="/tmp"))
    procs: List[subprocess.Popen] = []
    cluster: Optional[Slurm] = None
    try:
        # munged wants every directory above its socket searchable by all, its key private.
        root.chmod(0o755)
        for sub in ("run", "log", "state", "spool"):
            (root / sub).mkdir(mode=0o755)
        keys = root / "munge"
        keys.mkdir(mode=0o700)
        key = keys / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munge_socket = root / "run" / "munge.sock"
        logs = root / "log"
        nodes = _nodes()
        for name in nodes:
            (root / "spool" / name).mkdir(mode=0o755)
        conf = root / "slurm.conf"
        conf.write_text(_conf(root, nodes, munge_socket, user))
        # Each slurmd reads its own copy of slurm.conf, next to its own mpi.conf: Slurm's PMIx
        # plugin makes a directory per job step under PMIxCliTmpDirBase (/tmp by default),
        # which two nodes of one machine would both claim.
        for name in nodes:
            (root / f"etc-{name}").mkdir()
            (root / f"etc-{name}" / "slurm.conf").write_text(conf.read_text())
            pmix_tmp = root / f"pmix-{name}"
            pmix_tmp.mkdir(mode=0o755)
            (root / f"etc-{name}" / "mpi.conf").write_text(f"PMIxCliTmpDirBase={pmix_tmp}\n")

        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_", "HOROVOD_",
                                    "BAGUA_HVD_", "PMIX_", "PMI_", "OMPI_"))}  # fmt: skip
        env.update(
            SLURM_CONF=str(conf),
            PATH=os.pathsep.join([os.path.dirname(sys.executable), SBIN]),
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            HOROVOD_GLOO_TIMEOUT_SECONDS="30",
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            # Open MPI's shared-memory segments of the tasks srun starts directly (no mpirun
            # to remove them at the end) go to this cluster's directory, not /dev/shm.
            OMPI_MCA_btl_sm_backing_directory=str(root),
        )
        cluster = Slurm(root=root, nodes=nodes, env=env)

        def start(name: str, argv: List[str]) -> subprocess.Popen:
            out = open(logs / f"{name}.out", "wb")
            p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            out.close()
            procs.append(p)
            cluster.procs[name] = p
            return p

        start("munged", [found["munged"], "--foreground", f"--socket={munge_socket}",
                         f"--key-file={key}", f"--pid-file={root / 'run' / 'munged.pid'}",
                         f"--log-file={logs / 'munged.log'}", f"--seed-file={keys / 'seed'}"])  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not munge_socket.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"munged did not start (exit {procs[0].poll()})\n{cluster.logs()}")
            time.sleep(0.05)
        start("slurmctld", [found["slurmctld"], "-D", "-f", str(conf)])
        for name in nodes:
            node_conf = root / f"etc-{name}" / "slurm.conf"
            start(f"slurmd-{name}", [found["slurmd"], "-D", "-N", name, "-f", str(node_conf)])

        states: Dict[str, str] = {}
        while True:
            dead = [f"{n} (exit {p.returncode})" for n, p in cluster.procs.items()
                    if p.poll() is not None]  # fmt: skip
            if dead:
                pytest.fail(f"Slurm's daemons exited: {', '.join(dead)}\n{cluster.logs()}")
            try:
                out = cluster.client("sinfo", "-h", "-N", "-o", "%N %t", timeout=10).stdout
            except subprocess.TimeoutExpired:
                out = ""
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in nodes):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"Slurm's nodes not idle after {START_TIMEOUT} s: {states}\n"
                            f"{cluster.logs()}")  # fmt: skip
            time.sleep(0.2)
        prog = root / "prog.py"
        prog.write_text(PROG)
        yield cluster
    finally:
        if cluster is not None and cluster.procs.get("slurmctld") is not None:
            cluster.cancel_all()
        # slurmd before slurmctld before munged (each needs the next to shut down cleanly).
        _stop(list(reversed(procs)))
        shutil.rmtree(root, ignore_errors=True)


def _results(result_dir: Path) -> List[dict]:
    """What every rank reported, by rank."""
    found = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank-*.json"))]
    return sorted(found, key=lambda r: r["rank"])


def _expected_sum(size: int) -> np.ndarray:
    return sum(np.random.default_rng(1000 + r).standard_normal(1000) for r in range(size))


def _check_job(results: List[dict], size: int, text: str) -> None:
    """One job of ``size`` ranks: every rank present once, every rank's allreduce the numpy
    sum of all ranks' values, every rank's allgather all the ranks."""
    assert [r["rank"] for r in results] == list(range(size)), text
    expected = _expected_sum(size)
    for r in results:
        assert r["size"] == size, text
        np.testing.assert_allclose(r["sum"], expected, rtol=1e-12, atol=1e-12)
        assert r["ranks"] == list(range(size)), text


def _secret() -> str:
    return os.urandom(32).hex()


def _srun(slurm: Slurm, *args: str) -> List[str]:
    return ["srun", "--time=2", "--kill-on-bad-exit=1", *args,
            sys.executable, str(slurm.root / "prog.py")]  # fmt: skip


def test_srun_tasks_with_a_shared_secret_form_one_job(slurm):
    proc = slurm.run(_srun(slurm, "-n", "2"), secret=_secret())
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text + slurm.logs()
    results = _results(slurm.result_dir())
    _check_job(results, 2, text)
    for r in results:
        # Slurm's task r is rank r; both tasks on one node: shared memory, one host.
        assert r["procid"] == str(r["rank"]), text
        assert r["slurm_node"] == results[0]["slurm_node"] and r["host"] == r["slurm_node"], text
        assert (r["local_rank"], r["local_size"]) == (r["rank"], 2), text
        assert (r["cross_rank"], r["cross_size"]) == (0, 1), text
        assert r["transports"] == ["self" if p == r["rank"] else "shm" for p in range(2)], text
        # With the secret, the tasks do not start MPI (an MPI built for Slurm would abort).
        assert r["mpi"] is False, text


def test_srun_tasks_without_the_secret_fail_naming_it(slurm):
    # Every task must fail on its own (no --kill-on-bad-exit: a task killed by Slurm would
    # hide whether it would have run alone as a job of size 1).
    argv = ["srun", "--time=2", "--label", "-n", "2", sys.executable, str(slurm.root / "prog.py")]
    mpi4py = importlib.util.find_spec("mpi4py") is not None
    proc = slurm.run(argv)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert not list(slurm.result_dir().iterdir()), text
    for rank in range(2):
        lines = [line for line in text.splitlines() if re.match(rf"\s*{rank}: ValueError", line)]
        assert len(lines) == 1, text
        assert (
            f"this process was started by srun (Slurm) as rank {rank} of 2, but it cannot join "
            "the other ranks" in lines[0]
        ), text
        assert "export BAGUA_HVD_SECRET=" in lines[0], text
        if mpi4py:  # MPI started alone: the message says why (srun did not start it)
            assert "sees rank 0 of 1: srun did not start it (srun --mpi=pmix" in lines[0], text
    # srun's own account: both tasks exited with status 1.
    assert re.search(r"srun: error: \S+: tasks? 0-1: Exited with exit code 1", proc.stderr) or (
        re.search(r"task 0: Exited with exit code 1", proc.stderr)
        and re.search(r"task 1: Exited with exit code 1", proc.stderr)
    ), text


def _srun_pmix(slurm: Slurm, *args: str) -> subprocess.CompletedProcess:
    """srun --mpi=pmix, no secret: the tasks can only meet through MPI (mpi4py's Open MPI,
    whose PMIx client talks to Slurm's PMIx server)."""
    pytest.importorskip("mpi4py")
    proc = slurm.run(_srun(slurm, "--mpi=pmix", *args))
    text = proc.stdout + proc.stderr
    if "Invalid MPI type 'pmix'" in proc.stderr and "can not load PMIx library" in proc.stderr:
        pytest.skip("Slurm's mpi/pmix plugin cannot load libpmix.so (Debian: libpmix-dev)")
    assert proc.returncode == 0, text + slurm.logs()
    return proc


def test_srun_with_pmix_forms_the_job_through_mpi(slurm):
    proc = _srun_pmix(slurm, "-n", "2")
    text = proc.stdout + proc.stderr
    results = _results(slurm.result_dir())
    _check_job(results, 2, text)
    for r in results:
        assert r["mpi"] is True and r["procid"] == str(r["rank"]), text
        assert (r["local_rank"], r["local_size"], r["cross_size"]) == (r["rank"], 2, 1), text
        assert r["transports"] == ["self" if p == r["rank"] else "shm" for p in range(2)], text


def test_srun_with_pmix_on_two_nodes_of_one_machine(slurm):
    # Through MPI, hosts are told apart by MPI's processor name (the machine's host name), not
    # by Slurm's node names: the two nodes, one machine, are one host of 4 sharing memory.
    _two_nodes(slurm)
    proc = _srun_pmix(slurm, "-N", "2", "-n", "4", "--ntasks-per-node=2")
    text = proc.stdout + proc.stderr
    results = _results(slurm.result_dir())
    _check_job(results, 4, text)
    assert len({r["slurm_node"] for r in results}) == 2, text
    for r in results:
        i = r["rank"]
        assert r["mpi"] is True and r["procid"] == str(i), text
        assert r["host"] == socket.gethostname(), text
        assert (r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) == (
            i, 4, 0, 1,
        ), text  # fmt: skip
        assert r["transports"] == ["self" if p == i else "shm" for p in range(4)], text


def _two_nodes(slurm: Slurm) -> None:
    if len(slurm.nodes) < 2:
        pytest.skip(f"one Slurm node only: host name {socket.gethostname()!r} is localhost "
                    "or does not resolve")  # fmt: skip


def _check_two_nodes(results: List[dict], on: List[str], text: str) -> None:
    """Horovod's placement of 2 nodes x 2 tasks: ranks 0, 1 on one node, 2, 3 on the other,
    ``on`` naming each rank's node as Slurm has it."""
    assert on[0] == on[1] != on[2] == on[3], text
    for r in results:
        i = r["rank"]
        assert r["host"] == on[i], text
        assert (r["local_rank"], r["local_size"]) == (i % 2, 2), text
        assert (r["cross_rank"], r["cross_size"]) == (i // 2, 2), text
        # The two nodes are one machine under two names: bagua_hvd sees two hosts.
        kinds = ["self" if p == i else ("shm" if p // 2 == i // 2 else "tcp") for p in range(4)]
        assert r["transports"] == kinds, text


def test_srun_on_two_nodes_places_ranks_as_horovod(slurm):
    _two_nodes(slurm)
    proc = slurm.run(_srun(slurm, "-N", "2", "-n", "4", "--ntasks-per-node=2"), secret=_secret())
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text + slurm.logs()
    results = _results(slurm.result_dir())
    _check_job(results, 4, text)
    assert [r["procid"] for r in results] == ["0", "1", "2", "3"], text
    _check_two_nodes(results, [r["slurm_node"] for r in results], text)


def _launch(slurm: Slurm, np_: int) -> List[str]:
    return [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np_),
            sys.executable, str(slurm.root / "prog.py")]  # fmt: skip


def test_bagua_run_inside_salloc_takes_the_allocation(slurm):
    # One task on each node when there are two: bagua-run's ranks land on two hosts only if it
    # took them from the allocation (alone it would start both here, as one host).
    n = len(slurm.nodes)
    proc = slurm.run(["salloc", "--time=2", "-N", str(n), "-n", "2", *_launch(slurm, 2)])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text + slurm.logs()
    granted = re.search(r"salloc: Granted job allocation (\d+)", proc.stderr)
    assert granted, text
    results = _results(slurm.result_dir())
    _check_job(results, 2, text)
    for r in results:
        # bagua-run's ranks, in salloc's job: not srun tasks, no MPI.
        assert r["slurm_job"] == granted.group(1), text
        assert r["procid"] is None and r["mpi"] is False, text
    if n == 1:
        assert [(r["local_rank"], r["local_size"], r["cross_size"]) for r in results] == [
            (0, 2, 1),
            (1, 2, 1),
        ], text
    else:
        assert sorted(r["host"] for r in results) == sorted(slurm.nodes), text
        assert [(r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"])
                for r in results] == [(0, 1, 0, 2), (0, 1, 1, 2)], text  # fmt: skip
        assert [r["transports"] for r in results] == [["self", "tcp"], ["tcp", "self"]], text


def test_bagua_run_in_a_batch_job_on_two_nodes(slurm):
    _two_nodes(slurm)
    out = slurm.root / "batch-%j.out"
    script = slurm.root / "batch.sh"
    script.write_text(
        "#!/bin/sh\n"
        'echo "ALLOCATION $SLURM_JOB_NODELIST $SLURM_TASKS_PER_NODE"\n'
        "exec " + " ".join(_launch(slurm, 4)) + "\n"
    )
    script.chmod(0o755)
    proc = slurm.run(["sbatch", "--wait", "--time=2", "-N", "2", "--ntasks-per-node=2",
                      f"--output={out}", str(script)])  # fmt: skip
    m = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    log = slurm.root / f"batch-{m.group(1)}.out"
    output = log.read_text() if log.exists() else "(no output)"
    text = proc.stdout + proc.stderr + output
    assert proc.returncode == 0, text + slurm.logs()
    results = _results(slurm.result_dir())
    _check_job(results, 4, text)
    # The allocation as Slurm gave it to the batch script: two plain names, 2 tasks each.
    alloc = re.search(r"^ALLOCATION (\S+) (\S+)$", output, re.M)
    assert alloc and alloc.group(2) == "2(x2)", text
    first, second = alloc.group(1).split(",")
    assert sorted([first, second]) == sorted(slurm.nodes), text
    for r in results:
        # bagua-run's ranks (not srun tasks) in the batch job, started by bagua-run itself
        # (both nodes are this machine), on the hosts of the allocation in its order.
        assert r["slurm_job"] == m.group(1) and r["mpi"] is False, text
    _check_two_nodes(results, [first, first, second, second], text)
