"""The tf.data service (bagua_hvd.tensorflow.data, Horovod's horovod.tensorflow.data), as
Horovod's examples/tensorflow2/tensorflow2_mnist_data_service.py uses it: a compute job
(``python -m bagua_hvd.tensorflow.data.compute_worker`` at 2 ranks) serves a training job at 2
ranks, with the tf.data dispatcher in the compute job and in the training job.

- the consumer (tests/workers/tf_data_service_consumer.py) checks what every rank receives in
  each of Horovod's modes against what they imply, values recomputed in numpy;
- the example trains a Keras model on scikit-learn's digits through the service and must
  reach a good accuracy;
- the compute job ends by itself, exit status 0, once the training job asked for the shutdown,
  leaving no process and no config file behind;
- the compute service (the jobs' meeting point) refuses strangers and wrong keys, bounds its
  waits and names what it waited for; bad configs fail naming the field.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bagua_hvd.rendezvous import compute_service
from bagua_hvd.rendezvous.compute_service import ComputeClient, ComputeService

ROOT = Path(__file__).resolve().parent.parent
CONSUMER = ROOT / "tests" / "workers" / "tf_data_service_consumer.py"
IN_THREAD = ROOT / "tests" / "workers" / "tf_data_service_in_thread.py"
EXAMPLE = ROOT / "examples" / "tensorflow2" / "tensorflow2_mnist_data_service.py"
JOB_TIMEOUT_S = 240  # a bound, not an expectation
KEY = b"k" * 32


# ---- the compute service alone (no TensorFlow) ---------------------------------------------


@pytest.fixture
def service(monkeypatch):
    for name in ("HOROVOD_GLOO_IFACE", "HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        monkeypatch.delenv(name, raising=False)  # as outside a launched job
    compute = ComputeService(2, 2, KEY)
    yield compute
    compute.shutdown()


def test_service_listens_on_the_jobs_address_only(service):
    # Outside a launched job, and without HOROVOD_GLOO_IFACE: loopback, not every interface.
    ((host, port),) = [a for addrs in service.addresses().values() for a in addrs]
    assert host == "127.0.0.1" and list(service.addresses()) == ["lo"]
    assert service._server.host == "127.0.0.1"


def test_service_registration_and_shutdown(service):
    client = ComputeClient(service.addresses(), KEY, verbose=2)
    client.register_dispatcher(1, "grpc://127.0.0.1:5000")
    client.register_dispatcher(1, "grpc://127.0.0.1:5000")  # the same again is fine
    assert client.wait_for_dispatcher_registration(1, 1) == "grpc://127.0.0.1:5000"
    with pytest.raises(ValueError, match="already been registered under different address"):
        client.register_dispatcher(1, "grpc://127.0.0.1:5001")
    with pytest.raises(IndexError, match=r"within \[0\.\.1\]: 2"):
        client.register_dispatcher(2, "grpc://127.0.0.1:5002")
    with pytest.raises(TimeoutError, match="dispatcher 0 to register"):
        client.wait_for_dispatcher_registration(0, 0.2)

    client.register_worker_for_dispatcher(1, 2)
    client.register_worker_for_dispatcher(1, 2)  # a worker counts once
    with pytest.raises(TimeoutError, match="workers for dispatcher 1 to register"):
        client.wait_for_dispatcher_worker_registration(1, 0.2)
    client.register_worker_for_dispatcher(1, 3)
    client.wait_for_dispatcher_worker_registration(1, 1)

    done = []
    waiter = threading.Thread(target=lambda: done.append(client.wait_for_shutdown()))
    waiter.start()
    time.sleep(0.3)
    assert not done
    ComputeClient(service.addresses(), KEY).shutdown()  # what the training job's rank 0 does
    waiter.join(5)
    assert done == [None]


def test_service_refuses_wrong_keys_and_strangers(service):
    # A stranger holding a connection open, another sending garbage: the job's clients still
    # get through, and a client without the key is refused with a clear error.
    ((host, port),) = [a for addrs in service.addresses().values() for a in addrs]
    silent = socket.create_connection((host, port))
    noisy = socket.create_connection((host, port))
    noisy.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
    try:
        client = ComputeClient(service.addresses(), KEY)
        client.register_dispatcher(0, "grpc://127.0.0.1:6000")
        assert client.wait_for_dispatcher_registration(0, 1) == "grpc://127.0.0.1:6000"
        with pytest.raises(ConnectionError, match="cannot reach the compute service"):
            ComputeClient(service.addresses(), b"x" * 32).shutdown()
    finally:
        silent.close()
        noisy.close()


def test_service_is_gone(monkeypatch):
    compute = ComputeService(1, 1, KEY)
    addresses = compute.addresses()
    compute.shutdown()
    compute.shutdown()  # idempotent
    monkeypatch.setattr(compute_service, "CONNECT_TIMEOUT_S", 0.5)
    with pytest.raises(ConnectionError, match="is the compute job .* running"):
        ComputeClient(addresses, KEY).register_dispatcher(0, "grpc://127.0.0.1:7000")


def test_service_rejects_bad_shapes():
    with pytest.raises(ValueError, match="dispatchers must be larger than 0"):
        ComputeService(0, 1, KEY)
    with pytest.raises(ValueError, match="workers per dispatcher must be larger than 0"):
        ComputeService(1, 0, KEY)


# ---- the config file -------------------------------------------------------------------------


def _config(**fields):
    from bagua_hvd.tensorflow.data import TfDataServiceConfig

    values = dict(
        dispatchers=1,
        workers_per_dispatcher=2,
        dispatcher_side="compute",
        addresses={"lo": [("127.0.0.1", 1234)]},
        key=KEY,
        timeout=30,
    )
    values.update(fields)
    return TfDataServiceConfig(**values)


def test_config_file_round_trip(tmp_path):
    pytest.importorskip("tensorflow")
    from bagua_hvd.tensorflow.data import TfDataServiceConfig

    path = tmp_path / "compute.json"
    config = _config()
    config.write(str(path))
    # Horovod's JSON: the fields by name, the key in hex, addresses as [host, port] lists.
    assert json.loads(path.read_text()) == {
        "dispatchers": 1,
        "workers_per_dispatcher": 2,
        "dispatcher_side": "compute",
        "addresses": {"lo": [["127.0.0.1", 1234]]},
        "key": KEY.hex(),
        "timeout": 30,
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the key
    assert TfDataServiceConfig.read(str(path)) == config
    assert TfDataServiceConfig.read(str(path), wait_for_file_creation=True) == config
    assert [p.name for p in tmp_path.iterdir()] == ["compute.json"]


def test_bad_configs_fail_naming_the_problem(tmp_path):
    pytest.importorskip("tensorflow")
    from bagua_hvd.tensorflow.data import TfDataServiceConfig

    with pytest.raises(ValueError, match="dispatcher_side must be 'compute' or 'training'"):
        _config(dispatcher_side="gpu")
    with pytest.raises(ValueError, match="dispatchers must be a positive int"):
        _config(dispatchers=0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        _config(timeout=0)
    with pytest.raises(ValueError, match="lacks addresses, key"):
        TfDataServiceConfig.from_dict({"dispatchers": 1, "workers_per_dispatcher": 1,
                                       "dispatcher_side": "compute"})  # fmt: skip
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a tf.data service config"):
        TfDataServiceConfig.read(str(bad))
    missing = tmp_path / "missing.json"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="missing.json did not appear within 0.3s"):
        TfDataServiceConfig.read(str(missing), wait_for_file_creation=True, timeout=0.3)
    assert time.monotonic() - start < 5


def test_a_hanging_tf_data_server_stop_does_not_hold_the_job(monkeypatch, caplog):
    """TensorFlow's worker stop can hang while it still produces for a consumer gone mid-epoch
    (seen with the example's infinite dataset): the compute job goes on after STOP_WAIT_S."""
    pytest.importorskip("tensorflow")
    from bagua_hvd.tensorflow.data import compute_service as tfcs

    release = threading.Event()

    class StuckServer:
        def _stop(self):
            release.wait(30)

        def join(self):
            pass

    monkeypatch.setattr(tfcs, "STOP_WAIT_S", 0.2)
    start = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger=tfcs.__name__):
            tfcs._stop_server(StuckServer(), "Worker")
        assert time.monotonic() - start < 5
        assert "tf.data Worker did not stop within 0.2s" in caplog.text
    finally:
        release.set()


# ---- jobs ------------------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    for key in [k for k in env if k.startswith("HOROVOD_")]:
        del env[key]  # an outer launcher's rank variables must not leak into the jobs
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env.setdefault("BAGUA_HVD_OP_TIMEOUT_SECONDS", "60")
    return env


def _start(np: int, *args: str, log=subprocess.PIPE) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np), sys.executable]
    return subprocess.Popen(
        cmd + list(args), cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


def _finish(
    proc: subprocess.Popen, what: str, timeout: float = JOB_TIMEOUT_S, log: Path | None = None
) -> str:
    """The job's output (or its ``log`` file's) once it ended with status 0; fails the test
    (the job killed) else."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        out = log.read_text() if log else out
        pytest.fail(f"{what} did not finish within {timeout} s:\n{out}")
    out = log.read_text() if log else out
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{out}"
    return out


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _processes_naming(text: str) -> list:
    """Pids of the processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _serve(tmp_path: Path, side: str, trainers: list) -> list:
    """Runs a compute job (2 ranks, dispatchers on ``side``) and then each training job of
    ``trainers`` (argument lists, the config file appended) at 2 ranks; returns the training
    jobs' outputs. The compute job must end by itself, cleanly, after the last one."""
    configfile = str(tmp_path / f"compute-{side}.json")
    module = "bagua_hvd.tensorflow.data.compute_worker"
    log_path = tmp_path / f"compute-{side}.log"
    with open(log_path, "w") as log:  # a file: the job never blocks on a full pipe
        compute = _start(
            2, "-m", module, "--dispatcher-side", side, "--timeout", "60", configfile, log=log
        )
    try:
        outputs = []
        for i, args in enumerate(trainers):
            what = f"training job {i} ({side}; the compute job's log: {log_path})"
            outputs.append(_finish(_start(2, *args, configfile), what))
        compute_out = _finish(compute, f"the compute job ({side})", timeout=60, log=log_path)
    finally:
        _kill(compute)
    assert _processes_naming(configfile) == [], "processes of the jobs are left behind"
    assert not os.path.exists(configfile), "the compute job left its config file behind"
    assert "Traceback" not in compute_out, compute_out
    return outputs


def _check_consumer(out: str) -> None:
    for rank in (0, 1):
        for mode, reuse in (("distributed_epoch", False), ("parallel_epochs", False),
                            ("distributed_epoch", True)):  # fmt: skip
            assert f"rank {rank}: {mode} reuse_dataset={reuse}: " in out, out


def _accuracy(out: str) -> float:
    lines = [line for line in out.splitlines() if "final accuracy on all 1797 digits: " in line]
    assert lines, out
    return float(lines[-1].rsplit(" ", 1)[1])


EXAMPLE_ARGS = [str(EXAMPLE), "--epochs", "6", "--steps-per-epoch", "16"]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_compute_side_dispatcher(tmp_path):
    """Dispatcher in the compute job: the consumer's checks, then Horovod's example, which
    trains and stops the compute job."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    consumer, example = _serve(
        tmp_path, "compute", [[str(CONSUMER), "--no-shutdown"], EXAMPLE_ARGS]
    )
    _check_consumer(consumer)
    assert _accuracy(example) > 0.85, example


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_training_side_dispatcher(tmp_path):
    """Dispatcher in the training job (rank 0, ``tf_data_service``), colocated with training:
    the consumer's checks; its rank 0 stops the compute job."""
    pytest.importorskip("tensorflow")
    (consumer,) = _serve(tmp_path, "training", [[str(CONSUMER)]])
    _check_consumer(consumer)
    assert "rank 0: compute job shutdown requested" in consumer, consumer


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_compute_job_in_the_training_ranks(tmp_path):
    """Horovod's own test pattern: compute_worker.main in a thread of each training rank."""
    pytest.importorskip("tensorflow")
    out = _finish(_start(2, str(IN_THREAD), str(tmp_path)), "the in-thread job")
    for rank in (0, 1):
        for side in ("compute", "training"):
            assert f"rank {rank}: {side} side in-thread: whole epoch read" in out, out
    assert list(tmp_path.iterdir()) == [], "config files left behind"


@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_compute_worker_bad_arguments(tmp_path):
    """Without a launcher the compute job has 1 rank: 2 dispatchers cannot divide it."""
    pytest.importorskip("tensorflow")
    configfile = str(tmp_path / "compute.json")
    cmd = [sys.executable, "-m", "bagua_hvd.tensorflow.data.compute_worker"]
    proc = subprocess.run(
        cmd + ["--dispatchers", "2", configfile], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Number of processes (1) must be a multiple of number of dispatchers (2)" in (
        proc.stderr
    ), proc.stderr
    assert not os.path.exists(configfile)
