"""bagua_hvd.run: functions run on real rank processes (no core library needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bagua_hvd
from bagua_hvd.runner.hosts import HostError

REPO = Path(__file__).resolve().parent.parent


def test_returns_results_by_rank() -> None:
    offset = 7  # captured by the closure: sent by value with cloudpickle

    def work(scale, bias=0):
        import os

        rank = int(os.environ["HOROVOD_RANK"])
        size = int(os.environ["HOROVOD_SIZE"])
        print(f"hello from {rank}")
        return {
            "rank": rank,
            "size": size,
            "value": rank * scale + bias + offset,
            "pid": os.getpid(),
        }

    results = bagua_hvd.run(work, args=(10,), kwargs={"bias": 1}, np=3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["size"] for r in results] == [3, 3, 3]
    assert [r["value"] for r in results] == [8, 18, 28]
    assert len({r["pid"] for r in results}) == 3 and os.getpid() not in {r["pid"] for r in results}


def test_num_proc_and_hosts(capfd: pytest.CaptureFixture) -> None:
    def work():
        import os

        print("rank", os.environ["HOROVOD_RANK"])
        return os.environ["HOROVOD_LOCAL_SIZE"]

    assert bagua_hvd.run(work, num_proc=2, hosts="localhost:2") == ["2", "2"]
    out = capfd.readouterr().out
    assert "[0]<stdout>:rank 0" in out and "[1]<stdout>:rank 1" in out
    assert bagua_hvd.run(work) == ["1"]  # default: one rank


def test_failure_raises_with_traceback() -> None:
    def work():
        import os
        import time

        if os.environ["HOROVOD_RANK"] == "1":
            raise ValueError("rank one is unhappy")
        time.sleep(60)  # must be stopped by the launcher

    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        bagua_hvd.run(work, np=2)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "rank 1 failed" in text
    assert "Traceback (most recent call last)" in text
    assert "ValueError: rank one is unhappy" in text


def test_unpicklable_result_is_a_failure() -> None:
    def work():
        import threading

        return threading.Lock()

    with pytest.raises(RuntimeError, match="could not be pickled"):
        bagua_hvd.run(work, np=1)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"num_proc": 2, "np": 3}, ValueError, "disagree"),
        ({"np": 0}, ValueError, ">= 1"),
        ({"np": 2, "min_np": 1}, ValueError, "fault tolerance mode with fewer than 2 hosts"),
        ({"np": 2, "min_np": 3, "hosts": "localhost:2,127.0.0.1:2"}, ValueError, "more than -np 2"),
        ({"np": 2, "min_np": 1, "min_num_proc": 2}, ValueError, "disagree"),
        ({"np": 2, "min_np": "1"}, ValueError, "min_num_proc must be an int >= 1"),
        ({"np": 2, "max_np": 1, "host_discovery_script": "d.sh"}, ValueError, "less than -np"),
        ({"np": 2, "hostfile": "/nonexistent/hosts.txt"}, HostError, "cannot read"),
        ({"np": 2, "hosts": "localhost:2", "hostfile": "h.txt"}, ValueError, "not both"),
        ({"np": 3, "hosts": "localhost:2"}, HostError, r"more processes \(3\).*slots \(2\)"),
        ({"np": 2, "hosts": "localhost:1,localhost:1"}, HostError, "more than once"),
        ({"np": 2, "ssh_port": 0}, ValueError, "ssh_port"),
        ({"np": 2, "use_mpi": True, "use_gloo": True}, ValueError, "only allow one set True"),
        (
            {"np": 2, "use_mpi": True, "min_np": 2, "hosts": "localhost:1,127.0.0.1:1"},
            ValueError,
            "drop use_mpi",
        ),
        ({"np": 2, "use_mpi": True, "mpi_args": ["-x", "A"]}, TypeError, "mpi_args"),
        ({"np": 2, "start_timeout": -1}, ValueError, "start_timeout"),
        ({"args": 5}, TypeError, "args"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        bagua_hvd.run(lambda: None, **kwargs)


def test_elastic_job_goes_on_without_a_failed_worker() -> None:
    """horovod.run's elastic mode (min_np): the worker on the second host dies in its first
    epoch; the host is blacklisted, rank 0 rolls back to its last commit and finishes alone.
    Horovod's results: ranks 0 .. min_np - 1 of the job as it ended."""

    def work():
        import os

        import torch

        import bagua_hvd.torch as hvd

        hvd.init()
        start_rank = hvd.rank()
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = hvd.elastic.TorchState(model, opt, epoch=0, sizes=[])

        @hvd.elastic.run
        def train(state):
            while state.epoch < 4:
                if state.epoch == 1 and start_rank == 1:
                    os._exit(3)  # this worker dies; its host is blacklisted
                total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"epoch.{state.epoch}")
                state.sizes.append((hvd.size(), int(total.item())))
                state.epoch += 1
                state.commit()
            return state.sizes

        return train(state)

    results = bagua_hvd.run(work, np=2, min_np=1, hosts="localhost:1,127.0.0.1:1")
    # epoch 0 at two ranks (committed), epoch 1 failed there and ran again alone
    assert results == [[(2, 2), (1, 1), (1, 1), (1, 1)]]


def test_hostfile_and_ssh_options_on_this_machine(tmp_path: Path) -> None:
    # One host naming this machine: no ssh (the ssh options are not used), slots from the file.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=2\n")
    with pytest.raises(HostError, match=r"more processes \(3\).*slots \(2\)"):
        bagua_hvd.run(lambda: None, np=3, hostfile=str(hostfile))

    def work():
        import os

        return os.environ["HOROVOD_RANK"], os.environ["HOROVOD_LOCAL_SIZE"]

    results = bagua_hvd.run(
        work, np=2, hostfile=str(hostfile), ssh_port=2222, ssh_identity_file="/nonexistent/key"
    )
    assert results == [("0", "2"), ("1", "2")]


def test_results_of_many_megabytes_come_back_intact() -> None:
    # Larger than one frame of the rendezvous store (16 MiB): func and results go in chunks.
    import numpy as np

    data = np.random.default_rng(5).integers(0, 2**31, size=3 << 20, dtype=np.int32)  # 12 MiB

    def work(data):
        import os

        import numpy as np

        rank = int(os.environ["HOROVOD_RANK"])
        return np.concatenate([data, data]) * (rank + 1), rank  # 24 MiB

    start = time.monotonic()
    results = bagua_hvd.run(work, args=(data,), np=2)
    assert [r[1] for r in results] == [0, 1]
    for rank, (value, _) in enumerate(results):
        assert value.dtype == np.int32 and value.nbytes == 24 << 20
        expected = np.tile(data, 2) * (rank + 1)  # independent of how work built it
        assert np.array_equal(value, expected)
    assert time.monotonic() - start < 60


def test_unreachable_host_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"host gpu-node-7\.invalid: (ssh failed|no ssh)"):
        bagua_hvd.run(lambda: None, np=2, hosts="gpu-node-7.invalid:2", start_timeout=3)
    assert time.monotonic() - start < 15


def test_import_stays_light() -> None:
    code = (
        "import sys, bagua_hvd\n"
        "assert bagua_hvd.__version__ == '0.1.0'\n"
        "heavy = [m for m in ('torch', 'tensorflow', 'cloudpickle', 'cffi') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from bagua_hvd import run\n"
        "from bagua_hvd.runner.api import run as api_run\n"
        "assert run is api_run\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
